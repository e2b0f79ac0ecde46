"""OpenAI gpt-oss (model_type "gpt_oss": GptOssForCausalLM, gpt-oss-20b / -120b): logits as transformers 5.25's eager
path computes them (its only CPU one: SDPA cannot add the sinks' column) on tiny seeded checkpoints whose prompts
run past the sliding window, with the sinks, the biased router, the experts' biases and the SwiGLU's clamp all
moving the logits, on every attention path (prefill whole and chunked, batched extends, decode, branch trees, the
CUDA-graph static steps run uncaptured); the Hub's MXFP4 experts (packed here per the format, transformers itself
reading them back to the same logits) dequantized bit for bit as transformers does; greedy ar / sd / ssd as its
generate; 2 TP ranks as 1; its config read as GptOssConfig reads it, and what is not supported refused."""
from __future__ import annotations

import json

import pytest
import torch
from model_checks import (check_batched_extends, check_greedy_generation, check_logits, check_static_steps,
                          check_two_branches, check_two_ranks_match_transformers, hf_logits, perturbed_pair,
                          random_tokens, randomise)
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM

from saguaro_dist.model.attention import attention_kernel
from saguaro_dist.model.hf_config import parse_config
from saguaro_dist.model.mxfp4 import FP4_VALUES, dequantize, pack
from saguaro_dist.model.runner import ModelRunner

