"""IBM Granite (model_type "granite") and AI2 OLMo 2 ("olmo2"): logits as transformers' GraniteForCausalLM /
Olmo2ForCausalLM compute them on tiny seeded checkpoints, greedy ar / sd / ssd as its generate (a draft of the
same family), their config fields validated at load, and the Llama path left without an added op."""
from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import DEVICE, assert_greedy_equal, hf_greedy
from model_checks import random_tokens, runner_logits, save_seeded
from test_step_graphs import static_runner, steps
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (AutoModelForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM,
                          Olmo2Config, Olmo2ForCausalLM)

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.model.hf_config import parse_config
from saguaro_dist.model.runner import ModelRunner

VOCAB = 64
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": None,
          "eos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False}
# Granite 3.x 2B's scalars (attention_multiplier 1/64, not 1/sqrt(head_dim)); logits_scaling flattens the logits
GRANITE_SCALARS = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
                   "logits_scaling": 8.0}
# Granite 3.x ties its LM head to the embeddings (which embedding_multiplier scales only as they are read)
FAMILIES = {"granite": (GraniteForCausalLM, lambda: GraniteConfig(**{**COMMON, "tie_word_embeddings": True},
                                                                  **GRANITE_SCALARS)),
            "olmo2": (Olmo2ForCausalLM, lambda: Olmo2Config(**COMMON))}
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def save_family(path, family: str, seed: int = 0, sharpen: float = 1.0):
    """A seeded tiny checkpoint written by transformers; norms randomised (HF: ones), q and k scaled up (HF's
    init makes attention near uniform, whatever its scale: a wrong scale would pass unseen), the LM head
    scaled by `sharpen` (peaked distributions, as a real LM's, for the greedy runs)."""
    return save_seeded(path, *FAMILIES[family], seed, sharpen)


def save_perturbed_draft(path, source, seed: int, noise: float = 0.15) -> None:
    """A draft of the same family and vocabulary, close to the target: its weights plus relative noise."""
    gen = torch.Generator().manual_seed(seed)
    clone = type(source)(source.config).eval()
    with torch.no_grad():
        for p, q in zip(clone.parameters(), source.parameters()):
            p.copy_(q + noise * q.std() * torch.randn(q.shape, generator=gen))
    clone.save_pretrained(path)


def tokens(seed: int, n: int) -> list[int]:
    return random_tokens(seed, n, VOCAB)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_in_prefill_and_decode(tmp_path, family):
    model = save_family(tmp_path / family, family, seed=3)
    seq = tokens(2, 24)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / family, dtype=torch.float32).eval()(
            torch.tensor([seq])).logits[0].float()
    assert type(model).__name__.lower().startswith(family)
    torch.testing.assert_close(runner_logits(ModelRunner(tmp_path / family), seq), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_prefill_matches_transformers_bit_for_bit(tmp_path, family):
    """In bf16 the order of roundings shows: OLMo 2 keeps its cos / sin in fp32 (q and k rotate in fp32),
    and its norms multiply the weight before the cast. A whole prompt is bitwise transformers' (as Llama's)."""
    save_family(tmp_path / family, family, seed=3)
    seq = tokens(2, 16)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / family, dtype=torch.bfloat16).eval()(
            torch.tensor([seq])).logits[0].float()
    runner = ModelRunner(tmp_path / family, dtype=torch.bfloat16)
    runner.add("s")
    torch.testing.assert_close(runner.extend(["s"], [seq], [len(seq)])[0], want, atol=0, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_extend_of_mixed_lengths_matches_transformers(tmp_path, family):
    """The masked dense path (sequences at different positions in one forward), not the causal kernel."""
    save_family(tmp_path / family, family, seed=4)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / family, dtype=torch.float32).eval()
    runner = ModelRunner(tmp_path / family)
    seqs = [tokens(7, 9), tokens(8, 5)]
    runner.add("a"), runner.add("b")
    runner.extend(["a", "b"], [seqs[0][:4], seqs[1][:2]], [1, 1])
    got = runner.extend(["a", "b"], [seqs[0][4:], seqs[1][2:]], [5, 3])
    for seq, rows in zip(seqs, got):
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0, -len(rows):]
        torch.testing.assert_close(rows, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_branch_steps_match_transformers(tmp_path, family):
    """The tree-branch path (a draft's, or a target's in SSD): branches over one stored prefix, stepped."""
    save_family(tmp_path / family, family, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / family, dtype=torch.float32).eval()
    runner = ModelRunner(tmp_path / family)
    prefix, steps = tokens(9, 7), [[3, 11], [40, 40], [5, 62]]
    runner.add("s")
    runner.extend(["s"], [prefix], [1])
    state, got = runner.branch_start(["s", "s"], [7, 7], torch.tensor(steps[0]))
    for depth, step in enumerate(steps):
        if depth:
            got = runner.branch_step(state, torch.tensor(step))
        with torch.no_grad():
            want = hf(torch.tensor([prefix + [s[j] for s in steps[:depth + 1]] for j in range(2)])).logits[:, -1]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_static_steps_cuda_graphs_capture_give_the_eager_logits(tmp_path, family):
    """StaticBatch / StaticBranchBatch (run uncaptured here; captured on a GPU) take the family's scale too."""
    save_family(tmp_path / family, family, seed=6)
    got, want = steps(static_runner(tmp_path / family)), steps(ModelRunner(tmp_path / family))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"pair_{request.param}")
    torch.set_num_threads(1)
    sharpen = 4.0 * (GRANITE_SCALARS["logits_scaling"] if request.param == "granite" else 1.0)
    model = save_family(root / "target", request.param, seed=0, sharpen=sharpen)
    save_perturbed_draft(root / "draft", model, seed=1)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": model}


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_generation_matches_transformers_generate(family_pair, mode):
    prompt = tokens(5, 12)
    n = 24
    want = hf_greedy(family_pair["model"], prompt, n)
    speculative = {} if mode == "ar" else {"draft": family_pair["draft"], "k": 3, "draft_executor": "thread"}
    with LLM(device=DEVICE, model=family_pair["target"], mode=mode, max_batch_size=1, **speculative) as llm:
        got = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
    assert_greedy_equal(list(got), want, prompt, family_pair["model"])


