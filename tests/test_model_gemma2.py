"""Google Gemma 2 (model_type "gemma2": Gemma2ForCausalLM, 2B / 9B / 27B): logits as transformers' eager path
computes them (its only one: SDPA cannot softcap) on tiny seeded checkpoints whose prompts run past the sliding
window, with both softcaps binding, on every attention path (prefill whole and chunked, batched extend, decode,
branch trees, the CUDA-graph static steps run uncaptured); greedy ar / sd / ssd as its generate; 2 TP ranks as 1;
its config read as Gemma2Config reads it; float16 refused as vLLM refuses it."""
from __future__ import annotations

import pytest
import torch
from model_checks import (check_batched_extends, check_bf16_prefill_bitwise, check_greedy_generation, check_logits,
                          check_static_steps, check_two_branches, check_two_ranks_match_transformers, hf_logits,
                          perturbed_pair, random_tokens, save_seeded)
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM

from saguaro_dist.model.device import DeviceKind, resolve_dtype
from saguaro_dist.model.hf_config import parse_config
from saguaro_dist.model.runner import ModelRunner

VOCAB, WINDOW = 64, 6
# The caps small enough to bind on a tiny model (the real 50 / 30 bind on a trained one's scores and logits):
# its scores reach ~2, its logits ~0.3 (test_each_softcap_moves_the_logits_here). No layer_types: Gemma2Config's
# own alternation, sliding first. query_pre_attn_scalar 12, not head_dim 8: a wrong scale shows.
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
        "sliding_window": WINDOW, "query_pre_attn_scalar": 12, "attn_logit_softcapping": 1.5,
        "final_logit_softcapping": 0.25, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def save_gemma2(path, seed: int = 0, **changes) -> Gemma2ForCausalLM:
    model = save_seeded(path, Gemma2ForCausalLM, lambda: Gemma2Config(**{**TEXT, **changes}), seed)
    assert model.config._attn_implementation == "eager"  # transformers' reference computes the softcap
    return model


def tokens(seed: int, n: int) -> list[int]:
    return random_tokens(seed, n, VOCAB)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2") / "m"
    torch.set_num_threads(1)
    return {"path": path, "model": save_gemma2(path, seed=3)}


def test_each_softcap_moves_the_logits_here(tmp_path, gemma):
    """The checks below would miss neither cap: without either one transformers' logits move by far more than ATOL."""
    seq = tokens(2, 24)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        uncapped = save_gemma2(tmp_path / key, seed=3, **{key: None})
        assert (hf_logits(uncapped, seq) - hf_logits(gemma["model"], seq)).abs().max() > 100 * ATOL, key


# ---- logits on every attention path, prompts past the window -------------------------------------
@pytest.mark.parametrize("chunk", [2048, 5])
def test_logits_match_transformers_in_prefill_and_decode(gemma, chunk):
    """Half the prompt prefilled (whole, or in chunks of 5), the rest decoded; 24 tokens, the window 6."""
    check_logits(gemma["path"], gemma["model"], tokens(2, 24), max_num_batched_tokens=chunk)


def test_bf16_prefill_matches_transformers(gemma):
    """In bf16 the roundings show: the scores softcapped in bf16, the softmax in fp32, the logits capped in bf16."""
    check_bf16_prefill_bitwise(gemma["path"], tokens(2, 16))


def test_whole_prompts_of_mixed_lengths_then_a_batched_extend_match_transformers(gemma):
    """Prompts from position 0 (SDPA's mask-free causal path for other models; a causal mask here), padded."""
    check_batched_extends(gemma["path"], gemma["model"], [tokens(7, 15), tokens(8, 9)], [[8], [3]], prompt_rows=True)


def test_branch_steps_match_transformers(gemma):
    check_two_branches(gemma["path"], gemma["model"], tokens(9, 7))


def test_the_static_steps_cuda_graphs_capture_give_the_eager_logits(gemma):
    check_static_steps(gemma["path"])


