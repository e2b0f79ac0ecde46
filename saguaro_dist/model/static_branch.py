"""The per-forward context of a branch step built from device tensors alone, so a CUDA graph captures
it once per layout [U, Q] and replays it at every depth (model/cuda_graphs.py).

Same layout as BranchBatch (branch j of sequence u is query slot u * Q + j; its token at depth d is
private slot d * Q + j), but the prefix is read over the pool's whole capacity under a mask, and the
depth is a tensor, so which keys are visible and where this step's keys go are decided on the device.
A layer with a sliding window attends under a windowed mask, built once a forward."""
from __future__ import annotations

import torch

from saguaro_dist.model.attention import SDPA, AttentionKernel, MasksPerWindow, fold_heads, in_window, unfold_heads
from saguaro_dist.model.kv_cache import KVPool


def windowed(mask, keys, slot_depth, prefix_len, depth, window: int, group: int) -> torch.Tensor:
    """mask ([U, Q, capacity + D_cap * Q] bool) kept only within each query's sliding window, its rows
    repeated per grouped head: prefix key i (at position i) and private slot d * Q + j (at prefix_len + d,
    against the query's prefix_len + depth: d > depth - window)."""
    prefix = in_window(keys[None, None, :], (prefix_len + depth)[:, :, None], window)  # [U, Q, capacity]
    private = in_window(slot_depth, depth, window).expand(*prefix_len.shape, -1)        # [U, Q, D_cap * Q]
    return (mask & torch.cat([prefix, private], dim=-1)).repeat_interleave(group, dim=1).unsqueeze(1)


class StaticBranchBatch:
    """rows: [U] int64; prefix_len: [U, Q] int64; depth: [] int64; private_k/v: [layers, U, kv, D_cap * Q, D]."""

    def __init__(self, pool: KVPool, rows, prefix_len, depth, private_k, private_v, cos, signed_sin, group: int,
                 kernel: AttentionKernel = SDPA):
        self.dense = kernel.dense  # the model's (attention.attention_kernel)
        self.pool, self.rows, self.private = pool, rows, (private_k, private_v)
        self.q = prefix_len.shape[1]
        pos = (prefix_len + depth).clamp_max(cos.shape[0] - 1)
        self.cos, self.signed_sin = cos[pos].unsqueeze(2), signed_sin[pos].unsqueeze(2)  # [U, Q, 1, D]
        self.slots = depth * self.q + torch.arange(self.q, device=rows.device)       # [Q]: this step's slots
        keys = torch.arange(pool.capacity, device=rows.device)
        seen = keys[None, None, :] < prefix_len[:, :, None]                          # [U, Q, capacity]
        slot = torch.arange(private_k.shape[3], device=rows.device)
        own = (slot[None, :] % self.q == torch.arange(self.q, device=rows.device)[:, None]) & (slot // self.q <= depth)
        mask = torch.cat([seen, own.expand(len(rows), -1, -1)], dim=-1)              # [U, Q, capacity + D_cap * Q]
        self.mask = mask.repeat_interleave(group, dim=1).unsqueeze(1)                # [U, 1, Q * group, ...]
        # Positions: prefix key i at i, private slot d * Q + j at prefix_len + d (only a branch's own slots
        # are seen), the query at prefix_len + depth; the longest reach is capacity + D_cap - 1.
        self.reach = pool.capacity + private_k.shape[3] // self.q
        self.window_masks = MasksPerWindow(
            lambda window: windowed(mask, keys, slot // self.q, prefix_len, depth, window, group))

    def attend(self, layer: int, q, k, v, scale=None, window=None, sinks=None) -> torch.Tensor:
        """q: [U, Q, H, D]; k, v: [U, Q, kv, D] -> [U, Q, H * D]; scale: dense_attention's; window: the
        layer's sliding window (None, or one no query here reaches past: full attention)."""
        pk, pv = self.private[0][layer], self.private[1][layer]  # [U, kv, D_cap * Q, D]
        pk.index_copy_(2, self.slots, k.transpose(1, 2))
        pv.index_copy_(2, self.slots, v.transpose(1, 2))
        keys = torch.cat([self.pool.k[layer].index_select(0, self.rows), pk], dim=2)
        values = torch.cat([self.pool.v[layer].index_select(0, self.rows), pv], dim=2)
        mask = self.mask if window is None or self.reach <= window else self.window_masks(window)
        return unfold_heads(self.dense(fold_heads(q, keys.shape[1]), keys, values, mask, scale, sinks), self.q)
