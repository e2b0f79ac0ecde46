"""Microsoft Phi-3 (model_type "phi3": Phi-3-mini / -medium, Phi-3.5-mini, Phi-4, Phi-4-mini): logits as transformers
5.25's Phi3ForCausalLM computes them on tiny seeded checkpoints, on every attention path (prefill whole and chunked,
batched extend, decode, branch trees, the CUDA-graph static steps run uncaptured), for a Phi-3-mini-4k-like model
(full rotary, a sliding window that binds) and a Phi-4-mini-like one (partial_rotary_factor 0.75, longrope within
its original context, tied embeddings); the fused qkv_proj / gate_up_proj split on load (per rank under TP);
greedy ar / sd / ssd as its generate; the longrope context cap; configs transformers would not compute refused."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from model_checks import (QK_GAIN, check_batched_extends, check_bf16_prefill_bitwise, check_greedy_generation,
                          check_logits, check_static_steps, check_two_branches, check_two_ranks_match_transformers,
                          hf_logits, perturbed_pair, random_tokens, randomise)
from transformers import Phi3Config, Phi3ForCausalLM

from saguaro_dist.model.hf_config import parse_config
from saguaro_dist.model.runner import ModelRunner

VOCAB, WINDOW, ORIGINAL = 64, 6, 256
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": None, "eos_token_id": None,
          "pad_token_id": None}
# head_dim 8 x 0.75: 6 dims rotate, 3 factors each; max_position_embeddings 4 x the original: longrope's
# attention factor sqrt(1 + ln 4 / ln 256) = 1.12
LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.5, 3.0], "long_factor": [2.0, 5.0, 9.0]}
VARIANTS = {"phi3_mini": {"max_position_embeddings": 256, "sliding_window": WINDOW},
            "phi4_mini": {"max_position_embeddings": 4 * ORIGINAL, "original_max_position_embeddings": ORIGINAL,
                          "partial_rotary_factor": 0.75, "rope_scaling": LONGROPE, "tie_word_embeddings": True}}
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def sharpen_qkv(model, qk_gain: float = QK_GAIN) -> None:
    """randomise's q / k gain on Phi-3's fused qkv_proj: its q and k rows (v's left as they are)."""
    cfg = model.config
    qk_rows = (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight[:qk_rows].mul_(qk_gain)


def save_phi3(path, variant: str, seed: int = 0, **changes) -> Phi3ForCausalLM:
    torch.manual_seed(seed)
    # a copy: Phi3Config writes its defaults into the rope_scaling dict it is given
    model = Phi3ForCausalLM(Phi3Config(**copy.deepcopy({**COMMON, **VARIANTS[variant], **changes}))).eval()
    randomise(model)
    sharpen_qkv(model)
    model.save_pretrained(path)
    return model


def tokens(seed: int, n: int) -> list[int]:
    return random_tokens(seed, n, VOCAB)


@pytest.fixture(scope="module", params=list(VARIANTS))
def phi3(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "m"
    torch.set_num_threads(1)
    return {"path": path, "model": save_phi3(path, request.param, seed=3), "variant": request.param}


def _relabelled(model, **changes) -> Phi3ForCausalLM:
    """The same weights under a changed config: what transformers computes without one of the features."""
    other = Phi3ForCausalLM(Phi3Config(**{**model.config.to_dict(), **changes})).eval()
    other.load_state_dict(model.state_dict())
    return other


def test_each_feature_moves_the_logits_here(phi3):
    """The checks below would miss none of them: the window, the partial rotary factor, longrope's short factors
    and attention factor each move transformers' logits by far more than ATOL."""
    seq, model = tokens(2, 24), phi3["model"]
    if phi3["variant"] == "phi3_mini":
        changes = [{"sliding_window": None}]
    else:
        plain = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}}
        changes = [plain, {"rope_parameters": {**plain["rope_parameters"], "partial_rotary_factor": 1.0}},
                   {"max_position_embeddings": ORIGINAL}]  # factor 1: no attention factor
    for change in changes:
        assert (hf_logits(_relabelled(model, **change), seq) - hf_logits(model, seq)).abs().max() > 100 * ATOL


# ---- logits on every attention path ---------------------------------------------------------------
@pytest.mark.parametrize("chunk", [2048, 5])
def test_logits_match_transformers_in_prefill_and_decode(phi3, chunk):
    """Half the prompt prefilled (whole, or in chunks of 5), the rest decoded; 24 tokens, the window 6."""
    check_logits(phi3["path"], phi3["model"], tokens(2, 24), max_num_batched_tokens=chunk)


def test_bf16_prefill_matches_transformers_bit_for_bit(phi3):
    check_bf16_prefill_bitwise(phi3["path"], tokens(2, 16))


def test_whole_prompts_of_mixed_lengths_then_a_batched_extend_match_transformers(phi3):
    check_batched_extends(phi3["path"], phi3["model"], [tokens(7, 15), tokens(8, 9)], [[8], [3]], prompt_rows=True)


def test_branch_steps_match_transformers(phi3):
    check_two_branches(phi3["path"], phi3["model"], tokens(9, 7))


def test_the_static_steps_cuda_graphs_capture_give_the_eager_logits(phi3):
    check_static_steps(phi3["path"])


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_two_ranks_gives_transformers_logits(tmp_path, variant):
    """Each rank reads its own heads' rows of q, k and v out of the fused qkv_proj, its width of gate and up."""
    model = save_phi3(tmp_path / "m", variant, seed=5)
    check_two_ranks_match_transformers(tmp_path / "m", model, tokens(3, 12))


# ---- the fused checkpoint tensors ------------------------------------------------------------------
def test_fused_tensors_split_into_our_projections_by_rows():
    from saguaro_dist.model.loader import _TensorSlice, fused_tensors
    from saguaro_dist.model.phi3_config import fused_checkpoint_parts
    cfg = parse_config({**Phi3Config(**COMMON).to_dict(), "model_type": "phi3"})
    parts = fused_checkpoint_parts(cfg)
    qkv = torch.arange(64 * 32.0).view(64, 32)  # q: 4 heads x 8 rows, k and v: 2 x 8 each
    got = dict(fused_tensors("model.layers.1.self_attn.qkv_proj.weight", _TensorSlice(qkv), parts))
    assert list(got) == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    for name, rows in zip(got, (qkv[:32], qkv[32:48], qkv[48:])):
        torch.testing.assert_close(got[name][:], rows, atol=0, rtol=0)
    gate_up = torch.randn(96, 32)
    got = dict(fused_tensors("layers.0.mlp.gate_up_proj.weight", _TensorSlice(gate_up), parts))
    assert torch.equal(got["layers.0.mlp.gate_proj.weight"][:], gate_up[:48])
    assert torch.equal(got["layers.0.mlp.up_proj.weight"][:], gate_up[48:])
    assert fused_tensors("model.layers.0.mlp.down_proj.weight", 1, parts) == [("model.layers.0.mlp.down_proj.weight", 1)]
    with pytest.raises(ValueError, match="80 rows in the checkpoint, the model expects q_proj 32 \\+ k_proj 16"):
        fused_tensors("model.layers.0.self_attn.qkv_proj.weight", _TensorSlice(torch.zeros(80, 32)), parts)
    assert fused_checkpoint_parts(parse_config({**COMMON, "model_type": "llama", "max_position_embeddings": 64})) == {}


def test_a_checkpoint_whose_fused_rows_do_not_match_the_config_is_refused(tmp_path):
    save_phi3(tmp_path, "phi3_mini", num_key_value_heads=4)
    config = (tmp_path / "config.json").read_text().replace('"num_key_value_heads": 4', '"num_key_value_heads": 2')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match="qkv_proj.weight': 96 rows in the checkpoint"):
        ModelRunner(tmp_path)


