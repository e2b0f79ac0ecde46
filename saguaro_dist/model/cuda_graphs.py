"""CUDA graphs for a model's short forwards: extend steps of at most MAX_GRAPH_TOKENS tokens a sequence
(decode, verify at K + 1, the draft's glue and just-in-time steps) and branch steps (the draft's tree).
A small model's eager forward is launch-bound on a GPU (~0.5 ms of host time a layer, docs/benchmark-history.md
"GPU, session 17"); a replayed graph launches the whole forward at once.

A graph is captured per padded layout on first use, as vLLM and gpt-fast do: extend per (batch bucket,
T), shorter rows padded with tokens whose keys land beyond the sequence's length (never read before
they are overwritten), padding rows writing to a scratch pool row; branches per (sequence bucket,
branch bucket). Inputs are copied into the graph's static buffers before each replay. A graph holds the
KV pool's addresses, so a pool resize (rows or capacity doubling, amortised) drops every graph and they
are captured again.

Mixture-of-experts models (model/moe.py) run eagerly: their expert loop is data-dependent (which experts
a step's tokens chose, a host sync), which a graph cannot capture; StepGraphs refuses them, logged once. So it
does models with LoRA enabled (model/lora.py: each row's adapter is chosen on the host)."""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

import torch

from saguaro_dist.model.branch import BranchState, group_branches
from saguaro_dist.model.kv_cache import KVPool
from saguaro_dist.model.lora import has_lora
from saguaro_dist.model.moe import has_experts
from saguaro_dist.model.static_batch import StaticBatch
from saguaro_dist.model.static_branch import StaticBranchBatch

log = logging.getLogger(__name__)

# One capture at a time in a process: an engine whose draft runs on a thread holds two runners on one
# GPU. Captures are also thread-local (capture_error_mode), so the other thread's kernels, which run on
# other streams than the capture's, may go on meanwhile.
_CAPTURE_LOCK = threading.Lock()
_capture_events = [0]  # starts and ends of captures in this process (under the lock): see graph_captures
MAX_GRAPH_TOKENS = 16   # longest extend row worth a graph; longer ones (prefills) run eagerly
MAX_GRAPH_BRANCHES = 64  # most branches of one sequence in a graphed branch step


def graph_captures() -> int:
    """A count that moves whenever a CUDA-graph capture in this process starts or ends. A capture
    synchronises the device and stalls every thread for milliseconds (first use of a shape, and after
    each KV pool growth): a round during which the count moved measures the capture, not its mode, and
    the tree gate leaves it out (engine/ssd_loop.py)."""
    return _capture_events[0]


@contextlib.contextmanager
def _counted():
    _capture_events[0] += 1
    try:
        yield
    finally:
        _capture_events[0] += 1


def buckets(largest: int) -> list[int]:
    """1, 2, 4, ... up to `largest` (and `largest` itself): padding wastes at most half a bucket."""
    sizes = [1]
    while sizes[-1] < largest:
        sizes.append(min(2 * sizes[-1], largest))
    return sizes


def bucket(sizes: list[int], n: int) -> int:
    return next(s for s in sizes if s >= n)


@dataclass
class ExtendStep:
    ids: torch.Tensor                     # [Bp, T] int64 input buffer
    rows: torch.Tensor                    # [Bp] int64 input buffer
    pos: torch.Tensor                     # [Bp, T] int64 input buffer
    graph: "torch.cuda.CUDAGraph | None" = None  # None: the static forward runs uncaptured (CPU tests)
    logits: torch.Tensor | None = None    # [Bp * T, V] model dtype: the output buffer a replay overwrites


@dataclass
class BranchStep:
    ids: torch.Tensor                     # [Up, Qp] int64 input buffer
    rows: torch.Tensor                    # [Up] int64 input buffer
    prefix_len: torch.Tensor              # [Up, Qp] int64 input buffer
    depth: torch.Tensor                   # [] int64 input buffer
    private_k: torch.Tensor               # [layers, Up, kv, depth_cap * Qp, D]: the tree in flight's KV
    private_v: torch.Tensor
    graph: "torch.cuda.CUDAGraph | None" = None
    logits: torch.Tensor | None = None    # [Up * Qp, V] model dtype
    owner: BranchState | None = field(default=None, repr=False)  # the state whose KV private_k/v hold


