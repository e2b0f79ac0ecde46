"""Google Gemma 3 (model_type "gemma3_text": Gemma3ForCausalLM; "gemma3": Gemma3ForConditionalGeneration's
language model): logits as transformers computes them on tiny seeded checkpoints whose prompts run past the
sliding window (two ropes: the sliding layers' local one, the full layers' linearly scaled one), on every
attention path, greedy ar / sd / ssd as its generate (a gemma3_text draft), its config read as transformers
reads it, and what this runtime cannot compute refused, naming the field."""
from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import DEVICE, assert_greedy_equal, hf_greedy
from safetensors.torch import load_file, save_file
from model_checks import hf_logits, random_tokens, randomise, runner_logits
from test_model_families import save_perturbed_draft
from test_step_graphs import static_runner, steps
from transformers import (AutoModelForCausalLM, Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration,
                          Gemma3TextConfig)

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.model.hf_config import context_limit, parse_config
from saguaro_dist.model.runner import ModelRunner

VOCAB, WINDOW = 64, 6
# q_pre_attn_scalar 12, not head_dim 8: a wrong attention scale shows; the full layer's rope linear x8 (as 4B-27B)
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
        "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
        "query_pre_attn_scalar": 12, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
          "image_size": 28, "patch_size": 14}
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def save_gemma3(path, seed: int = 0, sharpen: float = 1.0) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**TEXT)).eval()
    randomise(model, sharpen)
    model.save_pretrained(path)
    return model


def tokens(seed: int, n: int) -> list[int]:
    return random_tokens(seed, n, VOCAB)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3") / "m"
    torch.set_num_threads(1)
    return {"path": path, "model": save_gemma3(path, seed=3)}


# ---- logits on every attention path, prompts past the window -------------------------------------
@pytest.mark.parametrize("chunk", [2048, 5])
def test_logits_match_transformers_in_prefill_and_decode(gemma, chunk):
    """Half the prompt prefilled (whole, or in chunks of 5), the rest decoded; 24 tokens, the window 6."""
    seq = tokens(2, 24)
    got = runner_logits(ModelRunner(gemma["path"], max_num_batched_tokens=chunk), seq)
    torch.testing.assert_close(got, hf_logits(gemma["model"], seq), atol=ATOL, rtol=0)


def test_bf16_prefill_matches_transformers_bit_for_bit(gemma):
    """In bf16 the roundings show: the embedding scale rounded to bf16 first, the norms' (1 + weight) in fp32."""
    seq = tokens(2, 16)
    hf = AutoModelForCausalLM.from_pretrained(gemma["path"], dtype=torch.bfloat16).eval()
    runner = ModelRunner(gemma["path"], dtype=torch.bfloat16)
    runner.add("s")
    torch.testing.assert_close(runner.extend(["s"], [seq], [len(seq)])[0], hf_logits(hf, seq), atol=0, rtol=0)


def test_batched_extend_of_mixed_lengths_matches_transformers(gemma):
    runner = ModelRunner(gemma["path"])
    seqs = [tokens(7, 15), tokens(8, 9)]
    runner.add("a"), runner.add("b")
    runner.extend(["a", "b"], [seqs[0][:8], seqs[1][:2]], [1, 1])
    for seq, rows in zip(seqs, runner.extend(["a", "b"], [seqs[0][8:], seqs[1][2:]], [7, 7])):
        torch.testing.assert_close(rows, hf_logits(gemma["model"], seq)[-len(rows):], atol=ATOL, rtol=0)


def test_branch_steps_match_transformers(gemma):
    prefix, branch_steps = tokens(9, 7), [[3, 11], [40, 40], [5, 62]]
    runner = ModelRunner(gemma["path"])
    runner.add("s")
    runner.extend(["s"], [prefix], [1])
    state, got = runner.branch_start(["s", "s"], [7, 7], torch.tensor(branch_steps[0]))
    for depth, step in enumerate(branch_steps):
        if depth:
            got = runner.branch_step(state, torch.tensor(step))
        for j in range(2):
            want = hf_logits(gemma["model"], prefix + [s[j] for s in branch_steps[:depth + 1]])[-1]
            torch.testing.assert_close(got[j], want, atol=ATOL, rtol=0)


def test_the_static_steps_cuda_graphs_capture_give_the_eager_logits(gemma):
    got, want = steps(static_runner(gemma["path"])), steps(ModelRunner(gemma["path"]))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def test_tensor_parallel_two_ranks_gives_transformers_logits(tmp_path):
    """Per-head q / k norms replicated, heads split: 2 ranks give transformers' logits (a 12-token prompt)."""
    import torch.multiprocessing as mp
    from test_model_families import _tp_rank
    from test_model_families import tokens as family_tokens
    from test_model_tp import free_port
    model = save_gemma3(tmp_path / "m", seed=5)
    mp.spawn(_tp_rank, args=(free_port(), str(tmp_path / "m"), str(tmp_path / "out")), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"out.{rank}") for rank in (0, 1)]
    torch.testing.assert_close(got[0], hf_logits(model, family_tokens(3, 12)), atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], got[0], atol=0, rtol=0)


