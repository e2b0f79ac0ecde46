"""Qwen2-MoE ("qwen2_moe": a sigmoid-gated shared expert beside the routed ones) and OLMoE ("olmoe": q / k norms
over whole projections, Llama's pre-norms, clip_qkv) beyond test_model_moe.py's every-path checks (which run
both families): their Hub config.json files read as transformers reads them, bf16 prefill bit for bit
transformers' (OLMoE's q / k norms cast before the weight, unlike OLMo 2's), an MoE model as the draft, and
the configs this runtime cannot compute refused by name."""
from __future__ import annotations

import pytest
import torch
from model_checks import check_bf16_prefill_bitwise, check_greedy_generation
from test_model_moe import save_moe, tokens
from transformers import OlmoeConfig, Qwen2MoeConfig

from saguaro_dist.model.hf_config import parse_config

# The Hub files' config.json (Qwen/Qwen1.5-MoE-A2.7B, allenai/OLMoE-1B-7B-0924), as written before transformers 5:
# no layer_types, no qkv_bias (Qwen2MoeConfig's default: True), num_experts
QWEN15_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 151936,
              "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
              "num_key_value_heads": 16, "hidden_act": "silu", "max_position_embeddings": 8192,
              "max_window_layers": 21, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768,
              "use_sliding_window": False, "tie_word_embeddings": False, "decoder_sparse_step": 1,
              "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
              "num_experts": 60, "norm_topk_prob": False, "bos_token_id": 151643, "eos_token_id": 151643}
OLMOE_1B_7B = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
               "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
               "num_key_value_heads": 16, "hidden_act": "silu", "max_position_embeddings": 4096,
               "attention_bias": False, "clip_qkv": None, "num_experts": 64, "num_experts_per_tok": 8,
               "norm_topk_prob": False, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000.0,
               "tie_word_embeddings": False, "eos_token_id": 50279, "pad_token_id": 1}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_the_hub_qwen2_moe_config_reads_as_transformers_reads_it():
    cfg, want = parse_config(QWEN15_MOE), Qwen2MoeConfig.from_dict(QWEN15_MOE)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (want.num_experts, 4, 1408)
    assert cfg.shared_expert_intermediate_size == want.shared_expert_intermediate_size == 5632
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm and not cfg.renormalise_topk
    assert not cfg.routing_weights_fp32 and cfg.sparse_layers == (True,) * 24 and cfg.layer_windows == ()
    assert not parse_config({**QWEN15_MOE, "qkv_bias": False}).qkv_bias


def test_a_qwen2_moe_config_without_kv_heads_takes_qwen2moeconfigs_default():
    """Qwen2MoeConfig defaults num_key_value_heads to 16, not to the head count (a reviewer's find)."""
    hf = {k: v for k, v in {**QWEN15_MOE, "num_attention_heads": 32}.items() if k != "num_key_value_heads"}
    assert parse_config(hf).num_kv_heads == Qwen2MoeConfig.from_dict(hf).num_key_value_heads == 16


def test_qwen2_moe_sliding_layers_follow_transformers_rule():
    """Qwen2MoeConfig's layer_types when config.json has none: even layers below max_window_layers slide."""
    hf = {**QWEN15_MOE, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 7}
    windows = [5 if t == "sliding_attention" else None for t in Qwen2MoeConfig.from_dict(hf).layer_types]
    assert list(parse_config(hf).layer_windows) == windows and windows[:10] == [5, None] * 4 + [None] * 2


def test_the_hub_olmoe_config_reads_as_transformers_reads_it():
    cfg, want = parse_config(OLMOE_1B_7B), OlmoeConfig.from_dict(OLMOE_1B_7B)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (want.num_experts, 8, 1024)
    assert cfg.projection_qk_norms and cfg.qkv_clip is None and not cfg.qk_norm and not cfg.renormalise_topk
    assert cfg.rms_norm_eps == want.rms_norm_eps and not cfg.qkv_bias and cfg.sparse_layers == (True,) * 16
    assert cfg.shared_expert_intermediate_size == 0 and cfg.layer_windows == () and cfg.rope["rope_theta"] == 1e4
    assert parse_config({**OLMOE_1B_7B, "clip_qkv": 8}).qkv_clip == 8.0
    no_eps = {k: v for k, v in OLMOE_1B_7B.items() if k != "rms_norm_eps"}
    assert parse_config(no_eps).rms_norm_eps == OlmoeConfig.from_dict(no_eps).rms_norm_eps == 1e-5


@pytest.mark.parametrize("hf, message", [
    ({**QWEN15_MOE, "shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size must be an integer >= 1"),
    ({**QWEN15_MOE, "n_shared_experts": 2}, "n_shared_experts 2: a shared expert is not supported"),
    ({**QWEN15_MOE, "num_experts_per_tok": 61}, "num_experts_per_tok 61 is more than the 60 experts"),
    ({**QWEN15_MOE, "mlp_only_layers": [24]}, r"mlp_only_layers must list layer indices in 0..23"),
    ({**OLMOE_1B_7B, "shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size 64: a shared expert"),
    ({**OLMOE_1B_7B, "head_dim": 64}, "head_dim 64 x num_attention_heads 16 must be hidden_size 2048"),
    ({**OLMOE_1B_7B, "clip_qkv": -1}, "clip_qkv must be null or a finite number > 0, got -1"),
    ({**OLMOE_1B_7B, "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_what_this_runtime_cannot_compute_is_refused(hf, message):
    with pytest.raises(ValueError, match=message):
        parse_config(hf)


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_bf16_prefill_is_bitwise_transformers(family, tmp_path):
    save_moe(tmp_path, family, seed=3)
    check_bf16_prefill_bitwise(tmp_path, tokens(2, 16))


@pytest.fixture(scope="module")
def moe_draft_pair(tmp_path_factory):
    """An OLMoE target, a Qwen2-MoE draft of the same vocabulary: the draft runs experts too."""
    root = tmp_path_factory.mktemp("moe_draft")
    torch.set_num_threads(1)
    model = save_moe(root / "target", "olmoe", seed=0, sharpen=4.0)
    save_moe(root / "draft", "qwen2_moe", seed=1, sharpen=4.0)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": model}


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_an_moe_draft_keeps_greedy_generation_exact(moe_draft_pair, mode):
    check_greedy_generation(moe_draft_pair, mode, tokens(5, 12), 20)
