"""Multi-LoRA at the model layer (model/lora.py, lora_adapter.py): PEFT adapters' logits as PEFT computes them on
every attention path, rows of one batch on different adapters (and the base model, bit for bit), 2 tensor-
parallel ranks as 1, Phi-3's adapters on its fused qkv_proj / gate_up_proj, and every adapter refused with the
key that refuses it."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from model_checks import ATOL
from safetensors.torch import load_file, save_file

from saguaro_dist.model.cuda_graphs import StepGraphs
from saguaro_dist.model.runner import ModelRunner

peft = pytest.importorskip("peft")
PROMPT = [5, 17, 3, 44, 9, 28, 61, 2, 13, 7]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_ALL = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def make_adapter(base_path, out, seed: int, targets, r: int = 4, alpha: int = 8, **kw):
    """A PEFT adapter with non-zero B (init_lora_weights=False), saved to `out`; the PEFT model, for logits."""
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **kw)
    model = peft.get_peft_model(base, config).eval()
    with torch.no_grad():  # PEFT's non-zero init is small: made larger, so a wrong delta shows in the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
    model.save_pretrained(out)
    return model


def peft_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0].float()


@pytest.fixture(scope="module")
def llama_adapters(tiny_checkpoint, tmp_path_factory):
    """The tiny Llama and two adapters: attention + down (r 4), every projection with rsLoRA (r 8)."""
    path = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora_llama")
    one = make_adapter(path, root / "one", 1, ["q_proj", "v_proj", "down_proj"])
    two = make_adapter(path, root / "two", 2, ALL, r=8, alpha=16, use_rslora=True)
    return {"path": path, "dirs": [root / "one", root / "two"], "models": [one, two]}


def lora_runner(path, dirs, **kw) -> ModelRunner:
    runner = ModelRunner(path, max_loras=len(dirs), max_lora_rank=8, **kw)
    for slot, d in enumerate(dirs):
        runner.load_lora(slot, str(d))
    return runner


def decode_path(runner, seq: list[int], slot) -> torch.Tensor:
    """Half prefilled (in chunks when max_num_batched_tokens is small), the rest one token a step."""
    runner.add("s", lora_slot=slot)
    half = len(seq) // 2
    got = [runner.extend(["s"], [seq[:half]], [half])[0]]
    got += [runner.extend(["s"], [[t]], [1])[0] for t in seq[half:]]
    runner.free("s")
    return torch.cat(got)


def check_branches(runner, model, slot, prefix: list[int], paths: list[list[int]]) -> None:
    runner.add("p", lora_slot=slot)
    runner.extend(["p"], [prefix], [1])
    state, got = runner.branch_start(["p"] * len(paths), [len(prefix)] * len(paths), torch.tensor([p[0] for p in paths]))
    for depth in range(len(paths[0])):
        if depth:
            got = runner.branch_step(state, torch.tensor([p[depth] for p in paths]))
        want = torch.stack([peft_logits(model, prefix + p[:depth + 1])[-1] for p in paths])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    runner.free("p")


def test_llama_adapters_match_peft_on_every_path(llama_adapters):
    """Prefill (whole and chunked), decode and branch steps, each adapter as PEFT's model computes it."""
    for chunk in (2048, 3):
        runner = lora_runner(llama_adapters["path"], llama_adapters["dirs"], max_num_batched_tokens=chunk)
        for slot, model in enumerate(llama_adapters["models"]):
            torch.testing.assert_close(decode_path(runner, PROMPT, slot), peft_logits(model, PROMPT), atol=ATOL, rtol=0)
    for slot, model in enumerate(llama_adapters["models"]):
        check_branches(runner, model, slot, PROMPT[:6], [[3, 40, 5], [11, 40, 62]])


