"""FP8 checkpoints (config.json quantization_config: quant_method "fp8", "compressed-tensors" with float8 weights,
"fbgemm_fp8") dequantized on load to the model's dtype: weights only, as model/mxfp4.py does gpt-oss's experts. Each
quantized weight is stored float8 (e4m3fn) beside a float32 / bfloat16 scale tensor named after it
(`x.weight` + `_scale_inv` / `_scale`); its value is the FP8 value times its scale, by the scheme's layout:
  BLOCK    [ceil(rows / bm), ceil(cols / bn)]: one scale a bm x bn tile (transformers' FineGrainedFP8, DeepSeek-V3's
           weight_scale_inv, compressed-tensors strategy "block"); edge tiles cover what is left;
  CHANNEL  [rows, 1]: one a row, i.e. an output feature (compressed-tensors "channel", fbgemm_fp8);
  TENSOR   a scalar (or [1]): one for the weight (vLLM's "fp8" without weight_block_size, compressed-tensors "tensor").
The product is taken in float32 and rounded once to the dtype (as transformers' Fp8Dequantize). Activation and KV
cache scales (input_scale, k_scale, ...) are not used: the matmuls run in the model's dtype, where vLLM computes W8A8
FP8 GEMMs, so outputs differ slightly from vLLM's. No memory is saved: the weights take the dtype's size. A weight a
config leaves unquantized (modules_to_not_convert / ignored_layers / ignore) is stored in its own dtype, loads as such."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Container
from dataclasses import dataclass
from enum import Enum

import torch

log = logging.getLogger(__name__)

FP8_METHODS = ("fp8", "compressed-tensors", "fbgemm_fp8")
_FLOAT8_DTYPES = {"F8_E4M3", "F8_E5M2"}  # safetensors' names (torch.float8_e4m3fn, float8_e5m2)
_CT_FP8_FORMATS = ("float-quantized", "naive-quantized")  # compressed-tensors' formats storing float8 values as is
_CT_STRATEGIES = ("tensor", "channel", "block")
_ROWS_PER_STEP = 1024  # rows dequantized at once when no block sets the step: bounds the float32 temporary


class ScaleLayout(Enum):
    BLOCK = "block"
    CHANNEL = "channel"
    TENSOR = "tensor"


@dataclass(frozen=True)
class Fp8Scheme:
    """A checkpoint's FP8 weights: how their scales are laid out and named (a weight's name + a suffix, tried in
    order), and whether static input scales ship (unused here: a weight-only dequantization)."""
    method: str
    layout: ScaleLayout
    scale_suffixes: tuple[str, ...]
    block: tuple[int, int] | None = None
    static_activations: bool = False


def _block(value, field: str) -> tuple[int, int]:
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if not (ok and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"config.json quantization_config {field} must be two positive integers [rows, cols], "
                         f"got {value!r}")
    return int(value[0]), int(value[1])


def _finegrained(quant: dict) -> Fp8Scheme:
    """transformers' FineGrainedFP8Config / DeepSeek's / vLLM's Fp8Config: weight_block_size set: block scales
    `weight_scale_inv`; unset: one scale a weight (vLLM's `weight_scale`, transformers' `weight_scale_inv`)."""
    static = quant.get("activation_scheme", "dynamic") == "static"
    if quant.get("weight_block_size") is None:
        return Fp8Scheme("fp8", ScaleLayout.TENSOR, ("_scale", "_scale_inv"), static_activations=static)
    block = _block(quant["weight_block_size"], "weight_block_size")
    return Fp8Scheme("fp8", ScaleLayout.BLOCK, ("_scale_inv",), block, static_activations=static)


def _weights_kind(weights: dict, fmt) -> str:
    """A compressed-tensors group's weights in words (what a refusal names)."""
    kind = f"{weights.get('type', '?')}{weights.get('num_bits', '?')}"
    return f"{kind} weights (format {fmt!r}, strategy {weights.get('strategy')!r})"


def _ct_group(name: str, group: dict, fmt) -> tuple[str, tuple[int, int] | None, bool]:
    """One compressed-tensors config group: (its weights' strategy, block, static input scales), or refused."""
    weights = group.get("weights") or {}
    fp8 = (weights.get("type") == "float" and weights.get("num_bits") == 8 and weights.get("symmetric", True)
           and not weights.get("dynamic", False) and weights.get("strategy") in _CT_STRATEGIES)
    if not fp8 or fmt not in _CT_FP8_FORMATS:
        raise ValueError(f"config.json quantization_config (quant_method 'compressed-tensors') config_groups {name!r}: "
                         f"{_weights_kind(weights, fmt)} are not supported; only float8 weights (type 'float', "
                         f"num_bits 8, symmetric, strategy {' / '.join(_CT_STRATEGIES)}, format "
                         f"{' / '.join(_CT_FP8_FORMATS)}), dequantized on load")
    block = None
    if weights["strategy"] == "block":
        block = _block(weights.get("block_structure"), f"config_groups {name!r} weights block_structure")
    inputs = group.get("input_activations") or {}
    return weights["strategy"], block, bool(inputs) and not inputs.get("dynamic", False)


