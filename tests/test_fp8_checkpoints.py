"""FP8 checkpoints (quantization_config quant_method "fp8" with block or one scale a weight, "compressed-tensors"
float8 channel / tensor / block, "fbgemm_fp8"), written here from tiny transformers models as those tools write
them (float8_e4m3fn weights beside their scales, some modules left unquantized, scales in another shard), load
dequantized: the logits transformers computes from the dequantized weights (and transformers' own FP8 loading),
greedy ar / sd / ssd with an FP8 target and draft, 2 TP ranks as 1; any other quantization refused, naming it."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from model_checks import (check_greedy_generation, check_logits, check_two_ranks_match_transformers, hf_logits,
                          random_tokens, save_perturbed_draft, save_seeded)
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from saguaro_dist.model.hf_config import parse_config
from saguaro_dist.model.runner import ModelRunner

VOCAB = 64
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
FAMILIES = {"llama": (LlamaForCausalLM, lambda: LlamaConfig(**COMMON)),
            "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**COMMON, head_dim=16)),
            # per-expert projections (the Hub's layout), each its own float8 weight; the router left unquantized
            "qwen3_moe": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4,
                                                                      num_experts_per_tok=2, moe_intermediate_size=24)),
            # fused qkv_proj / gate_up_proj: dequantized whole, then split into our projections
            "phi3": (Phi3ForCausalLM, lambda: Phi3Config(**COMMON))}
UNQUANTIZED = ["lm_head", "model.layers.0.mlp.down_proj"]  # kept in their dtype, as the configs' ignore lists say
FP8_MAX = 448.0  # float8_e4m3fn's largest value


def _ct(strategy: str, dynamic_inputs: bool, block=None) -> dict:
    """A compressed-tensors (llm-compressor) float8 config, as its FP8-dynamic / FP8 checkpoints ship it."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": None, "block_structure": block, "observer": "minmax"}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic_inputs,
              "strategy": "token" if dynamic_inputs else "tensor"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": UNQUANTIZED, "kv_cache_scheme": None, "sparsity_config": {},
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None}}}


