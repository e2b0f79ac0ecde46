"""Branch decode: many private paths hanging off the stored prefixes of a few sequences.

Branches of one sequence are laid out as extra query rows of that sequence (its prefix KV is read in
place, once, for all of them); each branch's private KV lives in the BranchState, slot depth * Q + j."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro_dist.model.attention import fold_heads, two_part_attention, unfold_heads
from saguaro_dist.model.kv_cache import KVPool, rows_index


@dataclass
class BranchState:
    seq_ids: list                 # the sequence of each branch, in the caller's order
    rows: list[int]               # [U] pool row of each distinct sequence
    prefix_len: torch.Tensor      # [U, Q] int64; padding slots hold 0
    bias: torch.Tensor            # [U, 1, Q * group, P + D_cap * Q] float32: 0 where a branch sees a key, else -inf
    out_index: torch.Tensor       # [N] int64: branch i's slot u * Q + j in the [U, Q] layout
    private_k: torch.Tensor       # [layers, U, kv_heads, D_cap * Q, head_dim]
    private_v: torch.Tensor       # [layers, U, kv_heads, D_cap * Q, head_dim]
    depth: int = 0                # tokens already on every private path

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
    bias = torch.cat([_bias(seen), private_bias(u_count, q, group, depth_cap, dev)], dim=-1)
    layers, _, kv, _, hd = pool.k.shape
    priv = (layers, u_count, kv, depth_cap * q, hd)
    return BranchState(list(seq_ids), rows, plen, bias, u_idx * q + j_idx,
                       pool.k.new_zeros(priv), pool.v.new_zeros(priv))


def _bias(seen: torch.Tensor) -> torch.Tensor:
    return torch.zeros(seen.shape, device=seen.device).masked_fill_(~seen, float("-inf"))


def private_bias(u_count: int, q: int, group: int, depth: int, device) -> torch.Tensor:
    """[U, 1, Q * group, depth * Q]: private slot d * Q + j' is visible to branch j iff j' == j."""
    own = torch.eye(q, dtype=torch.bool, device=device).repeat_interleave(group, dim=0).repeat(1, depth)
    return _bias(own).expand(u_count, 1, -1, -1)


def grow_private(state: BranchState, group: int):
    """Double the private depth capacity (amortised: once per doubling, never per step)."""
    k, v = state.private_k, state.private_v
    u_count, q = state.prefix_len.shape
    shape = list(k.shape)
    shape[3] *= 2
    state.private_k, state.private_v = k.new_zeros(shape), v.new_zeros(shape)
    state.private_k[:, :, :, :k.shape[3]] = k
    state.private_v[:, :, :, :v.shape[3]] = v
    extra = private_bias(u_count, q, group, k.shape[3] // q, k.device)
    state.bias = torch.cat([state.bias, extra], dim=-1)


class BranchBatch:
    """The per-forward context of one branch step: one new token per branch slot, input layout [U, Q]."""

    def __init__(self, state: BranchState, pool: KVPool, cos, sin, group: int):
        self.state, self.pool = state, pool
        u_count, self.q = state.prefix_len.shape
        if (state.depth + 1) * self.q > state.private_k.shape[3]:
            grow_private(state, group)
        pos = (state.prefix_len + state.depth).clamp_max(cos.shape[0] - 1)
        self.cos, self.sin = cos[pos].unsqueeze(2), sin[pos].unsqueeze(2)  # [U, Q, 1, D]
        self.rows = rows_index(state.rows, pool.k.device)
        self.p = state.bias.shape[-1] - state.private_k.shape[3]  # longest prefix
        self.bias = state.bias[..., :self.p + (state.depth + 1) * self.q]  # a view: built once per state

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        """q: [U, Q, H, D]; k, v: [U, Q, kv, D] -> [U, Q, H * D]."""
        st, lo, hi = self.state, self.state.depth * self.q, (self.state.depth + 1) * self.q
        st.private_k[layer, :, :, lo:hi] = k.transpose(1, 2)
        st.private_v[layer, :, :, lo:hi] = v.transpose(1, 2)
        kp, vp = self.pool.view(layer, self.rows, self.p)
        o = two_part_attention(fold_heads(q, kp.shape[1]), kp, vp,
                               st.private_k[layer, :, :, :hi], st.private_v[layer, :, :, :hi], self.bias)
        return unfold_heads(o, self.q)
