"""The per-forward context of a uniform step (every sequence adds T tokens: decode, verify) built from
device tensors alone, so a CUDA graph can capture the whole forward and replay it with new inputs.

Unlike ExtendBatch it attends over the pool's whole capacity under a mask (a fixed key length) and
gathers each sequence's row by index (rows change between replays; a slice's view would not). A layer
with a sliding window attends under a windowed mask, built once a forward when the capacity passes it."""
from __future__ import annotations

import torch

from saguaro_dist.model.attention import SDPA, AttentionKernel, MasksPerWindow, causal_mask, fold_heads, unfold_heads
from saguaro_dist.model.kv_cache import KVPool


class StaticBatch:
    """rows: [B] int64 pool rows; pos: [B, T] int64 positions of the new tokens (consecutive per row)."""

    def __init__(self, pool: KVPool, rows: torch.Tensor, pos: torch.Tensor, cos, signed_sin, group: int,
                 kernel: AttentionKernel = SDPA):
        self.dense = kernel.dense  # the model's (attention.attention_kernel)
        self.pool, self.rows, self.t = pool, rows, pos.shape[1]
        pos_c = pos.clamp_max(cos.shape[0] - 1)  # a padding row may run past the table; its output is dropped
        self.cos, self.signed_sin = cos[pos_c].unsqueeze(2), signed_sin[pos_c].unsqueeze(2)  # [B, T, 1, D]
        # Over the whole capacity: keys past a query's position (stale or padding) are never seen.
        self.mask = causal_mask(pos, pool.capacity, group, pool.k.dtype)  # [B, 1, T * group, capacity]
        self.window_masks = MasksPerWindow(lambda window: causal_mask(pos, pool.capacity, group, pool.k.dtype, window))
        self.write_rows = rows[:, None].expand(-1, self.t).reshape(-1)  # [B * T]
        self.write_pos = pos.reshape(-1)                                # [B * T]

    def attend(self, layer: int, q, k, v, scale=None, window=None, sinks=None) -> torch.Tensor:
        """q: [B, T, H, D]; k, v: [B, T, kv, D] -> [B, T, H * D]; scale: dense_attention's; window: the
        layer's sliding window (None, or one the whole capacity fits in: full attention)."""
        kc, vc = self.pool.k[layer], self.pool.v[layer]  # [rows, kv, capacity, D]
        kc[self.write_rows, :, self.write_pos] = k.reshape(-1, *k.shape[2:])
        vc[self.write_rows, :, self.write_pos] = v.reshape(-1, *v.shape[2:])
        keys, values = kc.index_select(0, self.rows), vc.index_select(0, self.rows)  # [B, kv, capacity, D]
        mask = self.mask if window is None or self.pool.capacity <= window else self.window_masks(window)
        return unfold_heads(self.dense(fold_heads(q, keys.shape[1]), keys, values, mask, scale, sinks), self.t)
