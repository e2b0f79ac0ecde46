"""Branch decode: many private paths hanging off the stored prefixes of a few sequences.

Branches of one sequence are laid out as extra query rows of that sequence (its prefix KV is read once
for all of them); each branch's private KV lives in the BranchState, slot depth * Q + j."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro_dist.model.attention import additive_mask, dense_attention, fold_heads, unfold_heads
from saguaro_dist.model.kv_cache import KVPool, rows_index


@dataclass
class BranchState:
    seq_ids: list                 # the sequence of each branch, in the caller's order
    rows: list[int]               # [U] pool row of each distinct sequence
    prefix_len: torch.Tensor      # [U, Q] int64; padding slots hold 0
    bias: torch.Tensor | None     # [U, 1, Q * group, P + D_cap * Q] model dtype: 0 where a branch sees a key, else -inf
    out_index: torch.Tensor       # [N] int64: branch i's slot u * Q + j in the [U, Q] layout
    private_k: torch.Tensor       # [layers, U, kv_heads, D_cap * Q, head_dim]
    private_v: torch.Tensor       # [layers, U, kv_heads, D_cap * Q, head_dim]
    depth: int = 0                # tokens already on every private path
    max_prefix_len: int = 0       # max of prefix_len, kept on the host (no device sync per step)
    graph_key: tuple | None = None  # the CUDA-graph layout whose buffers hold private_k/v (bias unused); None: eager

    @property
    def num_branches(self) -> int:
        return len(self.seq_ids)


def group_branches(seq_rows: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Distinct rows (in order of first use) and each branch's (u, j): sequence slot and rank within it."""
    slot: dict[int, int] = {}
    counts: list[int] = []
    uj = []
    for row in seq_rows:
        u = slot.setdefault(row, len(slot))
        if u == len(counts):
            counts.append(0)
        uj.append((u, counts[u]))
        counts[u] += 1
    return list(slot), uj


def new_branch_state(seq_ids, seq_rows, prefix_lens, group: int, pool: KVPool, depth_cap: int = 8) -> BranchState:
    rows, uj = group_branches(seq_rows)
    dev = pool.k.device
    u_count, q = len(rows), 1 + max(j for _, j in uj)
    u_idx = torch.tensor([u for u, _ in uj], device=dev)
    j_idx = torch.tensor([j for _, j in uj], device=dev)
    plen = torch.zeros(u_count, q, dtype=torch.long, device=dev)
    plen[u_idx, j_idx] = torch.tensor(prefix_lens, device=dev)
    keys = torch.arange(max(prefix_lens), device=dev)
    seen = (keys[None, None, :] < plen[:, :, None]).repeat_interleave(group, dim=1).unsqueeze(1)
    bias = torch.cat([additive_mask(seen, pool.k.dtype), private_bias(u_count, q, group, depth_cap, pool.k)], dim=-1)
    layers, _, kv, _, hd = pool.k.shape
    priv = (layers, u_count, kv, depth_cap * q, hd)
    return BranchState(list(seq_ids), rows, plen, bias, u_idx * q + j_idx,
                       pool.k.new_zeros(priv), pool.v.new_zeros(priv), max_prefix_len=max(prefix_lens))


def private_bias(u_count: int, q: int, group: int, depth: int, like: torch.Tensor) -> torch.Tensor:
    """[U, 1, Q * group, depth * Q]: private slot d * Q + j' is visible to branch j iff j' == j."""
    own = torch.eye(q, dtype=torch.bool, device=like.device).repeat_interleave(group, dim=0).repeat(1, depth)
    return additive_mask(own, like.dtype).expand(u_count, 1, -1, -1)


def grow_private(state: BranchState, group: int):
    """Double the private depth capacity (amortised: once per doubling, never per step)."""
    k, v = state.private_k, state.private_v
    u_count, q = state.prefix_len.shape
    shape = list(k.shape)
    shape[3] *= 2
    state.private_k, state.private_v = k.new_zeros(shape), v.new_zeros(shape)
    state.private_k[:, :, :, :k.shape[3]] = k
    state.private_v[:, :, :, :v.shape[3]] = v
    extra = private_bias(u_count, q, group, k.shape[3] // q, k)
    state.bias = torch.cat([state.bias, extra], dim=-1)


class BranchBatch:
    """The per-forward context of one branch step: one new token per branch slot, input layout [U, Q]."""

    def __init__(self, state: BranchState, pool: KVPool, cos, signed_sin, group: int):
        self.state, self.pool = state, pool
        u_count, self.q = state.prefix_len.shape
        if (state.depth + 1) * self.q > state.private_k.shape[3]:
            grow_private(state, group)
        pos = (state.prefix_len + state.depth).clamp_max(cos.shape[0] - 1)
        self.cos, self.signed_sin = cos[pos].unsqueeze(2), signed_sin[pos].unsqueeze(2)  # [U, Q, 1, D]
        self.p = state.bias.shape[-1] - state.private_k.shape[3]  # longest prefix
        self.bias = state.bias[..., :self.p + (state.depth + 1) * self.q]  # a view: built once per state
        # Every layer's slices taken once per forward (a layer then indexes them: one op, not four).
        # The prefix is read-only here, so scattered rows may be gathered before any store.
        rows = rows_index(state.rows, pool.k.device)
        lo, hi = state.depth * self.q, (state.depth + 1) * self.q
        self.prefix = (pool.k[:, rows, :, :self.p], pool.v[:, rows, :, :self.p])   # [layers, U, kv, P, D]
        self.write_to = (state.private_k[:, :, :, lo:hi], state.private_v[:, :, :, lo:hi])  # [layers, U, kv, Q, D]
        self.private = (state.private_k[:, :, :, :hi], state.private_v[:, :, :, :hi])  # this step's included

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        """q: [U, Q, H, D]; k, v: [U, Q, kv, D] -> [U, Q, H * D]."""
        self.write_to[0][layer].copy_(k.transpose(1, 2))
        self.write_to[1][layer].copy_(v.transpose(1, 2))
        kp, vp = self.prefix[0][layer], self.prefix[1][layer]
        # One fused attention over [prefix ‖ private] keys: copying the prefix costs less than the dozen
        # small ops of two partial softmaxes (draft branch step, P = 100: 17 vs 33 us a layer; equal at
        # P = 1500 and at 8 sequences; docs/architecture.md).
        keys = torch.cat([kp, self.private[0][layer]], dim=2)
        values = torch.cat([vp, self.private[1][layer]], dim=2)
        return unfold_heads(dense_attention(fold_heads(q, kp.shape[1]), keys, values, self.bias), self.q)