def test_qwen3_adapter_with_qk_norm_and_layers_to_transform(tiny_checkpoint, tmp_path):
    """Qwen3 (per-head q / k norms): every projection, rsLoRA, only layer 1 adapted (layers_to_transform)."""
    path = tiny_checkpoint("qwen3")
    model = make_adapter(path, tmp_path / "a", 3, ALL, r=4, alpha=4, use_rslora=True, layers_to_transform=[1])
    runner = lora_runner(path, [tmp_path / "a"])
    torch.testing.assert_close(decode_path(runner, PROMPT, 0), peft_logits(model, PROMPT), atol=ATOL, rtol=0)
    check_branches(runner, model, 0, PROMPT[:5], [[1, 2], [9, 2], [33, 60]])


@pytest.fixture(scope="module")
def phi3_adapters(tmp_path_factory):
    """A tiny Phi-4-mini-like model (fused qkv_proj / gate_up_proj, partial rotary) and two adapters on its fused
    modules: every one (r 4), qkv + down with rsLoRA (r 8)."""
    from test_model_phi3 import save_phi3
    root = tmp_path_factory.mktemp("lora_phi3")
    save_phi3(root / "m", "phi4_mini", seed=5)
    one = make_adapter(root / "m", root / "one", 4, PHI3_ALL)
    two = make_adapter(root / "m", root / "two", 5, ["qkv_proj", "down_proj"], r=8, alpha=16, use_rslora=True)
    return {"path": root / "m", "dirs": [root / "one", root / "two"], "models": [one, two]}


@pytest.fixture(scope="module")
def llama_one_kv_adapters(tiny_checkpoint, tmp_path_factory):
    """The tiny Llama draft: one KV head, replicated over tensor-parallel ranks; adapters on every projection."""
    path, root = tiny_checkpoint("draft"), tmp_path_factory.mktemp("lora_one_kv")
    for seed in (0, 1):
        make_adapter(path, root / str(seed), 6 + seed, ALL)
    return {"path": path, "dirs": [root / "0", root / "1"]}


@pytest.fixture(scope="module")
def phi3_one_kv_adapters(tmp_path_factory):
    """A Phi-4-mini-like model of one KV head: an adapter on its fused qkv_proj keeps B's k and v columns whole on
    each rank."""
    from test_model_phi3 import save_phi3
    root = tmp_path_factory.mktemp("lora_phi3_one_kv")
    save_phi3(root / "m", "phi4_mini", seed=6, num_key_value_heads=1)
    make_adapter(root / "m", root / "0", 8, PHI3_ALL)
    make_adapter(root / "m", root / "1", 9, ["qkv_proj", "down_proj"], r=8, alpha=16)
    return {"path": root / "m", "dirs": [root / "0", root / "1"]}


def test_phi3_fused_module_adapters_match_peft(phi3_adapters):
    """One LoRA over each fused linear (B as wide as q + k + v): prefill whole and chunked, decode, branches,
    and a batch mixing both adapters with a base row (bit for bit a runner without LoRA)."""
    path, models = phi3_adapters["path"], phi3_adapters["models"]
    for chunk in (2048, 3):
        runner = lora_runner(path, phi3_adapters["dirs"], max_num_batched_tokens=chunk)
        for slot, model in enumerate(models):
            torch.testing.assert_close(decode_path(runner, PROMPT, slot), peft_logits(model, PROMPT), atol=ATOL, rtol=0)
    for slot, model in enumerate(models):
        check_branches(runner, model, slot, PROMPT[:6], [[3, 40, 5], [11, 40, 62]])
    runner, plain = lora_runner(path, phi3_adapters["dirs"]), ModelRunner(path)
    ids, prompts = ["a", "b", "c"], [PROMPT, PROMPT[:7], PROMPT[2:]]
    for sid, slot in zip(ids, [0, None, 1]):
        runner.add(sid, lora_slot=slot)
        plain.add(sid)
    got = runner.extend(ids, prompts, [len(p) for p in prompts])
    base = plain.extend(ids, prompts, [len(p) for p in prompts])
    torch.testing.assert_close(got[0], peft_logits(models[0], prompts[0]), atol=ATOL, rtol=0)
    torch.testing.assert_close(got[2], peft_logits(models[1], prompts[2]), atol=ATOL, rtol=0)
    assert torch.equal(got[1], base[1])