@dataclass(frozen=True)
class CaptureStreams:
    """One runner's streams for capturing its graphs. A graph keeps the cuBLAS workspace of the (thread,
    stream) it was captured on (PyTorch keys workspaces so); on torch.cuda.graph's one process-wide capture
    stream the target's and a draft's graphs captured on one thread would share a workspace, and then race
    on it wherever they replay at once (SSD on one GPU: session 64's draft-thread failures on an H200,
    which passed in 7 runs of 7 with this in session 65). Taken once per runner: torch hands out streams
    round-robin from a pool of 32, so one new stream per capture came round to other runners' streams."""
    capture: torch.cuda.Stream
    warm_up: torch.cuda.Stream

    @staticmethod
    def new(device) -> CaptureStreams:
        return CaptureStreams(torch.cuda.Stream(device), torch.cuda.Stream(device))


def graph_refusal(model, capture: bool = True, log_it: bool = False) -> str | None:
    """Why this model's forwards cannot run as static steps (None: they can; log_it: say why, once): their
    shapes depend on data. An expert loop still runs uncaptured (capture False, the tests' way); LoRA's slot
    groups never do (the static contexts carry none)."""
    reason = None
    if capture and has_experts(model):
        reason = "a mixture-of-experts layer picks its experts per token (data-dependent shapes a graph cannot capture)"
    elif has_lora(model):  # each row's adapter is picked on the host (model/lora.py)
        reason = ("LoRA adapters are enabled (max_loras >= 1), whose per-sequence slots give data-dependent shapes "
                  "a graph cannot capture")
    if reason is not None and log_it:
        log.warning("CUDA graphs are off for this model: %s; its forwards run eagerly", reason)
    return reason


