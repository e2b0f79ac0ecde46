"""MXFP4 expert weights (gpt-oss's checkpoints: quantization_config quant_method "mxfp4") dequantized on load to
the model's dtype, value for value as transformers 5.25's integrations/mxfp4.py convert_moe_packed_tensors does
(tests/test_model_gpt_oss.py checks it bit for bit). The format (OCP microscaling): each byte of `*_blocks`
packs two FP4 (E2M1) codes, the low nibble first; every 32 values (16 bytes) share one `*_scales` byte, an E8M0
exponent biased by 127. blocks [..., rows, G, 16] uint8, scales [..., rows, G] uint8 -> [..., rows, G * 32]: a
weight stored rows (output features) by columns (input features), as nn.Linear keeps it."""
from __future__ import annotations

import torch

# The 16 E2M1 codes' values: sign bit 3, then exponent and mantissa (transformers' FP4_VALUES, OCP MX spec)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_BYTES = 16  # 32 FP4 values share one scale
SCALE_BIAS = 127


def check_packed(name: str, blocks_shape, scales_shape) -> None:
    """A blocks / scales pair that cannot be one MXFP4 tensor is refused, naming it."""
    blocks_shape, scales_shape = tuple(blocks_shape), tuple(scales_shape)
    if len(blocks_shape) < 2 or blocks_shape[-1] != BLOCK_BYTES or blocks_shape[:-1] != scales_shape:
        raise ValueError(f"MXFP4 tensor {name!r}: blocks {blocks_shape} and scales {scales_shape} must be "
                         f"[..., G, {BLOCK_BYTES}] uint8 and [..., G] (32 values a scale)")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] in dtype: each code's value (a table
    in dtype) times 2 ** (scale - 127) by torch.ldexp, as transformers does (its product rounded once to dtype)."""
    table = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).int()  # low nibble first: [..., G, 32]
    exponents = (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1)
    return torch.ldexp(table[codes], exponents).to(dtype).flatten(-2)


def pack(weight: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse for values already on the grid: weight [..., G * 32] whose every value is an FP4 value times
    2 ** exponents[..., G] -> (blocks, scales) uint8. What a test writes a checkpoint with; not a quantizer."""
    grouped = weight.reshape(*weight.shape[:-1], -1, 32)
    unscaled = torch.ldexp(grouped.float(), -exponents.to(torch.int32).unsqueeze(-1))
    table = torch.tensor(FP4_VALUES)
    codes = (unscaled.unsqueeze(-1) == table).int().argmax(-1)  # +0.0 and -0.0 both code 0: equal values
    if not torch.equal(table[codes], unscaled):
        raise ValueError("pack: a value is not an FP4 value times its block's power of two")
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents.to(torch.int32) + SCALE_BIAS).to(torch.uint8)