# ---- longrope: its original context only ----------------------------------------------------------
def test_past_the_original_context_transformers_rerotates_the_earlier_keys(tmp_path):
    """Why the context stops at original_max_position_embeddings: one token past it, transformers computes every
    earlier position with the long factors, so what was cached (and scored) before no longer holds."""
    model = save_phi3(tmp_path, "phi4_mini", seed=1)
    seq = tokens(4, ORIGINAL + 1)
    within, past = hf_logits(model, seq[:ORIGINAL]), hf_logits(model, seq)[:ORIGINAL]
    assert (within - past).abs().max() > 100 * ATOL


def test_longrope_caps_the_context_and_refuses_more(phi3, caplog):
    if phi3["variant"] != "phi4_mini":
        assert ModelRunner(phi3["path"]).max_model_len == 256
        return
    from saguaro_dist.model.phi3_config import _warn_capped
    _warn_capped.cache_clear()  # warned once a process: earlier tests' runners may have
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(phi3["path"])
    assert runner.max_model_len == ORIGINAL
    assert f"context capped at original_max_position_embeddings {ORIGINAL}" in caplog.text
    assert ModelRunner(phi3["path"], max_model_len=ORIGINAL // 2).max_model_len == ORIGINAL // 2
    with pytest.raises(ValueError, match=f"max_model_len must be in 1..{ORIGINAL} .*longrope original_max_position_"
                                         f"embeddings {ORIGINAL}, not max_position_embeddings {4 * ORIGINAL}.*long_factor"):
        ModelRunner(phi3["path"], max_model_len=ORIGINAL + 1)


def test_the_last_position_of_the_original_context_matches_transformers(tmp_path):
    model = save_phi3(tmp_path, "phi4_mini", seed=2)
    check_logits(tmp_path, model, tokens(6, ORIGINAL))


# ---- greedy generation: a Phi-3 target and draft (Phi-3-medium / -mini share a tokenizer) -------------
@pytest.fixture(scope="module", params=list(VARIANTS))
def phi3_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"{request.param}_pair")
    torch.set_num_threads(1)
    return perturbed_pair(root, save_phi3(root / "target", request.param, seed=0))


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_generation_matches_transformers_generate(phi3_pair, mode):
    check_greedy_generation(phi3_pair, mode, tokens(5, 12), 24)