def _compressed_tensors(quant: dict) -> Fp8Scheme:
    """llm-compressor's checkpoints (RedHat / neuralmagic "FP8-dynamic", "FP8"): every config group's weights
    float8, one strategy for all; a sparse format is refused (its weights are stored compressed)."""
    sparsity = quant.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"config.json quantization_config (quant_method 'compressed-tensors') sparsity_config format "
                         f"{sparsity['format']!r} is not supported (only dense weights)")
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError("config.json quantization_config (quant_method 'compressed-tensors') has no config_groups")
    found = {_ct_group(name, group, group.get("format") or quant.get("format")) for name, group in groups.items()}
    layouts = {(strategy, block) for strategy, block, _ in found}
    if len(layouts) > 1:
        raise ValueError("config.json quantization_config (quant_method 'compressed-tensors') config_groups mix weight "
                         f"strategies {sorted(map(str, layouts))}: not supported (one strategy for every group)")
    (strategy, block), = layouts
    return Fp8Scheme("compressed-tensors", ScaleLayout(strategy), ("_scale",), block,
                     static_activations=any(static for _, _, static in found))


def fp8_scheme(hf: dict) -> Fp8Scheme | None:
    """config.json's FP8 quantization_config as a scheme; None when it has none. Any other quantization (gptq, awq,
    bitsandbytes, int4 compressed-tensors, ...) is a ValueError naming it and what is supported."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "fp8":
        return _finegrained(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "fbgemm_fp8":
        return Fp8Scheme("fbgemm_fp8", ScaleLayout.CHANNEL, ("_scale",))
    raise ValueError(f"config.json has a quantization_config (quant_method {method!r}): quantized checkpoints are not "
                     f"supported but FP8 ones (quant_method {', '.join(map(repr, FP8_METHODS))}: dequantized on load) "
                     "and gpt-oss's mxfp4 experts; use the unquantized (float16 / bfloat16 / float32) or an FP8 model")


def is_scale(name: str) -> bool:
    """A quantization scale tensor (a weight's, an activation's, the KV cache's): read with its weight or unused."""
    return name.rpartition(".")[2].endswith(("_scale", "_scale_inv", "_scale_ub"))


def is_float8(sl) -> bool:
    """A checkpoint tensor (a safetensors slice, or the loader's slice of a loaded tensor) stored in float8."""
    tensor = getattr(sl, "tensor", None)
    if tensor is not None:
        return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return sl.get_dtype() in _FLOAT8_DTYPES


def expected_scale_shapes(weight_shape, scheme: Fp8Scheme) -> list[tuple[int, ...]]:
    """The scale shapes a weight of weight_shape [..., rows, cols] may have under the scheme."""
    *lead, rows, cols = weight_shape
    if scheme.layout is ScaleLayout.BLOCK:
        bm, bn = scheme.block
        return [(*lead, math.ceil(rows / bm), math.ceil(cols / bn))]
    if scheme.layout is ScaleLayout.CHANNEL:
        return [(*lead, rows, 1), (*lead, rows)]
    return [(), (1,)]


def check_scale(name: str, weight_shape, scale_shape, scheme: Fp8Scheme) -> None:
    """A scale tensor that cannot be the weight's under the scheme is refused, naming both."""
    weight_shape, scale_shape = tuple(weight_shape), tuple(scale_shape)
    if len(weight_shape) < 2:
        raise ValueError(f"FP8 tensor {name!r}: shape {weight_shape}, a float8 weight must be [..., rows, cols]")
    allowed = expected_scale_shapes(weight_shape, scheme)
    if scale_shape not in allowed:
        raise ValueError(f"FP8 tensor {name!r}: its scale has shape {scale_shape}, the weight {weight_shape} under "
                         f"quant_method {scheme.method!r} ({scheme.layout.value} scales"
                         f"{f' {list(scheme.block)}' if scheme.block else ''}) needs {' or '.join(map(str, allowed))}")


def _row_scales(scale: torch.Tensor, scheme: Fp8Scheme, step: int, first: int, last: int, cols: int) -> torch.Tensor:
    """The float32 scales of rows first..last (one step), broadcastable against those rows [..., last-first, cols]."""
    if scheme.layout is ScaleLayout.TENSOR:
        return scale.reshape(())
    if scheme.layout is ScaleLayout.CHANNEL:  # [..., rows, 1]
        return scale[..., first:last, :]
    tile = first // step  # a step is one tile row: each column's tile's scale, repeated over its bn columns
    return scale[..., tile:tile + 1, :].repeat_interleave(scheme.block[1], dim=-1)[..., :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, dtype: torch.dtype) -> torch.Tensor:
    """weight [..., rows, cols] float8 and its scale -> the weight in dtype: float8 value x scale in float32, rounded
    once; a tile row (or _ROWS_PER_STEP rows) at a time, so the float32 temporary stays small."""
    rows, cols = weight.shape[-2:]
    step = scheme.block[0] if scheme.layout is ScaleLayout.BLOCK else _ROWS_PER_STEP
    scale = scale.to(device=weight.device, dtype=torch.float32)
    if scheme.layout is ScaleLayout.CHANNEL:  # [..., rows] as [..., rows, 1]
        scale = scale.reshape(*weight.shape[:-1], 1)
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    for first in range(0, rows, step):
        last = min(first + step, rows)
        part = weight[..., first:last, :].float() * _row_scales(scale, scheme, step, first, last, cols)
        out[..., first:last, :] = part.to(dtype)
    return out


class DequantizedSlice:
    """A float8 checkpoint weight read as a safetensors slice is (get_shape, indexing): dequantized whole when
    indexed, so tensor parallel takes its rank's rows or columns of the dequantized weight."""

    def __init__(self, sl, scale: torch.Tensor, scheme: Fp8Scheme, dtype: torch.dtype, device):
        self.sl, self.scale, self.scheme, self.dtype, self.device = sl, scale, scheme, dtype, device

    def get_shape(self) -> list[int]:
        return list(self.sl.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return dequantize(self.sl[...].to(self.device), self.scale, self.scheme, self.dtype)[index]


class Fp8Weights:
    """The loader's hook for an FP8 checkpoint: (stored name, slice) -> the slice to load (a float8 weight's
    dequantized to dtype on device; any other tensor's as it is), or None for a scale tensor (a weight's, read with
    it; an activation's or the KV cache's, unused). names: the checkpoint's tensor names (which scale suffix a
    weight's has is looked up, not tried by reading); read_tensor(name): one of them whole (a scale may sit in
    another shard). Both are called once or so a weight: each must cost O(1), not a scan of the checkpoint."""

    def __init__(self, scheme: Fp8Scheme, names: Container[str], read_tensor: Callable[[str], torch.Tensor],
                 dtype, device):
        self.scheme, self.names, self.read_tensor, self.dtype, self.device = scheme, names, read_tensor, dtype, device
        self.weights = self.values = 0  # the float8 weights met, and their values (their bytes as FP8)

    def __call__(self, name: str, sl):
        if is_scale(name):
            return None
        if not is_float8(sl):
            return sl
        scale = self._scale_of(name)
        check_scale(name, sl.get_shape(), scale.shape, self.scheme)
        self.weights += 1
        self.values += math.prod(sl.get_shape())
        return DequantizedSlice(sl, scale, self.scheme, self.dtype, self.device)

    def _scale_of(self, name: str) -> torch.Tensor:
        for suffix in self.scheme.scale_suffixes:
            if name + suffix in self.names:
                return self.read_tensor(name + suffix)
        names = " or ".join(repr(name + suffix) for suffix in self.scheme.scale_suffixes)
        raise ValueError(f"FP8 tensor {name!r} (float8) has no scale tensor {names} in the checkpoint")

    def finish(self, model_dir) -> None:
        """Say what the dequantization costs; a checkpoint whose config says FP8 but holds no float8 weight is
        refused (vLLM would quantize it on load, a different model from the one its weights give here)."""
        if not self.weights:
            raise ValueError(f"config.json has a quantization_config (quant_method {self.scheme.method!r}) but "
                             f"{model_dir} stores no float8 weight: quantizing an unquantized checkpoint on load is "
                             "not supported; drop the quantization_config to load the weights as stored")
        log.info(held_dequantized_message(self.scheme, self.weights, self.values, self.dtype))


def held_dequantized_message(scheme: Fp8Scheme, weights: int, values: int, dtype: torch.dtype) -> str:
    """The log line of an FP8 checkpoint loaded: its weights held dequantized, and the bytes that costs over FP8."""
    extra, name = values * (dtype.itemsize - 1), str(dtype).removeprefix("torch.")
    block = f" {list(scheme.block)}" if scheme.block else ""
    inputs = "its static input scales unused, " if scheme.static_activations else ""
    return (f"FP8 checkpoint (quant_method {scheme.method!r}, {scheme.layout.value} scales{block}): its {weights} "
            f"float8 weights ({values} bytes as FP8) are held dequantized in {name}, {extra} bytes more than FP8 "
            f"({extra / 2 ** 30:.2f} GiB, over the whole model; tensor parallel: each rank its share); weights "
            f"only: {inputs}activations stay in {name} (no FP8 GEMMs; vLLM's W8A8 outputs differ slightly)")
