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


def inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    base = default_inv_freq(head_dim, rope["rope_theta"])
    if rope["rope_type"] == "llama3":
        return llama3_inv_freq(base, rope)
    if rope["rope_type"] == "linear":
        return base / rope["factor"]
    return base


def rope_tables(head_dim: int, rope: dict, max_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed_sin: [max_len, head_dim] each, computed in fp32 then cast like transformers does.

    signed_sin is sin with its first half negated: rotate_half(x) * sin == roll(x, D/2) * signed_sin,
    bit for bit (negating a factor only flips the product's sign), in one op where rotate_half took four."""
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq(head_dim, rope)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    sin, half = emb.sin(), head_dim // 2
    signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return emb.cos().to(device=device, dtype=dtype), signed_sin.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]. x: [B, T, H, D]; cos, signed_sin: [B, T, 1, D]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
