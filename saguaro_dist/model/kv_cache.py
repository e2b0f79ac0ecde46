"""KV storage for many sequences: one pool, a row per sequence, grown by doubling (amortised, never per call)."""
from __future__ import annotations

import heapq

import torch


MIN_KV_CAPACITY = 128  # positions a pool starts with, and the least it narrows to
NARROW_ABOVE = 1024    # a pool narrows (ModelRunner._fit_capacity) only from a capacity above this


class KVPool:
    """k, v: [layers, rows, kv_heads, capacity, head_dim]; row r holds one sequence's positions 0..capacity-1.

    They are views of a store. A growing pool's store is exactly k and v, replaced by a larger copy when
    they grow. A preallocated one (reserve=True; CUDA's, model/memory.py) holds `rows` rows of max_len
    positions from the start, and growing to a capacity within it only widens the views: no copy and no
    new memory. Capacity still grows as the longest sequence does, not at once: the CUDA graphs attend
    over the whole capacity (model/cuda_graphs.py)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_len: int, device, dtype,
                 rows: int = 4, capacity: int = MIN_KV_CAPACITY, reserve: bool = False):
        self.max_len = max_len
        store = (layers, rows, kv_heads, max_len if reserve else min(capacity, max_len), head_dim)
        self._k_store = torch.zeros(store, device=device, dtype=dtype)
        self._v_store = torch.zeros(store, device=device, dtype=dtype)
        self._view(rows, min(capacity, max_len))
        self.free_rows = list(range(rows))  # a heap: lowest rows first keeps a batch's rows contiguous

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Memory the pool holds (its store, not just the views)."""
        return self._k_store.nbytes + self._v_store.nbytes

    def take_row(self) -> int:
        if not self.free_rows:
            old = self.rows
            self._resize(2 * old, self.capacity)
            self.free_rows = list(range(old, 2 * old))
        return heapq.heappop(self.free_rows)

    def give_row(self, row: int):
        heapq.heappush(self.free_rows, row)

    def reserve(self, length: int):
        """Make room for positions 0..length-1 in every row."""
        if length > self.capacity:
            self._resize(self.rows, min(max(length, 2 * self.capacity), self.max_len))

    def shrink(self, capacity: int) -> None:
        """Narrow the views to `capacity` positions; the store keeps what lies beyond (no copy, no memory
        freed), so a row read later past it (a kept prefix) is whole again once reserve() widens the views.
        Why: the static forwards that CUDA graphs capture attend over the whole capacity, so after one long
        sequence every later step would attend over its length."""
        if capacity < self.capacity:
            self._view(self.rows, capacity)

    def _view(self, rows: int, capacity: int) -> None:
        self.k = self._k_store[:, :rows, :, :capacity]
        self.v = self._v_store[:, :rows, :, :capacity]
        self.capacity = capacity

    def _resize(self, rows: int, capacity: int):
        """Widen the views within the store, or copy the whole store (views narrowed by shrink() hide positions
        still wanted) into a larger one."""
        if rows > self._k_store.shape[1] or capacity > self._k_store.shape[3]:
            old = self._k_store.shape
            shape = [old[0], max(rows, old[1]), old[2], max(capacity, old[3]), old[4]]
            k, v = self._k_store.new_zeros(shape), self._v_store.new_zeros(shape)
            k[:, :old[1], :, :old[3]] = self._k_store
            v[:, :old[1], :, :old[3]] = self._v_store
            self._k_store, self._v_store = k, v
        self._view(rows, capacity)

    def span(self, rows: slice, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of consecutive rows up to `length` in every layer: [layers, B, kv_heads, length, head_dim]
        views. Taken once per forward, a layer's keys are then one index, not four slicing ops."""
        return self.k[:, rows, :, :length], self.v[:, rows, :, :length]

    def view(self, layer: int, rows, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of `rows` up to `length`: [B, kv_heads, length, head_dim]; a view (no copy) when rows is a slice."""
        return self.k[layer, rows, :, :length], self.v[layer, rows, :, :length]


def rows_index(rows: list[int], device) -> slice | torch.Tensor:
    """A slice when the rows are consecutive (indexing is then a view), else an index tensor (a gather)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)
