"""Hugging Face SmolLM3 (model_type "smollm3": SmolLM3ForCausalLM, e.g. SmolLM3-3B): logits as transformers
5.25's SmolLM3ForCausalLM computes them on tiny seeded checkpoints, on every attention path (prefill whole and
chunked, batched extend, decode, branch trees, the CUDA-graph static steps run uncaptured), for one whose
no_rope_layers mixes NoPE and rope layers (NoPE first, q / k / o and MLP biases) and one whose NoPE layers come
from no_rope_layer_interval and slide (use_sliding_window); greedy ar / sd / ssd as its generate; 2 TP ranks as
1; the 3B Hub config read as SmolLM3Config reads it; what transformers would not compute alike refused."""
from __future__ import annotations

import pytest
import torch
from model_checks import (check_batched_extends, check_bf16_prefill_bitwise, check_greedy_generation, check_logits,
                          check_static_steps, check_two_branches, check_two_ranks_match_transformers, hf_logits,
                          perturbed_pair, random_tokens, save_seeded)
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from saguaro_dist.model.hf_config import parse_config
from saguaro_dist.model.layers import CausalLM
from saguaro_dist.model.rope import apply_rope, no_rope

VOCAB, WINDOW = 64, 6
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": None, "eos_token_id": None,
          "pad_token_id": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# nope: layer 0 NoPE, 1 rope, 2 NoPE; biases on. sliding: interval 2 makes layers 1 and 3 NoPE, and (the default
# layer_types) those slide, a window of 6 the 24-token prompts pass
VARIANTS = {"nope": {"num_hidden_layers": 3, "no_rope_layers": [0, 1, 0], "attention_bias": True, "mlp_bias": True},
            "sliding": {"num_hidden_layers": 4, "no_rope_layer_interval": 2, "use_sliding_window": True,
                        "sliding_window": WINDOW, "tie_word_embeddings": False}}
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def save_smollm3(path, variant: str, seed: int = 0) -> SmolLM3ForCausalLM:
    return save_seeded(path, SmolLM3ForCausalLM, lambda: SmolLM3Config(**{**COMMON, **VARIANTS[variant]}), seed)


def tokens(seed: int, n: int) -> list[int]:
    return random_tokens(seed, n, VOCAB)


@pytest.fixture(scope="module", params=list(VARIANTS))
def smol(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "m"
    torch.set_num_threads(1)
    return {"path": path, "model": save_smollm3(path, request.param, seed=3), "variant": request.param}


def _relabelled(model, **changes) -> SmolLM3ForCausalLM:
    """The same weights under a changed config: what transformers computes without one of the features."""
    config = {**model.config.to_dict(), **changes}
    other = SmolLM3ForCausalLM(SmolLM3Config(**config)).eval()
    other.load_state_dict(model.state_dict())
    return other


def test_the_checkpoint_places_nope_layers_as_its_config_does(smol):
    """no_rope_layers 1 rotates, 0 is NoPE: the layers built rotate as transformers' SmolLM3Attention.use_rope
    says, and only the sliding variant's NoPE layers slide."""
    cfg, model = parse_config(smol["model"].config.to_dict()), CausalLM(parse_config(smol["model"].config.to_dict()))
    want = [bool(layer.self_attn.use_rope) for layer in smol["model"].model.layers]
    assert want == ([False, True, False] if smol["variant"] == "nope" else [True, False, True, False])
    assert [layer.self_attn.rotate is apply_rope for layer in model.model.layers] == want
    assert [layer.self_attn.rotate is no_rope for layer in model.model.layers] == [not w for w in want]
    windows = [None if rope or smol["variant"] == "nope" else WINDOW for rope in want]
    assert [cfg.window_of(i) for i in range(cfg.num_layers)] == windows


def test_each_feature_moves_the_logits_here(smol):
    """The checks below would miss neither: every layer rotating, or no layer sliding, moves transformers'
    logits by far more than ATOL."""
    seq, model = tokens(2, 24), smol["model"]
    layers = model.config.num_hidden_layers
    changes = [{"no_rope_layers": [1] * layers}]
    if smol["variant"] == "sliding":
        changes.append({"layer_types": ["full_attention"] * layers})
    for change in changes:
        assert (hf_logits(_relabelled(model, **change), seq) - hf_logits(model, seq)).abs().max() > 100 * ATOL


def test_other_families_layers_rotate_as_before():
    """NoPE is chosen per layer at build: a Llama model's every layer keeps apply_rope itself (no added call)."""
    cfg = parse_config({**COMMON, "model_type": "llama", "num_hidden_layers": 2})
    assert cfg.rope_layers == () and all(layer.self_attn.rotate is apply_rope for layer in CausalLM(cfg).model.layers)


# ---- logits on every attention path ---------------------------------------------------------------
@pytest.mark.parametrize("chunk", [2048, 5])
def test_logits_match_transformers_in_prefill_and_decode(smol, chunk):
    """Half the prompt prefilled (whole, or in chunks of 5), the rest decoded; 24 tokens."""
    check_logits(smol["path"], smol["model"], tokens(2, 24), max_num_batched_tokens=chunk)


def test_bf16_prefill_matches_transformers_bit_for_bit(smol):
    check_bf16_prefill_bitwise(smol["path"], tokens(2, 16))


def test_whole_prompts_of_mixed_lengths_then_a_batched_extend_match_transformers(smol):
    check_batched_extends(smol["path"], smol["model"], [tokens(7, 15), tokens(8, 9)], [[8], [3]], prompt_rows=True)


def test_branch_steps_match_transformers(smol):
    check_two_branches(smol["path"], smol["model"], tokens(9, 7))


def test_the_static_steps_cuda_graphs_capture_give_the_eager_logits(smol):
    check_static_steps(smol["path"])


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_two_ranks_gives_transformers_logits(tmp_path, variant):
    model = save_smollm3(tmp_path / "m", variant, seed=5)
    check_two_ranks_match_transformers(tmp_path / "m", model, tokens(3, 12))


# ---- greedy generation: a SmolLM3 target and a perturbed SmolLM3 draft ----------------------------------
@pytest.fixture(scope="module", params=list(VARIANTS))
def smol_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"{request.param}_pair")
    torch.set_num_threads(1)
    return perturbed_pair(root, save_smollm3(root / "target", request.param, seed=0))


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_generation_matches_transformers_generate(smol_pair, mode):
    check_greedy_generation(smol_pair, mode, tokens(5, 12), 24)


