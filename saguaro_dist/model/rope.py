"""Rotary position embedding: pure functions, matching transformers' numerics (fp32 tables, rotate-half)."""
from __future__ import annotations

import math

import torch


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp in between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """The YaRN paper's Eq. 21 (transformers' yarn_get_mscale): 1 where the factor does not stretch."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(rope: dict) -> float:
    """The scale transformers multiplies cos and sin by: 1 but for yarn, whose `attention_factor` is given, or
    DeepSeek's mscale / mscale_all_dim ratio when both are set, else 0.1 ln(factor) + 1; and longrope's
    (phi3_config resolves it)."""
    if rope["rope_type"] == "longrope":
        return rope["attention_factor"]
    if rope["rope_type"] != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return rope["attention_factor"]
    factor, mscale, mscale_all_dim = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_correction_range(head_dim: int, rope: dict) -> tuple[float, float]:
    """The frequency indices between which yarn ramps from extrapolation (fast, beta_fast rotations over the
    original context) to interpolation (slow, beta_slow); floored / ceiled unless `truncate` is false."""
    base, old_len = rope["rope_theta"], rope["original_max_position_embeddings"]

    def index_of(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = index_of(rope.get("beta_fast") or 32), index_of(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def yarn_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters, op for op): frequencies divided by `factor` (interpolated)
    below the correction range, kept (extrapolated) above it, a linear ramp between."""
    pos_freqs = rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (rope["factor"] * pos_freqs)
    low, high = _yarn_correction_range(head_dim, rope)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    return interpolated * (1 - kept) + extrapolated * kept


def longrope_short_inv_freq(dim: int, rope: dict) -> torch.Tensor:
    """LongRoPE's frequencies for a sequence within original_max_position_embeddings (transformers'
    _compute_longrope_parameters, op for op): each divided by its short_factor."""
    ext_factors = torch.tensor(rope["short_factor"], dtype=torch.float32)
    return 1.0 / (ext_factors * rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """head_dim: the rotated width (a partial rotary factor's share of each head)."""
    if rope["rope_type"] == "longrope":
        return longrope_short_inv_freq(head_dim, rope)
    if rope["rope_type"] == "yarn":
        return yarn_inv_freq(head_dim, rope)
    base = default_inv_freq(head_dim, rope["rope_theta"])
    if rope["rope_type"] == "llama3":
        return llama3_inv_freq(base, rope)
    if rope["rope_type"] == "linear":
        return base / rope["factor"]
    return base


def rope_tables(head_dim: int, rope: dict, max_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed_sin: [max_len, head_dim] each, computed in fp32, scaled by the attention factor (yarn's; 1
    otherwise, an exact no-op) then cast, like transformers does.

    signed_sin is sin with its first half negated: rotate_half(x) * sin == roll(x, D/2) * signed_sin,
    bit for bit (negating a factor only flips the product's sign), in one op where rotate_half took four."""
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq(head_dim, rope)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = attention_factor(rope)
    sin, half = emb.sin() * scale, head_dim // 2
    signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return (emb.cos() * scale).to(device=device, dtype=dtype), signed_sin.to(device=device, dtype=dtype)


def model_rope_tables(head_dim: int, rope: dict, local_rope: dict | None, max_len: int, device,
                      dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's cos, signed_sin: `rope`'s, or with a local rope (Gemma 3's sliding layers') both side by side
    on the last axis, [global | local]: [max_len, 2 * head_dim], so every batch context gathers both rows at
    once and each layer reads its half (layers.TwoRopeAttention)."""
    cos, signed_sin = rope_tables(head_dim, rope, max_len, device, dtype)
    if local_rope is None:
        return cos, signed_sin
    local_cos, local_sin = rope_tables(head_dim, local_rope, max_len, device, dtype)
    return torch.cat([cos, local_cos], dim=-1), torch.cat([signed_sin, local_sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]. x: [B, T, H, D]; cos, signed_sin: [B, T, 1, D]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The rope on each head's first R dims, the rest passed through (transformers' Phi3 apply_rotary_pos_emb).
    x: [B, T, H, D]; cos, signed_sin: [B, T, 1, R], R < D."""
    rotary = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :rotary], cos, signed_sin), x[..., rotary:]], dim=-1)


def no_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """A NoPE layer's (SmolLM3's no_rope_layers 0): q and k as they are, no position encoding."""
    return x