def test_adapter_for_the_other_module_layout_refused(llama_adapters, phi3_adapters, tmp_path):
    """Phi-3 adapters name its fused modules; q_proj ... on Phi-3 (or qkv_proj on Llama) are refused by name."""
    q_only = edited(llama_adapters["dirs"][0], tmp_path / "q", tensors=lambda sd: {k: v for k, v in sd.items()
                                                                                    if "q_proj" in k})
    runner = ModelRunner(phi3_adapters["path"], max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match="only LoRA on qkv_proj, o_proj, gate_up_proj, down_proj .* model_type 'phi3'"):
        runner.load_lora(0, str(q_only))
    qkv_only = edited(phi3_adapters["dirs"][0], tmp_path / "qkv", tensors=lambda sd: {k: v for k, v in sd.items()
                                                                                       if "qkv_proj" in k})
    runner = ModelRunner(llama_adapters["path"], max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match="only LoRA on q_proj, .* model_type 'llama'"):
        runner.load_lora(0, str(qkv_only))


def test_mixed_batch_rows_as_alone_and_base_rows_bitwise(llama_adapters):
    """Adapter 0, adapter 1 and the base model in one batch (prefill of mixed lengths, then decode, then
    branches): each row what it gets alone; base rows bit for bit a runner without LoRA, same batch."""
    path, models = llama_adapters["path"], llama_adapters["models"]
    runner, plain = lora_runner(path, llama_adapters["dirs"]), ModelRunner(path)
    ids, slots, prompts = ["a", "b", "c"], [0, 1, None], [PROMPT, PROMPT[:7], PROMPT[2:]]
    for sid, slot in zip(ids, slots):
        runner.add(sid, lora_slot=slot)
        plain.add(sid)
        assert runner.lora_slot(sid) == slot
    got = runner.extend(ids, prompts, [len(p) for p in prompts])
    base = plain.extend(ids, prompts, [len(p) for p in prompts])
    step = runner.extend(ids, [[4], [5], [6]], [1, 1, 1])
    base_step = plain.extend(ids, [[4], [5], [6]], [1, 1, 1])
    for i in (0, 1):
        torch.testing.assert_close(got[i], peft_logits(models[i], prompts[i]), atol=ATOL, rtol=0)
        torch.testing.assert_close(step[i][0], peft_logits(models[i], prompts[i] + [[4], [5]][i])[-1], atol=ATOL, rtol=0)
    assert torch.equal(got[2], base[2]) and torch.equal(step[2], base_step[2])
    state, logits = runner.branch_start(["a", "c", "b", "a"], [5, 3, 4, 11], torch.tensor([1, 2, 3, 8]))
    plain_state, plain_logits = plain.branch_start(["a", "c", "b", "a"], [5, 3, 4, 11], torch.tensor([1, 2, 3, 8]))
    torch.testing.assert_close(logits[0], peft_logits(models[0], PROMPT[:5] + [1])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[2], peft_logits(models[1], PROMPT[:4] + [3])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[3], peft_logits(models[0], PROMPT + [4, 8])[-1], atol=ATOL, rtol=0)
    assert torch.equal(logits[1], plain_logits[1])
    step, plain_step = (r.branch_step(s, torch.tensor([7, 7, 7, 7])) for r, s in ((runner, state), (plain, plain_state)))
    torch.testing.assert_close(step[2], peft_logits(models[1], PROMPT[:4] + [3, 7])[-1], atol=ATOL, rtol=0)
    assert torch.equal(step[1], plain_step[1])


