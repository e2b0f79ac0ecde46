"""Does the KV cache fit? Its worst case against the memory left once the weights are in.

The pool (model/kv_cache.py) holds a row per sequence, every row as long as the longest sequence, so
its worst case is known before any request: rows x max_model_len positions. On CUDA the runner
allocates that at start-up (vLLM's way: no copy as the pool grows, and no out-of-memory error an hour
into serving that fails every request of the step), so a worst case over the budget is a start-up
error that names what would fit. On the CPU the pool grows as sequences do, in memory the OS shares,
so the same finding is a warning: a deployment whose requests stay short runs as before.

Budget (vLLM's gpu_memory_utilization): on CUDA the engine may use that share of the GPU's memory, so
the KV may take what is free now less the share it must leave; on the CPU, that share of the memory
free now (the container's cgroup limit counts: a pod's limit is usually far below the node's RAM).
Activations are not counted: the share left over is their room.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

log = logging.getLogger(__name__)

MIB, GIB = 1024 ** 2, 1024 ** 3
_CGROUP_V2 = ("memory.max", "memory.current")
_CGROUP_V1 = ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys and values of one position in every layer (num_kv_heads: this rank's, after tensor parallel)."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


@dataclass(frozen=True)
class KVNeed:
    """The pool's worst case: `batch` sequences (and `spare_rows` more: the CUDA graphs' scratch row)
    of `max_len` positions (max_model_len) and `slack` more (a speculative target's, ModelRunner position_slack)."""
    batch: int
    spare_rows: int
    max_len: int
    bytes_per_token: int
    slack: int = 0

    @property
    def rows(self) -> int:
        return self.batch + self.spare_rows

    @property
    def bytes(self) -> int:
        return self.rows * self.positions * self.bytes_per_token

    @property
    def positions(self) -> int:
        """What one row holds."""
        return self.max_len + self.slack

    def fitting_len(self, budget: int) -> int:
        """The longest max_model_len whose worst case fits `budget` at this batch (0: none)."""
        return max(0, budget // (self.rows * self.bytes_per_token) - self.slack)

    def fitting_batch(self, budget: int) -> int:
        """The largest batch of max_len sequences that fits `budget` (0: none)."""
        return max(0, budget // (self.positions * self.bytes_per_token) - self.spare_rows)


def cgroup_headroom(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this container may still allocate under its memory limit; None without a limit."""
    for limit_file, usage_file in (_CGROUP_V2, _CGROUP_V1):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" (v2) or a huge number (v1): no limit
            return max(0, int(limit) - usage)
        return None
    return None


def kv_budget(device: torch.device, utilization: float) -> int:
    """Bytes the KV may take on `device`, by the rule in the module docstring."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - total * (1.0 - utilization)))
    free = psutil.virtual_memory().available
    headroom = cgroup_headroom()
    return int(utilization * (free if headroom is None else min(free, headroom)))


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def shortfall(need: KVNeed, budget: int, device: torch.device, utilization: float) -> str | None:
    """Why the worst case does not fit, with what would (None: it fits)."""
    if need.bytes <= budget:
        return None
    rows = (f"(max_batch_size {need.batch} + {need.spare_rows} scratch row)" if need.spare_rows
            else f"max_batch_size {need.batch}")
    fits = [f"max_model_len {need.fitting_len(budget)}"] if need.fitting_len(budget) else []
    fits += [f"max_batch_size (max_num_seqs) {need.fitting_batch(budget)}"] if need.fitting_batch(budget) else []
    positions = f"max_model_len {need.max_len}" + (f" (+ {need.slack} speculative)" if need.slack else "")
    return (f"the KV cache's worst case, {rows} x {positions} x "
            f"{need.bytes_per_token} bytes a position = {_size(need.bytes)}, is more than the "
            f"{_size(budget)} that {device} has for it at gpu_memory_utilization {utilization} "
            f"(what the weights and other processes leave). "
            + (f"Fits: {' or '.join(fits)}; or raise gpu_memory_utilization" if fits else
               "Nothing fits: free memory, or raise gpu_memory_utilization"))


def check_kv_fits(need: KVNeed, device: torch.device, utilization: float, strict: bool) -> None:
    """Raise (strict: the pool is allocated whole now) or warn (it grows on demand) when it does not fit."""
    budget = kv_budget(device, utilization)
    why = shortfall(need, budget, device, utilization)
    if why is None:  # vLLM's start-up line on its KV cache, in this pool's terms
        log.info("KV cache on %s: up to %d rows x %d positions = %s (%s), %s free for it at gpu_memory_utilization %s",
                 device, need.rows, need.positions, _size(need.bytes), "allocated now" if strict else "grown on demand",
                 _size(budget), utilization)
        return
    if strict:
        raise ValueError(why)
    log.warning("%s; until sequences grow that long it runs, and if they do the process may run out of memory "
                "(growing the pool copies it: twice its size for a moment)", why)
