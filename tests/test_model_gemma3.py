"""Google Gemma 3 (model_type "gemma3_text": Gemma3ForCausalLM; "gemma3": Gemma3ForConditionalGeneration's
language model): logits as transformers computes them on tiny seeded checkpoints whose prompts run past the
sliding window (two ropes: the sliding layers' local one, the full layers' linearly scaled one), on every
attention path, greedy ar / sd / ssd as its generate (a gemma3_text draft), its config read as transformers
reads it, and what this runtime cannot compute refused, naming the field."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from model_checks import (check_batched_extends, check_bf16_prefill_bitwise, check_greedy_generation, check_logits,
                          check_static_steps, check_two_branches, check_two_ranks_match_transformers, perturbed_pair,
                          random_tokens, randomise, save_seeded)
from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

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


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def save_gemma3(path, seed: int = 0, sharpen: float = 1.0) -> Gemma3ForCausalLM:
    return save_seeded(path, Gemma3ForCausalLM, lambda: Gemma3TextConfig(**TEXT), seed, sharpen)


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
    check_logits(gemma["path"], gemma["model"], tokens(2, 24), max_num_batched_tokens=chunk)


def test_bf16_prefill_matches_transformers_bit_for_bit(gemma):
    """In bf16 the roundings show: the embedding scale rounded to bf16 first, the norms' (1 + weight) in fp32."""
    check_bf16_prefill_bitwise(gemma["path"], tokens(2, 16))


def test_batched_extend_of_mixed_lengths_matches_transformers(gemma):
    check_batched_extends(gemma["path"], gemma["model"], [tokens(7, 15), tokens(8, 9)], [[8], [2]])


def test_branch_steps_match_transformers(gemma):
    check_two_branches(gemma["path"], gemma["model"], tokens(9, 7))


def test_the_static_steps_cuda_graphs_capture_give_the_eager_logits(gemma):
    check_static_steps(gemma["path"])


def test_tensor_parallel_two_ranks_gives_transformers_logits(tmp_path):
    """Per-head q / k norms replicated, heads split: 2 ranks give transformers' logits (a 12-token prompt)."""
    model = save_gemma3(tmp_path / "m", seed=5)
    check_two_ranks_match_transformers(tmp_path / "m", model, tokens(3, 12))


# ---- greedy generation: a gemma3_text target and draft --------------------------------------------
@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3_pair")
    torch.set_num_threads(1)
    # tied, as Gemma ships: sharpened, it repeats one token
    return perturbed_pair(root, save_gemma3(root / "target", seed=0))


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_generation_matches_transformers_generate(gemma_pair, mode):
    check_greedy_generation(gemma_pair, mode, tokens(5, 12), 24)  # the prompt alone is twice the window


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
    check_logits(tmp_path, model, tokens(6, 20))


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
