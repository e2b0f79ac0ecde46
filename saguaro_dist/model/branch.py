"""Branch decode: many private paths hanging off the stored prefixes of a few sequences.

Branches of one sequence are laid out as extra query rows of that sequence (its prefix KV is read once
for all of them); each branch's private KV lives in the BranchState, slot depth * Q + j. An eager state
holds one buffer per K and V, its sequences' prefix KV followed by the private slots (`keys`, `values`):
every step attends over a view of it, where it once gathered the prefix and concatenated it to the
private KV in every layer (demo draft, b = 1, 12 branches: docs/benchmark-history.md, session 36). That buffer
is the pool itself when the rows are consecutive (the private slots in the rows' unused tails), else a
copy (`_windows`). Once the decode is over (`end_branches`) only the private slots, which adoption reads,
are kept. A layer with a sliding window attends under the step's bias with the keys past each branch's
window masked too (window_bias, built once a step: the window moves with the depth)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from saguaro_dist.model.attention import (SDPA, AttentionKernel, MasksPerWindow, additive_mask, fold_heads, in_window,
                                          unfold_heads)
from saguaro_dist.model.kv_cache import KVPool, rows_index


@dataclass
class BranchState:
    seq_ids: list                 # the sequence of each branch, in the caller's order
    rows: list[int]               # [U] pool row of each distinct sequence
    prefix_len: torch.Tensor      # [U, Q] int64; padding slots hold 0
    bias: torch.Tensor | None     # [U, 1, Q * group, P + D_cap * Q] model dtype: 0 where a branch sees a key, else -inf
    out_index: torch.Tensor       # [N] int64: branch i's slot u * Q + j in the [U, Q] layout
    private_k: torch.Tensor       # [layers, U, kv_heads, D_cap * Q, head_dim] (eager: a view into keys)
    private_v: torch.Tensor       # [layers, U, kv_heads, D_cap * Q, head_dim] (eager: a view into values)
    depth: int = 0                # tokens already on every private path
    max_prefix_len: int = 0       # max of prefix_len, kept on the host (no device sync per step)
    graph_key: tuple | None = None  # the CUDA-graph layout whose buffers hold private_k/v (bias unused); None: eager
    keys: torch.Tensor | None = None    # eager: [layers, U, kv_heads, P + D_cap * Q, head_dim], the prefix, then private_k
    values: torch.Tensor | None = None  # eager: the same for V
    dense: bool = False           # every [U, Q] slot holds a branch, in the caller's order (out_index = arange)

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


def new_branch_state(seq_ids, seq_rows, prefix_lens, group: int, pool: KVPool, depth_cap: int = 8,
                     stored_len: int = 0) -> BranchState:
    """stored_len: the longest stored length among the rows; the private slots never overwrite it."""
    rows, uj = group_branches(seq_rows)
    dev, p = pool.k.device, max(prefix_lens)
    u_count, q = len(rows), 1 + max(j for _, j in uj)
    u_idx = torch.tensor([u for u, _ in uj], device=dev)
    j_idx = torch.tensor([j for _, j in uj], device=dev)
    plen = torch.zeros(u_count, q, dtype=torch.long, device=dev)
    plen[u_idx, j_idx] = torch.tensor(prefix_lens, device=dev)
    keys, values = _windows(pool, rows_index(rows, dev), u_count, p, stored_len, depth_cap * q)
    w = keys.shape[3] - depth_cap * q  # the window's prefix: p, or the rows' stored length when in the pool
    bias = branch_bias(plen, w, group, depth_cap, pool.k.dtype)
    dense = u_count * q == len(uj) and all(u * q + j == i for i, (u, j) in enumerate(uj))
    return BranchState(list(seq_ids), rows, plen, bias, u_idx * q + j_idx, keys[:, :, :, w:], values[:, :, :, w:],
                       max_prefix_len=p, keys=keys, values=values, dense=dense)


def _windows(pool: KVPool, rows, u_count: int, p: int, stored_len: int, private: int):
    """keys, values [layers, U, kv, w + private, D]: the rows' first w positions, then `private` slots.

    Consecutive rows with room: a view of the pool itself, w = max(p, stored_len), the private slots in
    each row's unused tail (no copy, no allocation: a demo-draft tree's start paid 0.15-0.29 ms for them).
    The tail holds stale KV or the pool's zeros, finite either way: a masked key still enters the
    product, and only a NaN or inf there (0 x NaN is NaN) would leak through the mask.
    Otherwise a copy, w = p: the rows gathered, then zeroed slots. On CUDA only within the pool's current
    capacity: widening it there drops every captured graph (model/cuda_graphs.py)."""
    w = max(p, stored_len)
    room = pool.max_len if pool.k.device.type == "cpu" else pool.capacity
    if isinstance(rows, slice) and w + private <= room:
        pool.reserve(w + private)
        return pool.k[:, rows, :, :w + private], pool.v[:, rows, :, :w + private]
    return tuple(_window(stored, rows, u_count, p, private) for stored in (pool.k, pool.v))


def _window(stored: torch.Tensor, rows, u_count: int, p: int, private: int) -> torch.Tensor:
    """[layers, U, kv, p + private, D]: the U rows' (rows_index) first p positions, then `private` zeroed
    slots (zeros, not garbage: a masked key still enters the product, and 0 x NaN is NaN)."""
    layers, _, kv, _, hd = stored.shape
    window = stored.new_zeros((layers, u_count, kv, p + private, hd))
    window[:, :, :, :p] = stored[:, rows, :, :p]
    return window


def end_branches(state: BranchState) -> None:
    """The decode is over: an eager state keeps only its private KV (what adoption reads), cloned: a copy
    of its sequences' prefixes is not held between rounds (a draft keeps the last tree for the next hit),
    and slots in the pool's tails are overwritten by the sequences' next tokens."""
    if state.keys is None:
        return
    used = state.depth * state.prefix_len.shape[1]
    state.private_k, state.private_v = state.private_k[:, :, :, :used].clone(), state.private_v[:, :, :, :used].clone()
    state.keys = state.values = None


def branch_bias(plen: torch.Tensor, w: int, group: int, depth: int, dtype: torch.dtype) -> torch.Tensor:
    """[U, 1, Q * group, w + depth * Q] additive: branch (u, j) sees window key i < plen[u, j], then its own
    private slots (private_bias). Written into one buffer: fewer ops than a mask per part and a cat."""
    u_count, q = plen.shape
    bias = torch.full((u_count, 1, q * group, w + depth * q), float("-inf"), dtype=dtype, device=plen.device)
    seen = torch.arange(w, device=plen.device) < plen[:, :, None]  # [U, Q, w]
    bias[:, 0, :, :w].masked_fill_(seen if group == 1 else seen.repeat_interleave(group, dim=1), 0.0)
    bias[:, 0, :, w:] = _own_slots(q, group, depth, dtype, plen.device)
    return bias


def private_bias(u_count: int, q: int, group: int, depth: int, like: torch.Tensor) -> torch.Tensor:
    """[U, 1, Q * group, depth * Q]: private slot d * Q + j' is visible to branch j iff j' == j."""
    return _own_slots(q, group, depth, like.dtype, like.device).expand(u_count, 1, -1, -1)


@functools.lru_cache(maxsize=64)
def _own_slots(q: int, group: int, depth: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """private_bias' [Q * group, depth * Q] pattern; the same for every tree of one width, so built once
    (callers only read it)."""
    own = torch.eye(q, dtype=torch.bool, device=device).repeat_interleave(group, dim=0).repeat(1, depth)
    return additive_mask(own, dtype)


def window_bias(bias: torch.Tensor, plen: torch.Tensor, depth: int, p: int, group: int, window: int) -> torch.Tensor:
    """A step's bias [U, 1, Q * group, p + (depth + 1) * Q] with -inf also on the keys past each branch's
    sliding window: window key i (at position i) and private slot d * Q + j (at plen + d), against the
    branch's query at plen + depth (in_window)."""
    q, dev = plen.shape[1], plen.device
    prefix = in_window(torch.arange(p, device=dev)[None, None, :], (plen + depth)[:, :, None], window)
    private = torch.arange(bias.shape[-1] - p, device=dev) // q > depth - window  # [slots]: the same for all
    kept = torch.cat([prefix, private.expand(*plen.shape, -1)], dim=-1)           # [U, Q, p + slots]
    return bias.masked_fill(~kept.repeat_interleave(group, dim=1).unsqueeze(1), float("-inf"))