# ---- config.json as transformers reads it, and refusals ------------------------------------------
# Phi-3-mini-4k-instruct's config.json (transformers 4.40), and Phi-4-mini-instruct's shape (factors made up)
HUB_MINI_4K = {"architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
               "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
               "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
               "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
               "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None,
               "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
               "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32064}
HUB_PHI4_MINI = {**HUB_MINI_4K, "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999,
                 "num_attention_heads": 24, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                 "partial_rotary_factor": 0.75, "sliding_window": 262144, "tie_word_embeddings": True,
                 "vocab_size": 200064, "rope_scaling": {"type": "longrope",
                                                        "short_factor": [1.0 + i / 100 for i in range(48)],
                                                        "long_factor": [1.0 + i for i in range(48)]}}


def from_dict(hub: dict) -> Phi3Config:
    """Phi3Config.from_dict on a copy: it writes its defaults into the rope_scaling dict it is given."""
    return Phi3Config.from_dict(copy.deepcopy(hub))


@pytest.mark.parametrize("hub", [HUB_MINI_4K, HUB_PHI4_MINI], ids=["phi3_mini_4k", "phi4_mini"])
def test_a_hub_config_reads_as_transformers_reads_it(hub):
    want, cfg = from_dict(hub), parse_config(hub)
    assert cfg.model_type == "phi3" and not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm)
    assert cfg.layer_windows == (want.sliding_window,) * 32 and cfg.rms_norm_eps == want.rms_norm_eps
    assert cfg.rope_dim == int(cfg.head_dim * want.rope_parameters["partial_rotary_factor"])
    assert cfg.rotary_dim == (None if cfg.rope_dim == cfg.head_dim else cfg.rope_dim)
    for key in ("rope_type", "rope_theta", "short_factor", "original_max_position_embeddings"):
        assert cfg.rope.get(key) == want.rope_parameters.get(key), key
    assert cfg.max_position_embeddings == 4096 and cfg.tie_word_embeddings == want.tie_word_embeddings


def test_longrope_attention_factor_is_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from saguaro_dist.model.rope import attention_factor, inv_freq
    for rope_scaling in (HUB_PHI4_MINI["rope_scaling"], {**HUB_PHI4_MINI["rope_scaling"], "factor": 2.0},
                         {**HUB_PHI4_MINI["rope_scaling"], "attention_factor": 1.5}):
        hub = {**HUB_PHI4_MINI, "rope_scaling": rope_scaling}
        want_freq, want_scale = ROPE_INIT_FUNCTIONS["longrope"](from_dict(hub))
        cfg = parse_config(hub)
        assert attention_factor(cfg.rope) == pytest.approx(want_scale, rel=1e-12)
        assert torch.equal(inv_freq(cfg.rope_dim, cfg.rope), want_freq)


@pytest.mark.parametrize("changes, message", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear' is not supported for model_type 'phi3'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported for model_type"),
    ({"rope_scaling": {**HUB_PHI4_MINI["rope_scaling"], "short_factor": [1.0] * 64}},
     "short_factor must be a list of 48 numbers > 0"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}}, "long_factor must be a list of 48"),
    ({"rope_scaling": {**HUB_PHI4_MINI["rope_scaling"], "original_max_position_embeddings": 8192}},
     "original_max_position_embeddings 4096 .* and rope_scaling's 8192 must be one positive integer"),
    ({"rope_scaling": {**HUB_PHI4_MINI["rope_scaling"], "attention_factor": -1}}, "attention_factor must be a number > 0"),
    ({"partial_rotary_factor": 0}, "partial_rotary_factor 0 must be a number in \\(0, 1\\]"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor 1.5 must be a number in \\(0, 1\\]"),
    ({"partial_rotary_factor": 0.7}, "giving an even rotary dimension >= 2 of head_dim 128 \\(got 89\\)"),
    ({"head_dim": 96}, "head_dim 96 must be hidden_size // num_attention_heads = 128"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer or null"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_what_this_runtime_cannot_compute_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        parse_config({**HUB_PHI4_MINI, **changes})


def test_older_rope_names_and_omitted_fields_read_as_phi3config_reads_them():
    """su / yarn are longrope to Phi3Config; an omitted sliding_window is null (every layer full), an omitted
    rms_norm_eps 1e-5, mlp_bias never read."""
    su = parse_config({**HUB_PHI4_MINI, "rope_scaling": {**HUB_PHI4_MINI["rope_scaling"], "type": "su"}})
    assert su.rope["rope_type"] == "longrope"
    bare = {k: v for k, v in HUB_MINI_4K.items() if k not in ("sliding_window", "rms_norm_eps")}
    cfg = parse_config({**bare, "mlp_bias": True})
    assert cfg.layer_windows == () and cfg.rms_norm_eps == 1e-5 and not cfg.mlp_bias
