"""KV storage for many sequences: one pool, a row per sequence, grown by doubling (amortised, never per call)."""
from __future__ import annotations

import heapq

import torch


class KVPool:
    """k, v: [layers, rows, kv_heads, capacity, head_dim]; row r holds one sequence's positions 0..capacity-1."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_len: int, device, dtype,
                 rows: int = 4, capacity: int = 128):
        self.max_len = max_len
        self.capacity = min(capacity, max_len)
        shape = (layers, rows, kv_heads, self.capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.free_rows = list(range(rows))  # a heap: lowest rows first keeps a batch's rows contiguous

    @property
    def rows(self) -> int:
        return self.k.shape[1]

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

    def _resize(self, rows: int, capacity: int):
        shape = list(self.k.shape)
        shape[1], shape[3] = rows, capacity
        k, v = self.k.new_zeros(shape), self.v.new_zeros(shape)
        k[:, :self.rows, :, :self.capacity] = self.k
        v[:, :self.rows, :, :self.capacity] = self.v
        self.k, self.v, self.capacity = k, v, capacity

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
