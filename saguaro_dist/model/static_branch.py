"""The per-forward context of a branch step built from device tensors alone, so a CUDA graph captures
it once per layout [U, Q] and replays it at every depth (model/cuda_graphs.py).

Same layout as BranchBatch (branch j of sequence u is query slot u * Q + j; its token at depth d is
private slot d * Q + j), but the prefix is read over the pool's whole capacity under a mask, and the
depth is a tensor, so which keys are visible and where this step's keys go are decided on the device."""
from __future__ import annotations

import torch

from saguaro_dist.model.attention import dense_attention, fold_heads, unfold_heads
from saguaro_dist.model.kv_cache import KVPool


class StaticBranchBatch:
    """rows: [U] int64; prefix_len: [U, Q] int64; depth: [] int64; private_k/v: [layers, U, kv, D_cap * Q, D]."""

    def __init__(self, pool: KVPool, rows, prefix_len, depth, private_k, private_v, cos, signed_sin, group: int):
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

    def attend(self, layer: int, q, k, v, scale=None) -> torch.Tensor:
        """q: [U, Q, H, D]; k, v: [U, Q, kv, D] -> [U, Q, H * D]; scale: dense_attention's."""
        pk, pv = self.private[0][layer], self.private[1][layer]  # [U, kv, D_cap * Q, D]
        pk.index_copy_(2, self.slots, k.transpose(1, 2))
        pv.index_copy_(2, self.slots, v.transpose(1, 2))
        keys = torch.cat([self.pool.k[layer].index_select(0, self.rows), pk], dim=2)
        values = torch.cat([self.pool.v[layer].index_select(0, self.rows), pv], dim=2)
        return unfold_heads(dense_attention(fold_heads(q, keys.shape[1]), keys, values, self.mask, scale), self.q)