# ---- greedy generation: a gemma3_text target and draft --------------------------------------------
@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3_pair")
    torch.set_num_threads(1)
    model = save_gemma3(root / "target", seed=0)  # tied, as Gemma ships: sharpened, it repeats one token
    save_perturbed_draft(root / "draft", model, seed=1)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": model}


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_generation_matches_transformers_generate(gemma_pair, mode):
    prompt, n = tokens(5, 12), 24  # the prompt alone is twice the window
    want = hf_greedy(gemma_pair["model"], prompt, n)
    speculative = {} if mode == "ar" else {"draft": gemma_pair["draft"], "k": 3, "draft_executor": "thread"}
    with LLM(device=DEVICE, model=gemma_pair["target"], mode=mode, max_batch_size=1, **speculative) as llm:
        got = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
    assert_greedy_equal(list(got), want, prompt, gemma_pair["model"])


# ---- the multimodal checkpoint: its language model only ------------------------------------------
def save_multimodal(path, seed: int = 4) -> Gemma3ForConditionalGeneration:
    torch.manual_seed(seed)
    config = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                          boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    model = Gemma3ForConditionalGeneration(config).eval()
    randomise(model)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("layout", ["language_model.model.", "model.language_model."])
def test_a_multimodal_checkpoints_language_model_matches_transformers_on_text(tmp_path, layout):
    """transformers 5 writes language_model.model.*; 4.52-4.57 wrote model.language_model.* (and
    model.vision_tower.*): both load, the vision tower's tensors skipped."""
    model = save_multimodal(tmp_path)
    if layout != "language_model.model.":
        file = tmp_path / "model.safetensors"
        renamed = {k.replace("language_model.model.", layout).replace("vision_tower.", "model.vision_tower."): v
                   for k, v in load_file(file).items()}
        save_file(renamed, file, metadata={"format": "pt"})
    seq = tokens(6, 20)
    torch.testing.assert_close(runner_logits(ModelRunner(tmp_path), seq), hf_logits(model, seq), atol=ATOL, rtol=0)


def test_a_sparse_multimodal_text_config_takes_transformers_defaults():
    """4B-27B's config.json lists only what differs from Gemma3TextConfig; the rest is its defaults, and the
    context is max_position_embeddings (vLLM does not multiply Gemma 3's by its rope factor)."""
    hf = {"model_type": "gemma3", "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
          "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                          "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                          "sliding_window": 1024}}
    want = Gemma3Config.from_dict({**hf, "vision_config": VISION}).text_config
    cfg = parse_config(hf)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (256, 8, 4, want.vocab_size)
    assert cfg.layer_windows == tuple(1024 if t == "sliding_attention" else None for t in want.layer_types)
    assert cfg.rope == want.rope_parameters["full_attention"] and cfg.local_rope == want.rope_parameters[
        "sliding_attention"]
    assert cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings and cfg.language_model_only
    assert cfg.max_position_embeddings == context_limit(hf)[0] == 131_072
    assert cfg.attention_scale == 256 ** -0.5 and cfg.embed_scale == 2560 ** 0.5


def test_an_older_text_config_reads_as_transformers_reads_it():
    """1B's config.json (transformers 4.50): rope_theta, rope_local_base_freq, sliding_window_pattern."""
    hf = {**{k: v for k, v in TEXT.items() if k not in ("layer_types", "rope_parameters")}, "num_hidden_layers": 7,
          "model_type": "gemma3_text", "rope_theta": 1_000_000, "rope_local_base_freq": 10_000,
          "sliding_window_pattern": 3, "rope_scaling": None}
    want = Gemma3TextConfig.from_dict(hf)
    cfg = parse_config(hf)
    assert cfg.layer_windows == tuple(WINDOW if t == "sliding_attention" else None for t in want.layer_types)
    assert cfg.layer_windows.count(None) == 2
    assert cfg.rope == want.rope_parameters["full_attention"]
    assert cfg.local_rope == want.rope_parameters["sliding_attention"]


# ---- refusals -----------------------------------------------------------------------------------
def text_json(**changes) -> dict:
    return {**Gemma3TextConfig(**TEXT).to_dict(), **changes}


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_softcapping_is_refused_naming_the_field(key):
    with pytest.raises(ValueError, match=f"config.json {key} 50.0 is not supported: softcapping must be null"):
        parse_config(text_json(**{key: 50.0}))
    with pytest.raises(ValueError, match=key):
        parse_config({"model_type": "gemma3", "text_config": text_json(**{key: 30.0})})


@pytest.mark.parametrize("changes, message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention true is not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a finite number > 0"),
    ({"sliding_window": None}, "sliding_window must be a positive integer, got None"),
    ({"layer_types": ["full_attention"]}, "layer_types must give each of the 3 layers"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters must be nested by layer type"),
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}}, "rope_type 'dynamic'"),
])
def test_what_this_runtime_cannot_compute_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        parse_config(text_json(**changes))


def test_the_runner_refuses_a_softcapped_checkpoint(tmp_path):
    save_gemma3(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelRunner(tmp_path)