class _OpCounter(TorchDispatchMode):
    """Every aten op a forward runs, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def decode_ops(path) -> list[str]:
    runner = ModelRunner(path)
    runner.add("s")
    runner.extend(["s"], [tokens(1, 6)], [1])
    with _OpCounter() as counter:
        runner.extend(["s"], [[3]], [1])
    return counter.ops


def test_scalars_of_one_add_no_op_to_the_llama_path(tmp_path):
    """A Granite checkpoint whose multipliers are 1 (attention_multiplier 1/sqrt(head_dim)) runs exactly
    Llama's decode ops; real Granite scalars add one multiply per sublayer, one for the embeddings and one
    divide for the logits."""
    unit = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 8 ** -0.5,
            "logits_scaling": 1.0}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**COMMON)).save_pretrained(tmp_path / "llama")
    GraniteForCausalLM(GraniteConfig(**COMMON, **unit)).save_pretrained(tmp_path / "unit")
    GraniteForCausalLM(GraniteConfig(**COMMON, **GRANITE_SCALARS)).save_pretrained(tmp_path / "granite")
    llama = decode_ops(tmp_path / "llama")
    assert decode_ops(tmp_path / "unit") == llama
    granite = decode_ops(tmp_path / "granite")
    extra = {op: granite.count(op) - llama.count(op) for op in set(granite)}
    assert {op: n for op, n in extra.items() if n} == {"aten.mul": 2 * COMMON["num_hidden_layers"] + 1, "aten.div": 1}


def granite_json(**changes) -> dict:
    return {**GraniteConfig(**COMMON, **GRANITE_SCALARS).to_dict(), **changes}


@pytest.mark.parametrize("key", list(GRANITE_SCALARS))
@pytest.mark.parametrize("value", [0, -1.0, "8", None, float("inf")])
def test_bad_granite_scalars_are_refused_clearly(key, value):
    with pytest.raises(ValueError, match=f"model_type 'granite'\\) {key} must be a finite number > 0, got"):
        parse_config(granite_json(**{key: value}))


def test_granite_scalars_default_to_one_as_transformers_reads_them():
    hf = {k: v for k, v in granite_json().items() if k not in GRANITE_SCALARS}
    cfg = parse_config(hf)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_scaling) == (1, 1, 1, 1)


def test_olmo2_reads_its_own_norm_eps_default():
    hf = {k: v for k, v in Olmo2Config(**COMMON).to_dict().items() if k != "rms_norm_eps"}
    cfg = parse_config(hf)
    assert cfg.rms_norm_eps == 1e-5 and cfg.post_norms and not cfg.qk_norm


def test_a_family_still_unsupported_is_refused_naming_the_supported_ones(tmp_path):
    save_family(tmp_path / "m", "olmo2")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "olmo"}))
    with pytest.raises(ValueError, match="model_type 'olmo'.*supported model_type: .*granite, olmo2"):
        ModelRunner(tmp_path / "m")


def test_a_granite_hidden_act_other_than_silu_is_refused():
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        parse_config(granite_json(hidden_act="gelu"))


# ---- tensor parallel: Granite's scalars split as Llama's; OLMo 2's whole-projection q / k norms refused ----
def _tp_rank(rank: int, port: int, path: str, result_file: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        try:
            result = runner_logits(ModelRunner(path, tp_group=dist.group.WORLD), tokens(3, 12))
        except ValueError as err:
            result = str(err)
        torch.save(result, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_two_ranks(tmp_path, family):
    """Granite over 2 ranks gives the one-rank logits; OLMo 2 (each q / k norm spans every head, which a rank
    holds a slice of) is refused by name instead of failing on a shape."""
    import torch.multiprocessing as mp
    from test_model_tp import free_port
    save_family(tmp_path / "m", family)
    mp.spawn(_tp_rank, args=(free_port(), str(tmp_path / "m"), str(tmp_path / "out")), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"out.{rank}") for rank in (0, 1)]
    if family == "olmo2":
        assert all("cannot split OLMo 2's q / k norms" in g for g in got)
        return
    want = runner_logits(ModelRunner(str(tmp_path / "m")), tokens(3, 12))
    torch.testing.assert_close(got[0], want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], got[0], atol=0, rtol=0)
