"""Valid checkpoints whose config.json transformers reads otherwise than this runtime did: fields it omits
(the config class's defaults), llama3 / yarn's original_max_position_embeddings, a tied config over a stored
head of other values, bias flags the modeling code ignores. Each: our logits (half prefilled, then one token
a step) against transformers', float32."""
from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers as T
from model_checks import hf_logits, randomise, random_tokens, runner_logits

from saguaro_dist.model.runner import ModelRunner

V = 64
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
WIDE = {**BASE, "hidden_size": 64, "num_attention_heads": 16, "num_key_value_heads": 8}  # 8: Mistral's default
MIXTRAL = {**BASE, "num_local_experts": 4, "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default",
                                                                                      "rope_theta": 1e6}}
QWEN3_MOE = {**BASE, "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4, "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 16}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def checkpoint(path, model_cls, config_cls, kwargs: dict, edit=None):
    """A tiny randomised checkpoint saved by transformers, its config.json then edited by `edit`."""
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    randomise(model)
    model.save_pretrained(path)
    file = path / "config.json"
    hf = json.loads(file.read_text())
    if edit is not None:
        edit(hf)
    file.write_text(json.dumps(hf))
    return path


def assert_logits_match(path) -> None:
    ref = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = random_tokens(1, 16, V)
    got = runner_logits(ModelRunner(path), seq)
    torch.testing.assert_close(got, hf_logits(ref, seq), atol=1e-4, rtol=1e-4)


def drop(*keys):
    return lambda hf: [hf.pop(k, None) for k in keys]


# -- omitted fields take the config class's defaults ------------------------------------------------
@pytest.mark.parametrize("model_cls, config_cls, kwargs, omitted", [
    (T.MixtralForCausalLM, T.MixtralConfig, MIXTRAL, ("rms_norm_eps", "rope_parameters", "rope_theta")),  # 1e-5, 1e6
    (T.MistralForCausalLM, T.MistralConfig, WIDE, ("num_key_value_heads",)),                              # 8
    (T.MixtralForCausalLM, T.MixtralConfig, {**MIXTRAL, **WIDE}, ("num_key_value_heads",)),               # 8
    (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, QWEN3_MOE, ("num_key_value_heads",)),                      # 4
    (T.Qwen3ForCausalLM, T.Qwen3Config, {**BASE, "head_dim": 128}, ("head_dim",)),                        # 128
], ids=["mixtral-eps-theta", "mistral-kv", "mixtral-kv", "qwen3moe-kv", "qwen3-head-dim"])
def test_an_omitted_field_takes_the_config_class_default(tmp_path, model_cls, config_cls, kwargs, omitted):
    assert_logits_match(checkpoint(tmp_path, model_cls, config_cls, kwargs, drop(*omitted)))


# -- llama3 / yarn: original_max_position_embeddings ------------------------------------------------
def test_a_llama3_rope_lacking_its_original_length_takes_the_top_level_one(tmp_path):
    def edit(hf):
        hf["rope_parameters"].pop("original_max_position_embeddings")
        hf["original_max_position_embeddings"] = 16
    assert_logits_match(checkpoint(tmp_path, T.LlamaForCausalLM, T.LlamaConfig,
                                   {**BASE, "rope_parameters": LLAMA3}, edit))


def test_a_yarn_rope_lacking_its_original_length_takes_max_position_embeddings(tmp_path):
    def edit(hf):
        hf.pop("rope_parameters")
        hf.update(rope_theta=1e4, rope_scaling={"type": "yarn", "factor": 4.0})
    assert_logits_match(checkpoint(tmp_path, T.LlamaForCausalLM, T.LlamaConfig, BASE, edit))


def test_a_llama3_original_length_conflicting_with_the_top_level_one_is_refused(tmp_path):
    """transformers 5 takes the top-level one, 4.x the rope dict's; it was the dict's here, silently."""
    path = checkpoint(tmp_path, T.LlamaForCausalLM, T.LlamaConfig, {**BASE, "rope_parameters": LLAMA3},
                      lambda hf: hf.update(original_max_position_embeddings=64))
    with pytest.raises(ValueError, match="original_max_position_embeddings 64 differs from rope_scaling's 16"):
        ModelRunner(path)


# -- tie_word_embeddings over a stored head of other values: transformers keeps the head ---------------
@pytest.mark.parametrize("model_cls, config_cls", [(T.LlamaForCausalLM, T.LlamaConfig),
                                                   (T.Qwen2ForCausalLM, T.Qwen2Config)], ids=["llama", "qwen2"])
def test_a_tied_config_over_a_different_stored_head_uses_the_head(tmp_path, caplog, model_cls, config_cls):
    path = checkpoint(tmp_path, model_cls, config_cls, {**BASE, "tie_word_embeddings": False},
                      lambda hf: hf.update(tie_word_embeddings=True))
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.model.build"):
        assert_logits_match(path)
    assert "differs from the embeddings: not tied" in caplog.text


# -- bias flags transformers' modeling code ignores ---------------------------------------------------
@pytest.mark.parametrize("model_cls, config_cls, kwargs, flags", [
    (T.MistralForCausalLM, T.MistralConfig, BASE, {"attention_bias": True, "mlp_bias": True}),
    (T.Qwen3ForCausalLM, T.Qwen3Config, BASE, {"mlp_bias": True}),
    (T.Qwen2ForCausalLM, T.Qwen2Config, BASE, {"mlp_bias": True}),
    (T.Olmo2ForCausalLM, T.Olmo2Config, BASE, {"mlp_bias": True}),
    (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, {**QWEN3_MOE, "mlp_only_layers": [0]}, {"mlp_bias": True}),
], ids=["mistral", "qwen3", "qwen2", "olmo2", "qwen3moe-dense"])
def test_a_bias_flag_the_family_ignores_is_ignored(tmp_path, model_cls, config_cls, kwargs, flags):
    assert_logits_match(checkpoint(tmp_path, model_cls, config_cls, kwargs, lambda hf: hf.update(flags)))
