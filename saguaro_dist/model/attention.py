"""Attention maths over stored KV, pure functions. Grouped-query heads are folded into the query axis
(q: [B, kv_heads, T * group, D]) so keys and values are never repeated per query head."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def fold_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, kv_heads, T * group, D]; row t * group + g is query head kv * group + g at t."""
    b, t, h, d = q.shape
    if h == kv_heads:  # no grouping: a transposed view, no copy (SDPA takes strided queries)
        return q.transpose(1, 2)
    return q.view(b, t, kv_heads, h // kv_heads, d).permute(0, 2, 1, 3, 4).reshape(b, kv_heads, -1, d)


def unfold_heads(o: torch.Tensor, t: int) -> torch.Tensor:
    """[B, kv_heads, T * group, D] -> [B, T, H * D]."""
    b, kv, tg, d = o.shape
    return o.view(b, kv, t, tg // t, d).permute(0, 2, 1, 3, 4).reshape(b, t, -1)


def dense_attention(q, k, v, mask, scale=None, sinks=None):
    """q: [B, kv, Tg, D]; k, v: [B, kv, S, D]; mask: [B, 1, Tg, S], float in q's dtype (added to the
    scores: 0 / -inf, additive_mask) or None (all). scale: the scores' factor (Granite's
    attention_multiplier), None for SDPA's 1/sqrt(D); SDPA applies it as transformers' call does. sinks:
    always None here (a model with sinks attends by sink_attention: attention_kernel)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def causal_attention(q, k, v, scale=None):
    """Prompts from position 0: q: [B, T, H, D]; k, v: [B, kv, T, D] -> [B, T, H * D]. SDPA's own causal
    kernel, no [T x S] mask built or read (CPU, T = 2048, 8 heads over 2: 36 ms against 134 ms masked,
    the same output). A padded row's real queries see only its real keys: padding comes after them."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, enable_gqa=True, scale=scale)
    return o.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


def softcapped_attention(q, k, v, mask, scale=None, sinks=None, *, softcap: float):
    """dense_attention's contract with the scores tanh-softcapped, cap * tanh(scores / cap), before the mask
    (Gemma 2's attn_logit_softcapping), which SDPA cannot do: spelled out as transformers' eager path does it,
    the scores in q's dtype, the softmax in fp32, cast back before the product with v. Static shapes: a CUDA
    graph captures it as it does SDPA. mask: additive, or bool (True: seen; StaticBranchBatch's) as SDPA takes."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores.div_(softcap).tanh_().mul_(softcap)  # in place: the same values as out of place
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill_(mask.logical_not(), float("-inf"))
    elif mask is not None:
        scores = scores.add_(mask)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def sink_attention(q, k, v, mask, scale=None, sinks=None):
    """dense_attention's contract plus gpt-oss's attention sinks: sinks [H] (this rank's heads), one learned logit
    a head that joins each query's softmax as an extra column and is then dropped, so a query may attend to
    nothing (its weights sum below 1). SDPA cannot add that column: spelled out as transformers' eager path
    does (scores in q's dtype, the row max subtracted, the softmax in that dtype, cast to v's). Static shapes
    (a CUDA graph could capture it). mask: additive, or bool (True: seen), as softcapped_attention's."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill_(mask.logical_not(), float("-inf"))
    elif mask is not None:
        scores = scores.add_(mask)
    b, kv, rows, _ = scores.shape  # fold_heads' rows: t * group + g is head kv * group + g
    group = sinks.shape[0] // kv
    column = sinks.view(1, kv, 1, group).expand(b, kv, rows // group, group).reshape(b, kv, rows, 1)
    logits = torch.cat([scores, column.to(scores.dtype)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink's column dropped
    return torch.matmul(probs.to(v.dtype), v)


@dataclass(frozen=True)
class AttentionKernel:
    """How one model's attention is computed, picked once when it is built (CausalLM.attention) and handed to
    every step's context, so a layer never says which. dense: dense_attention's contract; causal:
    causal_attention's, or None where the kernel has no mask-free causal form (prompts from position 0 then
    go through dense under a causal mask). A step context passes dense a layer's attention sinks (`sinks`,
    gpt-oss's; None for every other model, whose kernels take no more ops for it)."""
    dense: Callable
    causal: Callable | None


SDPA = AttentionKernel(dense_attention, causal_attention)  # every model without softcapped scores


def attention_kernel(softcap: float | None, sinks: bool = False) -> AttentionKernel:
    """SDPA's, or (a softcap given) softcapped_attention under it, or (sinks) sink_attention: no op added to
    models with neither."""
    if softcap is not None and sinks:  # no family has both; one kernel computes one of them
        raise ValueError("attention softcapping and attention sinks together are not supported")
    if sinks:
        return AttentionKernel(sink_attention, None)
    if softcap is None:
        return SDPA
    return AttentionKernel(functools.partial(softcapped_attention, softcap=softcap), None)


def additive_mask(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `seen`, -inf elsewhere, in the model's dtype. SDPA turns a bool mask into this on every
    call, so every layer; built once a forward it is the same mask (the same output, bit for bit) with
    one conversion a forward (CPU, per attention call: a verify's 5 queries 5-14% faster, a 2048-token
    chunk over 4096 keys 273 -> 168 ms)."""
    return torch.zeros(seen.shape, device=seen.device, dtype=dtype).masked_fill_(~seen, float("-inf"))


def causal_mask(pos: torch.Tensor, num_keys: int, group: int, dtype: torch.dtype,
                window: int | None = None) -> torch.Tensor:
    """[B, 1, T * group, num_keys] additive (additive_mask): the query at position pos[b, t] sees its own
    sequence's keys 0..pos[b, t] (only the last `window` of them when a window is given: in_window), its
    rows repeated per grouped head (fold_heads' layout). pos: [B, T]."""
    keys = torch.arange(num_keys, device=pos.device)[None, None, :]
    seen = keys <= pos[:, :, None]
    if window is not None:
        seen &= in_window(keys, pos[:, :, None], window)
    return additive_mask(seen.repeat_interleave(group, dim=1).unsqueeze(1), dtype)


def in_window(key_pos, query_pos, window: int):
    """Whether a key at key_pos lies within the sliding window of a query at query_pos (a causal key, at
    most query_pos): transformers' sliding_window_overlay, key > query - window, so a query sees itself and
    the window - 1 positions before it."""
    return key_pos > query_pos - window


class MasksPerWindow:
    """A forward step's attention masks, one per sliding window its layers ask for, each built by `build`
    when a layer first asks and shared by every later layer: never one per layer. Built on first use, so
    a step whose layers all attend in full (every model without a window) builds none."""

    def __init__(self, build):
        self._build, self._made = build, {}

    def __call__(self, window: int):
        mask = self._made.get(window)
        if mask is None:
            mask = self._made[window] = self._build(window)
        return mask
