"""Attention maths over stored KV, pure functions. Grouped-query heads are folded into the query axis
(q: [B, kv_heads, T * group, D]) so keys and values are never repeated per query head."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fold_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, kv_heads, T * group, D]; row t * group + g is query head kv * group + g at t."""
    b, t, h, d = q.shape
    return q.view(b, t, kv_heads, h // kv_heads, d).permute(0, 2, 1, 3, 4).reshape(b, kv_heads, -1, d)


def unfold_heads(o: torch.Tensor, t: int) -> torch.Tensor:
    """[B, kv_heads, T * group, D] -> [B, T, H * D]."""
    b, kv, tg, d = o.shape
    return o.view(b, kv, t, tg // t, d).permute(0, 2, 1, 3, 4).reshape(b, t, -1)


def dense_attention(q, k, v, mask):
    """q: [B, kv, Tg, D]; k, v: [B, kv, S, D]; mask: [B, 1, Tg, S] bool (True = attend) or None (all)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def two_part_attention(q, k1, v1, k2, v2, bias):
    """One softmax over keys [k1 ‖ k2] without concatenating them (k1 is shared storage, never copied).
    q: [U, kv, Qg, D]; k1, v1: [U, kv, P, D]; k2, v2: [U, kv, R, D]; bias: [U, 1, Qg, P + R] (0 / -inf)."""
    scale = q.shape[-1] ** -0.5
    scores = torch.cat([q @ k1.transpose(-1, -2), q @ k2.transpose(-1, -2)], dim=-1)
    probs = torch.softmax(scores.float() * scale + bias, dim=-1).to(q.dtype)
    p = k1.shape[2]
    return probs[..., :p] @ v1 + probs[..., p:] @ v2