def test_a_padded_vocabulary_keeps_its_padding_at_minus_infinity(gemma):
    """A draft matched to a larger vocabulary (model/vocab.py): the logit softcap runs before the -inf mask."""
    runner = ModelRunner(gemma["path"], vocab_size=VOCAB + 8)
    runner.add("s")
    seq = tokens(4, 10)
    logits = runner.extend(["s"], [seq], [len(seq)])[0]
    assert torch.isneginf(logits[:, VOCAB:]).all()
    torch.testing.assert_close(logits[:, :VOCAB], hf_logits(gemma["model"], seq), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_tensor_parallel_two_ranks_gives_transformers_logits(tmp_path):
    model = save_gemma2(tmp_path / "m", seed=5)
    check_two_ranks_match_transformers(tmp_path / "m", model, tokens(3, 12))


# ---- the attention kernel: chosen once per model -------------------------------------------------
class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _prefill_ops(path) -> list[str]:
    runner = ModelRunner(path)
    runner.add("s")
    with _OpNames() as ops:
        runner.extend(["s"], [tokens(1, 9)], [1])
    return ops.names


def test_only_a_softcapped_model_leaves_sdpa(gemma, tmp_path):
    """Gemma 2's forward computes its attention by hand (tanh, an fp32 softmax) and never calls SDPA; the same
    model without the attention softcap runs SDPA and no tanh, as every other family does."""
    capped = _prefill_ops(gemma["path"])
    assert not any("scaled_dot_product" in op for op in capped) and any("tanh" in op for op in capped)
    save_gemma2(tmp_path, seed=3, attn_logit_softcapping=None, final_logit_softcapping=None)
    plain = _prefill_ops(tmp_path)
    assert any("scaled_dot_product" in op for op in plain)
    assert not any("tanh" in op or "softmax" in op for op in plain)


# ---- greedy generation: a Gemma 2 target and draft ------------------------------------------------
@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2_pair")
    torch.set_num_threads(1)
    return perturbed_pair(root, save_gemma2(root / "target", seed=0))


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_generation_matches_transformers_generate(gemma_pair, mode):
    check_greedy_generation(gemma_pair, mode, tokens(5, 12), 24)  # the prompt alone is twice the window


# ---- config.json as transformers reads it, and refusals ------------------------------------------
# gemma-2-2b-it's config.json (transformers 4.42): rope_theta, hidden_act beside hidden_activation, no layer_types
HUB_2B = {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": 50.0,
          "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 107],
          "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
          "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216,
          "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
          "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
          "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
          "vocab_size": 256000}


def test_a_hub_config_reads_as_transformers_reads_it():
    want = Gemma2Config.from_dict(HUB_2B)
    cfg = parse_config(HUB_2B)
    assert cfg.layer_windows == tuple(4096 if t == "sliding_attention" else None for t in want.layer_types)
    assert cfg.layer_windows[:2] == (4096, None) and cfg.local_rope is None and not cfg.qk_norm
    assert cfg.rope == want.rope_parameters and cfg.max_position_embeddings == 8192
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)
    assert cfg.attention_scale == 256 ** -0.5 and cfg.embed_scale == 2304 ** 0.5 and cfg.sandwich_norms
    assert cfg.eos_token_ids == (1, 107) and cfg.tie_word_embeddings


def test_omitted_fields_take_gemma2configs_defaults_and_layer_types_are_honoured():
    sparse = parse_config({"model_type": "gemma2", "num_hidden_layers": 4, "query_pre_attn_scalar": 144})
    assert (sparse.attn_softcap, sparse.final_softcap, sparse.vocab_size) == (50.0, 30.0, 256_000)
    assert sparse.layer_windows == (4096, None, 4096, None) and sparse.attention_scale == 144 ** -0.5
    uncapped = parse_config({**HUB_2B, "num_hidden_layers": 3, "attn_logit_softcapping": None,
                             "final_logit_softcapping": None,
                             "layer_types": ["full_attention", "sliding_attention", "full_attention"]})
    assert (uncapped.attn_softcap, uncapped.final_softcap) == (None, None)
    assert uncapped.layer_windows == (None, 4096, None)


@pytest.mark.parametrize("changes, message", [
    ({"attn_logit_softcapping": 0}, "attn_logit_softcapping must be a finite number > 0 or null"),
    ({"final_logit_softcapping": float("inf")}, "final_logit_softcapping must be a finite number > 0 or null"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention true is not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a finite number > 0"),
    ({"sliding_window": None}, "sliding_window must be a positive integer, got None"),
    ({"layer_types": ["full_attention"]}, "layer_types must give each of the 26 layers"),
])
def test_what_this_runtime_cannot_compute_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        parse_config({**HUB_2B, **changes})


def test_float16_is_refused_and_auto_takes_bfloat16():
    """vLLM's _FLOAT16_NOT_SUPPORTED_MODELS lists gemma2: its activations overflow float16."""
    with pytest.raises(ValueError, match="float16 is not supported for gemma2 models"):
        resolve_dtype("float16", HUB_2B, "cpu")
    assert resolve_dtype("auto", HUB_2B, DeviceKind("cuda", (9, 0))) == torch.bfloat16
    assert resolve_dtype("auto", HUB_2B, DeviceKind("cuda", (7, 5))) == torch.float32