def test_slot_table_and_runner_edges(llama_adapters, caplog):
    path, dirs = llama_adapters["path"], llama_adapters["dirs"]
    with pytest.raises(ValueError, match="LoRA is off"):
        ModelRunner(path).load_lora(0, str(dirs[0]))
    with pytest.raises(ValueError, match="max_loras must be an integer >= 0"):
        ModelRunner(path, max_loras=-1)
    runner = ModelRunner(path, max_loras=2, max_lora_rank=8)
    with pytest.raises(ValueError, match="slot 1 holds no adapter"):
        runner.add("x", lora_slot=1)
    with pytest.raises(ValueError, match=r"integer in 0\.\.1"):
        runner.load_lora(2, str(dirs[0]))
    runner.load_lora(0, str(dirs[0]))
    runner.add("x", lora_slot=0)
    runner.add("y")
    with pytest.raises(ValueError, match="slot 0 is in use by sequence"):
        runner.evict_lora(0)
    runner.extend(["x"], [PROMPT], [1])
    with pytest.raises(ValueError, match="different LoRA adapters"):
        runner.copy_prefix("x", "y", 3)
    runner.free("x")
    runner.evict_lora(0)
    with pytest.raises(ValueError, match="holds no adapter"):
        runner.add("z", lora_slot=0)
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.model.cuda_graphs"):
        graphs = StepGraphs(runner.model, runner.pool, runner.cos, runner.signed_sin, runner.group, 2, capture=False)
    assert graphs.refused and "LoRA adapters are enabled" in caplog.text


# ---- refusals: each names its key ----------------------------------------------------------------------------
def edited(src, dst, config: dict | None = None, tensors=None):
    """A copy of adapter `src` with config keys replaced and (tensors: a function of the state dict) its weights."""
    shutil.copytree(src, dst)
    conf = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**conf, **(config or {})}))
    if tensors is not None:
        file = dst / "adapter_model.safetensors"
        save_file(tensors(load_file(file)), file)
    return dst


def _embedding(sd):
    return {**sd, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 64)}


def _narrow_a(sd):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    return {**sd, key: sd[key][:, :16].contiguous()}


REFUSED = [
    ({"use_dora": True}, None, "use_dora: DoRA"),
    ({"bias": "lora_only"}, None, "bias 'lora_only'"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"target_modules": ["q_proj", "lm_head"]}, None, "names lm_head"),
    ({"target_modules": r".*(embed_tokens|q_proj)"}, None, "names model.embed_tokens"),
    ({"r": 16}, None, "rank 16 is greater than max_lora_rank 8"),
    ({"fan_in_fan_out": True}, None, "fan_in_fan_out"),
    ({"rank_pattern": {"q_proj": 2}}, None, "rank_pattern"),
    ({"lora_bias": True}, None, "lora_bias"),
    ({"peft_type": "IA3"}, None, "peft_type 'IA3'"),
    ({}, _embedding, "only LoRA on q_proj"),
    ({}, _narrow_a, r"shape \[4, 16\], the base model's q_proj needs \[4, 32\]"),
]


@pytest.mark.parametrize("config, tensors, match", REFUSED)
def test_refused_adapters(llama_adapters, tmp_path, config, tensors, match):
    bad = edited(llama_adapters["dirs"][0], tmp_path / "bad", config, tensors)
    runner = ModelRunner(llama_adapters["path"], max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match=match):
        runner.load_lora(0, str(bad))


def test_refused_other_base_and_missing_adapter(llama_adapters, tiny_checkpoint, tmp_path):
    runner = ModelRunner(tiny_checkpoint("qwen3"), max_loras=1, max_lora_rank=8)  # head_dim 16: q_proj is 64 wide
    with pytest.raises(ValueError, match="is this adapter for another base model"):
        runner.load_lora(0, str(llama_adapters["dirs"][0]))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        runner.load_lora(0, str(tmp_path))
    with pytest.raises(ValueError, match="not a directory and not a Hugging Face id"):
        runner.load_lora(0, str(tmp_path / "nope"))


