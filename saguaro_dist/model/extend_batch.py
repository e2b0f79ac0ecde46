"""The per-forward context of `extend`: sequences of different lengths padded into one batch.

A layer with a sliding window (hf_config.ModelConfig.layer_windows) passes it to `attend`: once the keys
reach past it, that layer attends under a windowed mask, built once a forward; every key stays stored."""
from __future__ import annotations

import torch

from saguaro_dist.model.attention import SDPA, AttentionKernel, MasksPerWindow, causal_mask, fold_heads, unfold_heads
from saguaro_dist.model.kv_cache import KVPool, rows_index


class ExtendBatch:
    """Appends T_b new tokens to each sequence b (stored lengths L_b): padded to T = max T_b, keys 0..S-1."""

    def __init__(self, pool: KVPool, rows: list[int], starts: list[int], lens: list[int], cos, signed_sin, group: int,
                 kernel: AttentionKernel = SDPA):
        dev = pool.k.device
        self.dense, self.causal = kernel.dense, kernel.causal  # the model's (attention.attention_kernel)
        self.pool, self.b, self.t = pool, len(rows), max(lens)
        self.s = max(s + n for s, n in zip(starts, lens))
        self.rows = rows_index(rows, dev)
        pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(self.t, device=dev)  # [B, T]
        pos_c = pos.clamp_max(cos.shape[0] - 1)  # padding may run past the table; its output is dropped
        self.cos, self.signed_sin = cos[pos_c].unsqueeze(2), signed_sin[pos_c].unsqueeze(2)  # [B, T, 1, D]
        # whole prompts: the causal kernel, no mask (a kernel without one: the causal mask)
        self.from_start = self.causal is not None and self.t > 1 and not any(starts)
        self.mask = causal_mask(pos, self.s, group, pool.k.dtype) if (self.b, self.t) != (1, 1) and not self.from_start else None
        # A padding query may sit past S (a short row beside a long one): at S - 1 its window keeps a key, so
        # no row of the windowed mask is all -inf (a NaN row, if dropped after); real queries are all below S.
        self.window_masks = MasksPerWindow(
            lambda window: causal_mask(pos.clamp_max(self.s - 1), self.s, group, pool.k.dtype, window))
        # Consecutive rows (every batch the engine builds in order): all layers' keys as one view.
        self.span = pool.span(self.rows, self.s) if isinstance(self.rows, slice) else None
        self._plan_writes(rows, starts, lens, pos)

    def _plan_writes(self, rows, starts, lens, pos):
        if self.b == 1:  # where this forward's keys and values go, in every layer: [layers, kv, T, D]
            at = slice(starts[0], starts[0] + lens[0])
            self.write_to = (self.span[0][:, 0, :, at], self.span[1][:, 0, :, at])
            return
        row_t = torch.tensor(rows, device=pos.device)[:, None].expand(-1, self.t).reshape(-1)
        if all(n == self.t for n in lens):  # every token real (decode, verify): no selection at all
            self.write_rows, self.write_pos, self.write_sel = row_t, pos.reshape(-1), None
            return
        # Mixed lengths: only real tokens are stored. The selection is built on the host (a boolean
        # mask would make the device sync to count it).
        sel = torch.tensor([i * self.t + j for i, n in enumerate(lens) for j in range(n)], device=pos.device)
        self.write_rows, self.write_pos, self.write_sel = row_t[sel], pos.reshape(-1)[sel], sel  # [n] each

    def _store(self, which: int, layer: int, x: torch.Tensor):
        """x: [B, T, kv, D] new keys (which = 0) or values (1) of one layer."""
        if self.b == 1:
            self.write_to[which][layer].copy_(x[0].transpose(0, 1))
            return
        flat = x.reshape(-1, *x.shape[2:])
        cache = (self.pool.k, self.pool.v)[which][layer]
        cache[self.write_rows, :, self.write_pos] = flat if self.write_sel is None else flat[self.write_sel]

    def _stored(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values 0..S-1, the new ones included: [B, kv, S, D] each."""
        if self.span is None:  # scattered rows: a gather, after the store
            return self.pool.view(layer, self.rows, self.s)
        return self.span[0][layer], self.span[1][layer]

    def attend(self, layer: int, q, k, v, scale=None, window=None, sinks=None) -> torch.Tensor:
        """q: [B, T, H, D]; k, v: [B, T, kv, D] -> [B, T, H * D]; scale: dense_attention's; window: this
        layer's sliding window (None: full attention). Keys 0..S-1 all within it (S <= window): the same."""
        self._store(0, layer, k)
        self._store(1, layer, v)
        kc, vc = self._stored(layer)
        if window is not None and self.s > window:
            mask = self.window_masks(window)
        elif self.from_start:
            return self.causal(q, kc, vc, scale)
        else:
            mask = self.mask
        return unfold_heads(self.dense(fold_heads(q, kc.shape[1]), kc, vc, mask, scale, sinks), self.t)