# ---- config.json as transformers reads it, and refusals ------------------------------------------
# HuggingFaceTB/SmolLM3-3B's config.json (transformers 4.54)
HUB_3B = {"architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
          "bos_token_id": None, "eos_token_id": 128012, "hidden_act": "silu", "hidden_size": 2048,
          "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 65536,
          "max_window_layers": 28, "mlp_bias": False, "model_type": "smollm3", "no_rope_layer_interval": 4,
          "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)], "num_attention_heads": 16,
          "num_hidden_layers": 36, "num_key_value_heads": 4, "pad_token_id": 128004, "pretraining_tp": 2,
          "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None,
          "torch_dtype": "bfloat16", "transformers_version": "4.54.0.dev0", "use_cache": False,
          "use_sliding_window": False, "vocab_size": 128256}


def test_the_3b_hub_config_reads_as_transformers_reads_it():
    want, cfg = SmolLM3Config.from_dict(dict(HUB_3B)), parse_config(dict(HUB_3B))
    assert cfg.model_type == "smollm3" and not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm)
    assert cfg.rope_layers == tuple(bool(f) for f in want.no_rope_layers)
    assert [i for i in range(36) if not cfg.rotates(i)] == list(range(3, 36, 4))
    assert cfg.layer_windows == () and set(want.layer_types) == {"full_attention"}
    assert cfg.rope == {"rope_type": "default", "rope_theta": want.rope_parameters["rope_theta"]}
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.max_position_embeddings) == (128, 4, 65536)
    assert cfg.tie_word_embeddings == want.tie_word_embeddings is True and cfg.eos_token_ids == (128012,)


def test_omitted_fields_read_as_smollm3config_reads_them():
    """No no_rope_layers: every no_rope_layer_interval-th layer NoPE; no layer_types: the NoPE layers slide
    when a window is used; no rope_theta: SmolLM3Config's 2e6."""
    bare = {k: v for k, v in HUB_3B.items() if k not in ("no_rope_layers", "rope_theta", "tie_word_embeddings")}
    hub = {**bare, "num_hidden_layers": 6, "no_rope_layer_interval": 3, "use_sliding_window": True,
           "sliding_window": 512}
    want, cfg = SmolLM3Config.from_dict(dict(hub)), parse_config(hub)
    assert cfg.rope_layers == (True, True, False, True, True, False) == tuple(map(bool, want.no_rope_layers))
    assert cfg.layer_windows == (None, None, 512, None, None, 512)
    assert want.layer_types == ["sliding_attention" if w else "full_attention" for w in cfg.layer_windows]
    assert cfg.rope["rope_theta"] == want.rope_parameters["rope_theta"] == 2e6 and cfg.tie_word_embeddings
    assert parse_config({**hub, "use_sliding_window": False}).layer_windows == ()


@pytest.mark.parametrize("changes, message", [
    ({"no_rope_layers": [1, 0, 1]}, "no_rope_layers must list 1 \\(rope\\) or 0 \\(NoPE\\) for each of the 36"),
    ({"no_rope_layers": [2] * 36}, "no_rope_layers must list 1 \\(rope\\) or 0"),
    ({"no_rope_layers": None, "no_rope_layer_interval": 0}, "no_rope_layer_interval must be an integer >= 1"),
    ({"layer_types": ["sliding_attention"] * 36}, "use_sliding_window is false or sliding_window null"),
    ({"layer_types": ["full_attention"] * 35}, "layer_types must give each of the 36 layers"),
    ({"use_sliding_window": True, "sliding_window": 0, "layer_types": ["sliding_attention"] * 36},
     "sliding_window must be a positive integer or null"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_what_this_runtime_cannot_compute_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        parse_config({**HUB_3B, **changes})