# ---- tensor parallel: 2 gloo ranks ---------------------------------------------------------------------------
def workload(runner: ModelRunner) -> list[torch.Tensor]:
    """A mixed batch (adapter 0, base, adapter 1): prefill, decode, branch steps."""
    for sid, slot in (("a", 0), ("b", None), ("c", 1)):
        runner.add(sid, lora_slot=slot)
    out = runner.extend(["a", "b", "c"], [PROMPT, PROMPT[:4], PROMPT[3:]], [3, 4, 2])
    out += runner.extend(["c", "a"], [[8], [9]], [1, 1])
    state, logits = runner.branch_start(["a", "c", "b"], [6, 7, 4], [20, 21, 22])
    return out + [logits, runner.branch_step(state, torch.tensor([30, 31, 32]))]


TWO_RANK_KINDS = ["llama_adapters", "phi3_adapters", "llama_one_kv_adapters", "phi3_one_kv_adapters"]


def _rank(rank: int, init_method: str, jobs: list[tuple[str, list[str]]], result_file: str):
    from test_model_tp import gloo_world
    torch.set_num_threads(1)
    with gloo_world(rank, 2, init_method) as group:
        for job, (path, dirs) in enumerate(jobs):
            torch.save(workload(lora_runner(path, dirs, tp_group=group)), f"{result_file}.{job}.{rank}")


@pytest.fixture(scope="module")
def two_rank_workloads(request, tmp_path_factory):
    """{kind: (rank 0's, rank 1's workload)}: every kind in one spawn of 2 gloo ranks, as a spawned rank spends
    seconds importing this module (torch, transformers, peft) before it runs anything."""
    from test_model_tp import rendezvous
    torch.set_num_threads(1)
    jobs = [(str(a["path"]), [str(d) for d in a["dirs"]]) for a in map(request.getfixturevalue, TWO_RANK_KINDS)]
    out = tmp_path_factory.mktemp("lora_two_ranks") / "out"
    mp.spawn(_rank, args=(rendezvous(), jobs, str(out)), nprocs=2, join=True)
    return {kind: (torch.load(f"{out}.{job}.0"), torch.load(f"{out}.{job}.1")) for job, kind in enumerate(TWO_RANK_KINDS)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", TWO_RANK_KINDS)
def test_two_ranks_equal_one(kind, request, two_rank_workloads):
    """Phi-3: each rank's columns of a fused B are its q, k and v (gate and up) blocks. One KV head: each rank
    holds it (and B's columns of it) whole."""
    torch.set_num_threads(1)
    adapters = request.getfixturevalue(kind)
    rank0, rank1 = two_rank_workloads[kind]
    want = workload(lora_runner(adapters["path"], [str(d) for d in adapters["dirs"]]))
    for a, b, w in zip(rank0, rank1, want, strict=True):
        torch.testing.assert_close(a, w, atol=ATOL, rtol=0)
        torch.testing.assert_close(b, a, atol=0, rtol=0)


def test_a_load_that_fails_mid_way_leaves_the_slot_empty(llama_adapters):
    """set_slot runs layer by layer: a tensor of another shape in layer 1 failed after layer 0 took the new
    adapter, and the slot still named the old one, so a sequence on it crashed the forward (a reviewer's
    reproduction). Now the slot is emptied: adding to it is refused, the base model runs on."""
    import dataclasses
    from saguaro_dist.model.lora_adapter import load_adapter
    path, dirs = llama_adapters["path"], llama_adapters["dirs"]
    runner = lora_runner(path, dirs[:1])
    good = load_adapter(str(dirs[1]), runner.config, 8)
    weights = dict(good.weights)
    a, b = weights[(1, "q_proj")]
    weights[(1, "q_proj")] = (a, b[:-1])
    with pytest.raises(RuntimeError):
        runner.load_lora(0, dataclasses.replace(good, weights=weights))
    assert runner.lora.adapters[0] is None
    with pytest.raises(ValueError, match="holds no adapter"):
        runner.add("s", lora_slot=0)
    runner.load_lora(0, good)  # the slot takes a good adapter again
    runner.add("s", lora_slot=0)
    runner.extend(["s"], [PROMPT], [1])