# variant -> (quantization_config, scale layout, block, scale suffix, scale dtype, extra per-weight tensor)
VARIANTS = {
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [24, 24],
                   "modules_to_not_convert": UNQUANTIZED}, "block", (24, 24), "_scale_inv", torch.float32, None),
    "fp8_tensor": ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": UNQUANTIZED},
                   "tensor", None, "_scale", torch.float32, "input_scale"),
    "ct_channel": (_ct("channel", True), "channel", None, "_scale", torch.bfloat16, None),
    "ct_tensor": (_ct("tensor", False), "tensor", None, "_scale", torch.float32, "input_scale"),
    "ct_block": (_ct("block", True, [16, 16]), "block", (16, 16), "_scale", torch.bfloat16, None),
    "fbgemm": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": UNQUANTIZED},
               "channel", None, "_scale", torch.float32, "input_scale_ub"),
}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def quantize(w: torch.Tensor, layout: str, block, scale_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (float8 values, scale): each block's / row's / the tensor's amax onto FP8_MAX."""
    if layout == "tensor":
        scale = (w.abs().max() / FP8_MAX).to(scale_dtype)
    elif layout == "channel":
        scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).to(scale_dtype)
    else:
        (bm, bn), (rows, cols) = block, w.shape
        padded = torch.zeros(math.ceil(rows / bm) * bm, math.ceil(cols / bn) * bn)
        padded[:rows, :cols] = w
        tiles = padded.reshape(padded.shape[0] // bm, bm, padded.shape[1] // bn, bn)
        scale = (tiles.abs().amax((1, 3)) / FP8_MAX).to(scale_dtype)
    return (w / expand(scale, w.shape, layout, block)).to(torch.float8_e4m3fn), scale


def expand(scale: torch.Tensor, shape, layout: str, block) -> torch.Tensor:
    """The scale of every weight value (float32): a block's over its tile, an edge tile's over what is left."""
    if layout != "block":
        return scale.float().expand(shape)
    rows, cols = shape
    return scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def write_fp8_copy(src, dst, spec: tuple, shard_scales: bool = True) -> dict:
    """dst: src's checkpoint with every projection but UNQUANTIZED's in float8 beside its scale (+ an activation
    scale where the variant `spec` ships one), scales in a second shard; returns the dequantized state dict."""
    quant, layout, block, suffix, scale_dtype, extra = spec
    weights, scales, dequantized = {}, {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        module = name.rpartition(".")[0]
        if not name.endswith("_proj.weight") or module in UNQUANTIZED:
            weights[name] = dequantized[name] = w
            continue
        weights[name], scales[name + suffix] = quantize(w, layout, block, scale_dtype)
        dequantized[name] = weights[name].float() * expand(scales[name + suffix], w.shape, layout, block)
        if extra:
            scales[f"{module}.{extra}"] = torch.tensor([0.02])
    dst.mkdir(parents=True)
    shards = {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales}
    if not shard_scales:
        shards = {"model.safetensors": {**weights, **scales}}
    for file, tensors in shards.items():
        save_file(tensors, dst / file, metadata={"format": "pt"})
    if shard_scales:
        index = {"metadata": {}, "weight_map": {n: f for f, ts in shards.items() for n in ts}}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return dequantized


def reference(src, dequantized: dict, folder):
    """transformers' model of src's config with the dequantized weights (saved under src's names, then read by
    transformers, which converts the Hub's per-expert layout to its own)."""
    folder.mkdir()
    shutil.copy(src / "config.json", folder / "config.json")
    save_file(dequantized, folder / "model.safetensors", metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each family's seeded tiny checkpoint (peaked head, for greedy runs) and a perturbed draft of Llama's."""
    root = tmp_path_factory.mktemp("fp8_src")
    made = {family: (save_seeded(root / family, cls, make, seed=5, sharpen=4.0), root / family)
            for family, (cls, make) in FAMILIES.items()}
    save_perturbed_draft(root / "draft", made["llama"][0], seed=1)
    return made, root / "draft"


def fp8_copy(sources, tmp_path, family: str, variant: str, **kw):
    src = sources[0][family][1]
    dequantized = write_fp8_copy(src, tmp_path / variant, VARIANTS[variant], **kw)
    return tmp_path / variant, reference(src, dequantized, tmp_path / f"{variant}_dequantized")


@pytest.mark.parametrize("family, variant", [("llama", v) for v in VARIANTS] + [("qwen3", "fp8_block"),
                                                                               ("qwen3", "ct_channel"),
                                                                               ("qwen3_moe", "fp8_block"),
                                                                               ("phi3", "ct_channel")])
def test_logits_are_transformers_of_the_dequantized_weights(sources, tmp_path, family, variant):
    path, ref = fp8_copy(sources, tmp_path, family, variant)
    check_logits(path, ref, random_tokens(3, 20, VOCAB))


def test_the_dequantized_model_is_not_the_unquantized_one(sources, tmp_path):
    """FP8 rounding moves the logits by far more than the checks' tolerance: they would see a weight left as it was."""
    _, ref = fp8_copy(sources, tmp_path, "llama", "fp8_block")
    seq = random_tokens(3, 20, VOCAB)
    assert (hf_logits(ref, seq) - hf_logits(sources[0]["llama"][0], seq)).abs().max() > 1e-3


def test_transformers_own_fp8_loading_agrees(sources, tmp_path):
    """transformers' FineGrainedFP8 loader (dequantizing on a CPU) reads the checkpoint as we do: its semantics
    (value x weight_scale_inv per block), not only this file's reference."""
    quant, layout, _, *rest = VARIANTS["fp8_block"]
    spec = ({**quant, "weight_block_size": [16, 16]}, layout, (16, 16), *rest)  # transformers': tiles that divide
    write_fp8_copy(sources[0]["llama"][1], tmp_path / "q", spec, shard_scales=False)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).eval()
    check_logits(tmp_path / "q", theirs, random_tokens(4, 20, VOCAB))


def test_bfloat16_rounds_each_value_once(sources, tmp_path):
    """In bf16 the prefill is transformers' bf16 load of the dequantized (float32) weights, bit for bit: the
    float32 product rounded once to bf16, as transformers' Fp8Dequantize does."""
    path, _ = fp8_copy(sources, tmp_path, "llama", "ct_channel")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ct_channel_dequantized", dtype=torch.bfloat16).eval()
    runner, seq = ModelRunner(path, dtype=torch.bfloat16), random_tokens(5, 16, VOCAB)
    runner.add("s")
    torch.testing.assert_close(runner.extend(["s"], [seq], [len(seq)])[0], hf_logits(theirs, seq), atol=0, rtol=0)


def test_a_log_line_says_the_weights_are_held_dequantized_and_what_it_costs(sources, tmp_path, caplog):
    path, _ = fp8_copy(sources, tmp_path, "llama", "fp8_tensor")
    values = sum(t.numel() for n, t in load_file(path / "model-00001-of-00002.safetensors").items()
                 if t.dtype == torch.float8_e4m3fn)
    with caplog.at_level("INFO", logger="saguaro_dist.model.fp8"):
        ModelRunner(path, dtype=torch.bfloat16)
    assert "13 float8 weights" in caplog.text and "held dequantized in bfloat16" in caplog.text
    assert f"{values} bytes more than FP8" in caplog.text and "static input scales unused" in caplog.text


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_generation_with_fp8_target_and_draft(sources, tmp_path, mode):
    write_fp8_copy(sources[1], tmp_path / "draft", VARIANTS["ct_channel"])
    path, ref = fp8_copy(sources, tmp_path, "llama", "fp8_block")
    pair = {"target": str(path), "draft": str(tmp_path / "draft"), "model": ref}
    check_greedy_generation(pair, mode, [5, 9, 2, 7, 11, 3], 12)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_compute_as_one(sources, tmp_path):
    """Each rank dequantizes the whole weight, then keeps its rows / columns: block edges need not meet the split."""
    path, ref = fp8_copy(sources, tmp_path, "qwen3", "fp8_block")
    check_two_ranks_match_transformers(path, ref, random_tokens(6, 16, VOCAB))


@pytest.mark.slow
def test_one_kv_head_replicated_over_two_ranks(tmp_path):
    """Fewer KV heads than ranks: each rank keeps the whole dequantized k / v head (a 24-row block straddles it)."""
    src = tmp_path / "src"
    save_seeded(src, Qwen3ForCausalLM, lambda: Qwen3Config(**{**COMMON, "num_key_value_heads": 1}, head_dim=16), seed=5)
    dequantized = write_fp8_copy(src, tmp_path / "fp8", VARIANTS["fp8_block"])
    ref = reference(src, dequantized, tmp_path / "dequantized")
    check_two_ranks_match_transformers(tmp_path / "fp8", ref, random_tokens(6, 16, VOCAB))


# ---- what is refused ------------------------------------------------------------------------------------
_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                       "symmetric": True}}}}


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "gptq", "bits": 4},
     "quant_method 'gptq'.*not supported but FP8 ones .quant_method 'fp8', 'compressed-tensors', 'fbgemm_fp8'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'.*not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'.*not supported"),
    ({"quant_method": "mxfp4"}, "quant_method 'mxfp4'.* on model_type 'llama': not supported"),
    (_INT4, "config_groups 'group_0': int4 weights .format 'pack-quantized', strategy 'group'. are not supported"),
    ({**_ct("channel", True), "sparsity_config": {"format": "sparse-24-bitmask"}},
     "sparsity_config format 'sparse-24-bitmask' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
])
def test_other_quantizations_are_refused_naming_them(quant, message):
    with pytest.raises(ValueError, match=message):
        parse_config({**LlamaConfig(**COMMON).to_dict(), "quantization_config": quant})