class StepGraphs:
    """Captured forwards of one model over one KV pool. `capture=False` runs the same static forwards
    without a graph, so padding and layouts are tested where there is no GPU."""

    def __init__(self, model, pool: KVPool, cos, signed_sin, group: int, max_batch: int, branch_depth: int = 8,
                 capture: bool = True):
        self.model, self.pool, self.cos, self.signed_sin, self.group = model, pool, cos, signed_sin, group
        self.batch_buckets, self.branch_buckets = buckets(max_batch), buckets(MAX_GRAPH_BRANCHES)
        self.branch_depth, self.capture = branch_depth, capture
        self.scratch_row = pool.take_row()  # padding rows write here; nothing reads it
        self._steps: dict[tuple, ExtendStep | BranchStep] = {}
        self._pool_key, self._mempool = None, None
        self._streams = CaptureStreams.new(pool.k.device) if capture else None
        self.refused = graph_refusal(model, capture, log_it=True) is not None  # the module docstring: runs eagerly

    # -- extend ----------------------------------------------------------------------------------
    def supports_extend(self, starts: list[int], lens: list[int]) -> bool:
        t = max(lens)
        return (not self.refused and len(lens) <= self.batch_buckets[-1] and t <= MAX_GRAPH_TOKENS
                and max(starts) + t <= self.pool.max_len)

    def extend(self, rows: list[int], starts: list[int], token_lists) -> list[torch.Tensor]:
        """Logits [T, V] float32 (fresh tensors) per sequence of appending token_lists[b] at starts[b] in
        rows[b]; row b's real tokens are its first len(token_lists[b]) rows."""
        b, t = len(rows), max(len(x) for x in token_lists)
        self.pool.reserve(max(starts) + t)  # padding tokens are written too
        step = self._step(("extend", bucket(self.batch_buckets, b), t))
        pad = len(step.rows) - b
        step.ids.copy_(torch.tensor([list(x) + [0] * (t - len(x)) for x in token_lists] + [[0] * t] * pad),
                       non_blocking=True)
        step.rows.copy_(torch.tensor(rows + [self.scratch_row] * pad), non_blocking=True)
        step.pos.copy_(torch.tensor(starts + [0] * pad)[:, None] + torch.arange(t), non_blocking=True)
        # A copy: the next replay overwrites the output buffer (float() alone would alias it in fp32).
        return list(self._run(step)[:b * t].to(torch.float32, copy=True).view(b, t, -1).unbind())

    def _extend_forward(self, step: ExtendStep) -> torch.Tensor:
        ctx = StaticBatch(self.pool, step.rows, step.pos, self.cos, self.signed_sin, self.group, self.model.attention)
        return self.model.logits(self.model(step.ids, ctx).flatten(0, 1))

    def _new_extend(self, bp: int, t: int) -> ExtendStep:
        dev = self.pool.k.device
        return ExtendStep(torch.zeros(bp, t, dtype=torch.long, device=dev),
                          torch.full((bp,), self.scratch_row, dtype=torch.long, device=dev),
                          torch.arange(t, device=dev).expand(bp, t).contiguous())

    # -- branches --------------------------------------------------------------------------------
    def supports_branches(self, seq_rows: list[int]) -> bool:
        rows, uj = group_branches(seq_rows)
        return not self.refused and len(rows) <= self.batch_buckets[-1] and max(j for _, j in uj) < MAX_GRAPH_BRANCHES

    def branch_state(self, seq_ids, seq_rows: list[int], prefix_lens: list[int]) -> BranchState:
        """A BranchState laid out [Up, Qp] whose private KV is the graph's buffer (until the next tree of
        that layout claims it: then the old state gets its own copy, so a later adopt_branch still reads it)."""
        rows, uj = group_branches(seq_rows)
        up, qp = bucket(self.batch_buckets, len(rows)), bucket(self.branch_buckets, 1 + max(j for _, j in uj))
        step = self._step(("branch", up, qp))
        if step.owner is not None and step.owner.private_k is step.private_k:
            step.owner.private_k, step.owner.private_v = step.private_k.clone(), step.private_v.clone()
        plen = [[0] * qp for _ in range(up)]
        for (u, j), n in zip(uj, prefix_lens):
            plen[u][j] = n
        dev = self.pool.k.device
        state = BranchState(list(seq_ids), rows, torch.tensor(plen, device=dev), None,
                            torch.tensor([u * qp + j for u, j in uj], device=dev), step.private_k, step.private_v,
                            max_prefix_len=max(prefix_lens), graph_key=("branch", up, qp))
        step.prefix_len.copy_(state.prefix_len)
        step.rows.copy_(torch.tensor(rows + [self.scratch_row] * (up - len(rows))), non_blocking=True)
        step.owner = state
        return state

    def branch_forward(self, state: BranchState, tokens) -> torch.Tensor:
        """One step of every branch of `state` (tokens [N]); logits [N, V] float32."""
        step = None if self._pool_moved() else self._steps.get(state.graph_key)
        if step is None or step.owner is not state or state.depth >= self.branch_depth:
            raise ValueError("branch_step: this branch state's graph was re-captured or reused "
                             f"(or its depth passed {self.branch_depth}); start the branches again")
        step.ids.zero_().view(-1)[state.out_index] = torch.as_tensor(tokens, device=step.ids.device).long()
        step.depth.fill_(state.depth)
        return self._run(step)[state.out_index].float()

    def _branch_forward(self, step: BranchStep) -> torch.Tensor:
        ctx = StaticBranchBatch(self.pool, step.rows, step.prefix_len, step.depth, step.private_k, step.private_v,
                                self.cos, self.signed_sin, self.group, self.model.attention)
        return self.model.logits(self.model(step.ids, ctx).flatten(0, 1))

    def _new_branch(self, up: int, qp: int) -> BranchStep:
        dev = self.pool.k.device
        layers, _, kv, _, hd = self.pool.k.shape
        private = (layers, up, kv, self.branch_depth * qp, hd)
        return BranchStep(torch.zeros(up, qp, dtype=torch.long, device=dev),
                          torch.full((up,), self.scratch_row, dtype=torch.long, device=dev),
                          torch.zeros(up, qp, dtype=torch.long, device=dev), torch.zeros((), dtype=torch.long, device=dev),
                          self.pool.k.new_zeros(private), self.pool.v.new_zeros(private))

    # -- capture ---------------------------------------------------------------------------------
    def _pool_moved(self) -> bool:
        return self._pool_key != (self.pool.k.data_ptr(), self.pool.capacity, self.pool.rows)

    def _step(self, key: tuple):
        if self._pool_moved():  # every graph points at freed memory
            self._steps.clear()
            self._pool_key = (self.pool.k.data_ptr(), self.pool.capacity, self.pool.rows)
            # The graphs' memory pool went with the last of them; capturing into its handle again trips
            # the caching allocator (an internal assert, seen on torch 2.11): a fresh one.
            self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        if key not in self._steps:
            kind, *shape = key
            self._steps[key] = self._new_extend(*shape) if kind == "extend" else self._new_branch(*shape)
            if self.capture:
                self._capture(self._steps[key])
                log.debug("captured a CUDA graph: %s, KV capacity %d", key, self.pool.capacity)
        return self._steps[key]

    def _forward(self, step) -> torch.Tensor:
        return self._extend_forward(step) if isinstance(step, ExtendStep) else self._branch_forward(step)

    def _run(self, step) -> torch.Tensor:
        """The step's logits; a fresh tensor or, captured, the output buffer (callers copy out of it)."""
        if step.graph is None:
            return self._forward(step)
        step.graph.replay()
        return step.logits

    def _capture(self, step) -> None:
        with _CAPTURE_LOCK, _counted():
            side = self._streams.warm_up
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture: cuBLAS workspaces, lazy inits
                for _ in range(2):
                    self._forward(step)
            torch.cuda.current_stream().wait_stream(side)
            step.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step.graph, pool=self._mempool, stream=self._streams.capture,
                                  capture_error_mode="thread_local"):
                step.logits = self._forward(step)