def grow_private(state: BranchState, group: int):
    """Double the private depth capacity of an eager state (amortised: once per doubling, never per step)."""
    p, cap = state.keys.shape[3] - state.private_k.shape[3], state.private_k.shape[3]
    u_count, q = state.prefix_len.shape
    state.keys, state.values = _grown(state.keys, cap), _grown(state.values, cap)
    state.private_k, state.private_v = state.keys[:, :, :, p:], state.values[:, :, :, p:]
    extra = private_bias(u_count, q, group, cap // q, state.keys)
    state.bias = torch.cat([state.bias, extra], dim=-1)


def _grown(buffer: torch.Tensor, extra: int) -> torch.Tensor:
    """buffer with `extra` more zeroed positions (dim 3) after its own."""
    shape = list(buffer.shape)
    shape[3] += extra
    grown = buffer.new_zeros(shape)
    grown[:, :, :, :buffer.shape[3]] = buffer
    return grown


class BranchBatch:
    """The per-forward context of one branch step: one new token per branch slot, input layout [U, Q]."""

    def __init__(self, state: BranchState, cos, signed_sin, group: int, kernel: AttentionKernel = SDPA):
        self.state, self.dense = state, kernel.dense  # the model's (attention.attention_kernel)
        u_count, self.q = state.prefix_len.shape
        if (state.depth + 1) * self.q > state.private_k.shape[3]:
            grow_private(state, group)
        pos = (state.prefix_len + state.depth).clamp_max(cos.shape[0] - 1)
        self.cos, self.signed_sin = cos[pos].unsqueeze(2), signed_sin[pos].unsqueeze(2)  # [U, Q, 1, D]
        self.p = state.bias.shape[-1] - state.private_k.shape[3]  # longest prefix
        seen = self.p + (state.depth + 1) * self.q
        self.bias = state.bias[..., :seen]  # a view: built once per state
        # A query reaches back past a window only from position `window` on (max_prefix_len: on the host).
        self.reach = state.max_prefix_len + state.depth + 1
        self.window_biases = MasksPerWindow(
            lambda window: window_bias(self.bias, state.prefix_len, state.depth, self.p, group, window))
        # Every layer's slices taken once per forward (a layer then indexes them: one op, not four).
        lo, hi = state.depth * self.q, (state.depth + 1) * self.q
        self.write_to = (state.private_k[:, :, :, lo:hi], state.private_v[:, :, :, lo:hi])  # [layers, U, kv, Q, D]
        self.window = (state.keys[:, :, :, :seen], state.values[:, :, :, :seen])  # prefix + this step's private

    def attend(self, layer: int, q, k, v, scale=None, window=None, sinks=None) -> torch.Tensor:
        """q: [U, Q, H, D]; k, v: [U, Q, kv, D] -> [U, Q, H * D]; scale: dense_attention's; window: the
        layer's sliding window (None, or one no branch reaches past: full attention)."""
        self.write_to[0][layer].copy_(k.transpose(1, 2))
        self.write_to[1][layer].copy_(v.transpose(1, 2))
        # One fused attention over [prefix ‖ private] keys, a strided view SDPA reads as it is.
        keys, values = self.window[0][layer], self.window[1][layer]
        bias = self.bias if window is None or self.reach <= window else self.window_biases(window)
        return unfold_heads(self.dense(fold_heads(q, keys.shape[1]), keys, values, bias, scale, sinks), self.q)