def _rewrite_scales(path, change) -> None:
    file = path / "model-00002-of-00002.safetensors"
    scales = load_file(file)
    change(scales)
    save_file(scales, file, metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != file.name or n in scales}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update({"model.layers.1.self_attn.k_proj.weight_scale_inv": torch.ones(2, 2)}),
     ("FP8 tensor 'model.layers.1.self_attn.k_proj.weight': its scale has shape .2, 2., the weight .16, 32. under "
      "quant_method 'fp8' .block scales .24, 24.. needs .1, 2.")),
    (lambda s: s.pop("model.layers.0.mlp.up_proj.weight_scale_inv"),
     "FP8 tensor 'model.layers.0.mlp.up_proj.weight' .float8. has no scale tensor"),
])
def test_a_scale_that_does_not_fit_its_weight_is_refused_naming_it(sources, tmp_path, change, message):
    path, _ = fp8_copy(sources, tmp_path, "llama", "fp8_block")
    _rewrite_scales(path, change)
    with pytest.raises(ValueError, match=message):
        ModelRunner(path)


def test_an_fp8_config_over_unquantized_weights_is_refused(sources, tmp_path):
    """vLLM would quantize such weights on load: another model than the stored one."""
    _, src = sources[0]["llama"]
    shutil.copytree(src, tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ValueError, match="stores no float8 weight: quantizing an unquantized checkpoint"):
        ModelRunner(tmp_path / "m")