VOCAB, WINDOW, ATOL = 64, 6, 1e-5
# yarn as the Hub's (a smaller original context); swiglu_limit 1 and alpha 1.2, not 7 / 1.702: the clamp binds on
# a tiny model and a default alpha would hide a field not read. intermediate 32: MXFP4 packs 32 values a scale.
ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": WINDOW, "max_position_embeddings": 256, "rope_parameters": ROPE,
        "swiglu_limit": 1.0, "swiglu_alpha": 1.2, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def make_gpt_oss(seed: int = 0, sharpen: float = 1.0, **changes) -> GptOssForCausalLM:
    """Seeded, randomised (model_checks.randomise), and the parts HF initialises near zero made to matter: sinks
    of a few units, a sharp router, biases on the router and every expert, gate / up past the clamp."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**{**TEXT, **changes})).eval()
    randomise(model, sharpen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(2.0 * torch.randn_like(p))
            elif name.endswith(("router.weight", "router.bias")):
                p.copy_(6.0 * torch.randn_like(p) / 32 ** 0.5)
            elif name.endswith("_bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("experts.gate_up_proj"):  # gate and up of a few units: the clamp at 1 binds
                p.mul_(20.0)
    assert model.config._attn_implementation == "eager"
    return model


def save_gpt_oss(path, seed: int = 0, sharpen: float = 1.0, **changes) -> GptOssForCausalLM:
    model = make_gpt_oss(seed, sharpen, **changes)
    model.save_pretrained(path)
    return model


def save_mxfp4(path, model: GptOssForCausalLM, seed: int = 11) -> None:
    """The Hub's layout: model's expert weights put on the MXFP4 grid (in place, so it stays the reference),
    written as *_blocks / *_scales (rows the output features) in a second shard after their scales' own, with
    config.json's quantization_config; every other tensor as it is."""
    gen, first, second = torch.Generator().manual_seed(seed), {}, {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                first[name] = p.detach().clone()
                continue
            experts, cols, rows = p.shape  # [E, in, out]
            codes = torch.randint(0, 16, (experts, rows, cols), generator=gen)
            exponents = torch.randint(-5, -2, (experts, rows, cols // 32), generator=gen)
            values = torch.ldexp(torch.tensor(FP4_VALUES)[codes], exponents.repeat_interleave(32, -1))
            p.copy_(values.transpose(1, 2))
            first[f"{name}_scales"], second[f"{name}_blocks"] = pack(values, exponents)[::-1]
    path.mkdir(parents=True)
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for file, tensors in shards.items():
        save_file(tensors, str(path / file), metadata={"format": "pt"})
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {**model.config.to_dict(), "quantization_config": {"quant_method": "mxfp4",
                                                                "modules_to_not_convert": NOT_CONVERTED}}
    (path / "config.json").write_text(json.dumps(config))


def tokens(seed: int, n: int) -> list[int]:
    return random_tokens(seed, n, VOCAB)


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "m"
    torch.set_num_threads(1)
    return {"path": path, "model": save_gpt_oss(path, seed=3)}


def test_sinks_biases_and_the_clamp_each_move_the_logits_here(oss):
    """The checks below would miss none of them: without each, transformers' logits move by far more than ATOL."""
    seq, want = tokens(2, 24), hf_logits(oss["model"], tokens(2, 24))
    for name, value in (("sinks", -1e4), ("router.bias", 0.0), ("experts.gate_up_proj_bias", 0.0),
                        ("experts.down_proj_bias", 0.0)):
        other = make_gpt_oss(seed=3)
        with torch.no_grad():
            for p_name, p in other.named_parameters():
                if p_name.endswith(name):
                    p.fill_(value)
        assert (hf_logits(other, seq) - want).abs().max() > 100 * ATOL, name
    unclamped = make_gpt_oss(seed=3, swiglu_limit=1e4)
    assert (hf_logits(unclamped, seq) - want).abs().max() > 100 * ATOL


# ---- logits on every attention path, prompts past the window -------------------------------------
@pytest.mark.parametrize("chunk", [2048, 5])
def test_logits_match_transformers_in_prefill_and_decode(oss, chunk):
    """Half the prompt prefilled (whole, or in chunks of 5), the rest decoded; 24 tokens, the window 6."""
    check_logits(oss["path"], oss["model"], tokens(2, 24), max_num_batched_tokens=chunk)


def test_whole_prompts_of_mixed_lengths_then_a_batched_extend_match_transformers(oss):
    """Prompts from position 0 (no mask-free causal kernel with sinks: a causal mask), padded; then extends."""
    check_batched_extends(oss["path"], oss["model"], [tokens(7, 15), tokens(8, 9)], [[8], [3]], prompt_rows=True)


def test_branch_steps_match_transformers(oss):
    check_two_branches(oss["path"], oss["model"], tokens(9, 7))


def test_the_static_steps_give_the_eager_logits(oss):
    """The CUDA-graph layouts run uncaptured (an MoE model is never captured: it runs eagerly)."""
    check_static_steps(oss["path"])


def test_sinks_leave_sdpa_and_sdpa_models_keep_their_kernel():
    """gpt-oss attends by the hand-written sink kernel; every other model keeps SDPA's (the same object)."""
    kernel = attention_kernel(None, sinks=True)
    assert kernel.dense.__name__ == "sink_attention" and kernel.causal is None
    assert attention_kernel(None) is attention_kernel(None, sinks=False)
    with pytest.raises(ValueError, match="softcapping and attention sinks together are not supported"):
        attention_kernel(50.0, sinks=True)


# ---- MXFP4: the Hub's expert format ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_transformers_bit_for_bit(dtype):
    """Random blocks and every scale byte (0..255: overflow and underflow too), against convert_moe_packed_tensors."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 256, (3, 10, 4), generator=gen, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize(blocks, scales, dtype).transpose(1, 2)
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits))


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "m"
    torch.set_num_threads(1)
    model = make_gpt_oss(seed=4)
    save_mxfp4(path, model)
    return {"path": path, "model": model}


def test_mxfp4_experts_load_dequantized_and_transformers_reads_the_same(mxfp4):
    """Blocks in one shard, their scales in another (the index names each); transformers reads the checkpoint
    back (dequantizing it) to the very logits of the model it was packed from: the packing is the format."""
    seq = tokens(2, 20)
    reread = AutoModelForCausalLM.from_pretrained(mxfp4["path"], dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(reread, seq), hf_logits(mxfp4["model"], seq), atol=0, rtol=0)
    check_logits(mxfp4["path"], mxfp4["model"], seq)


@pytest.mark.slow
def test_tensor_parallel_two_ranks_give_transformers_logits(mxfp4):
    """Heads (and their sinks) and each expert's width split, the router replicated, rank 0 alone adding the
    experts' down biases; from the MXFP4 checkpoint, each rank dequantizing its own slice."""
    check_two_ranks_match_transformers(mxfp4["path"], mxfp4["model"], tokens(3, 14))


def test_mxfp4_blocks_without_their_scales_are_refused(mxfp4, tmp_path):
    index = json.loads((mxfp4["path"] / "model.safetensors.index.json").read_text())
    for file in ("config.json", *set(index["weight_map"].values())):
        (tmp_path / file).write_bytes((mxfp4["path"] / file).read_bytes())
    del index["weight_map"]["model.layers.1.mlp.experts.down_proj_scales"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.experts.down_proj_blocks' .MXFP4. has no "
                                         "'model.layers.1.mlp.experts.down_proj_scales' beside it"):
        ModelRunner(tmp_path)


# ---- greedy generation: a gpt-oss target and a perturbed gpt-oss draft -----------------------------
@pytest.fixture(scope="module")
def oss_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_pair")
    torch.set_num_threads(1)
    return perturbed_pair(root, save_gpt_oss(root / "target", seed=0, sharpen=4.0))


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_generation_matches_transformers_generate(oss_pair, mode):
    check_greedy_generation(oss_pair, mode, tokens(5, 12), 20)


# ---- config.json as transformers reads it, and refusals ------------------------------------------
# gpt-oss-20b's config.json (transformers 4.55): rope_scaling beside rope_theta, MXFP4 experts
HUB_20B = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
           "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
           "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
           "quantization_config": {"modules_to_not_convert": NOT_CONVERTED, "quant_method": "mxfp4"},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
           "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}


def test_a_hub_config_reads_as_transformers_reads_it():
    want = GptOssConfig.from_dict(HUB_20B)
    cfg = parse_config(HUB_20B)
    assert cfg.layer_windows == tuple(128 if t == "sliding_attention" else None for t in want.layer_types)
    assert cfg.rope == {**want.rope_parameters, "rope_theta": 150000} and cfg.max_position_embeddings == 131072
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (want.swiglu_alpha, want.swiglu_limit) == (1.702, 7.0)
    assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias and not cfg.qk_norm and cfg.sparse_layers == (True,) * 24
    assert cfg.eos_token_ids == (200002,) and not cfg.tie_word_embeddings and cfg.head_dim == 64


def test_omitted_fields_take_gptossconfigs_defaults():
    """No rope, no layer_types: GptOssConfig's yarn (theta 150000) and its alternation, sliding first."""
    cfg = parse_config({"model_type": "gpt_oss", "num_hidden_layers": 4})
    want = GptOssConfig(num_hidden_layers=4)
    assert cfg.rope == want.rope_parameters and cfg.layer_windows == (128, None, 128, None)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.vocab_size) == (128, 4, 201088)


@pytest.mark.parametrize("changes, message", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8'.*not supported .but gpt-oss's mxfp4"),
    ({"swiglu_limit": 0}, "swiglu_limit must be a finite number > 0, got 0"),
    ({"swiglu_alpha": None}, "swiglu_alpha must be a finite number > 0, got None"),
    ({"num_experts_per_tok": 33}, "num_experts_per_tok 33 is more than the 32 experts"),
    ({"num_local_experts": 0}, "num_local_experts must be an integer >= 1, got 0"),
    ({"sliding_window": None}, "sliding_window must be a positive integer, got None"),
    ({"layer_types": ["full_attention"]}, "layer_types must give each of the 24 layers"),
])
def test_what_this_runtime_cannot_compute_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        parse_config({**HUB_20B, **changes})


def test_float16_is_refused_and_auto_takes_bfloat16():
    """The Hub's gpt-oss config.json names no dtype (read as float32), so auto took float16 on a GPU, where the
    activations of 120b's later layers overflow it; vLLM's MXFP4 path takes bfloat16 only."""
    from saguaro_dist.model.device import DeviceKind, resolve_dtype
    assert "torch_dtype" not in HUB_20B and "dtype" not in HUB_20B
    with pytest.raises(ValueError, match="float16 is not supported for gpt_oss models"):
        resolve_dtype("float16", HUB_20B, "cpu")
    assert resolve_dtype("auto", HUB_20B, DeviceKind("cuda", (9, 0))) == torch.bfloat16


def test_a_model_refusing_cuda_graphs_says_why(oss):
    """MoE models (gpt-oss among them) run eagerly; the runner asks graph_refusal before it reserves a graph's
    scratch KV row (a refused StepGraphs took one that nothing used)."""
    from saguaro_dist.model.cuda_graphs import graph_refusal
    assert "mixture-of-experts" in graph_refusal(ModelRunner(str(oss["path"]), dtype="float32").model)
