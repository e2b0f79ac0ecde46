"""The static forward that CUDA graphs capture (model/cuda_graphs.py), run eagerly on the CPU: padding to
a batch bucket, the masked whole-capacity attention, rows gathered by index and a pool that grows under
it give the logits of the ordinary eager forward. The capture itself needs a GPU (tests/test_cuda.py)."""
from __future__ import annotations

import pytest
import torch

from saguaro_dist.model import ModelRunner
from saguaro_dist.model.cuda_graphs import StepGraphs, buckets


def static_runner(path, **kw) -> ModelRunner:
    """A runner whose uniform steps take the graph path without a capture."""
    runner = ModelRunner(path, **kw)
    with torch.inference_mode():
        runner.graphs = StepGraphs(runner.model, runner.pool, runner.cos, runner.signed_sin, runner.group,
                                   max_batch=8, capture=False)
    return runner


def steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Mixed prefills (eager), then short steps: decode of 3 (padded to 4), verify of 3 tokens after a
    truncate (stale keys beyond it must stay masked), one row alone, rows out of order, mixed lengths
    (padded), branch trees (two of one layout in turn, the first adopted after the second ran), and
    enough tokens to double the pool's capacity between two graph steps."""
    out = []
    for s in "abc":
        runner.add(s)
    out += runner.extend(list("abc"), [[1, 5, 9, 13, 2, 7], [3, 4], [6, 6, 6, 1]], [1, 2, 1])
    out += runner.extend(list("abc"), [[8], [10], [11]], [1, 1, 1])
    runner.truncate("a", 4)
    out += runner.extend(list("cab"), [[12, 13, 14], [15, 16, 17], [18, 19, 20]], [3, 3, 2])
    out += runner.extend(["b"], [[21]], [1])
    out += runner.extend(list("abc"), [[2, 3], [4], [5, 6, 7]], [2, 1, 1])
    out += trees(runner)
    out += runner.extend(["a", "c"], [list(range(1, 15))] * 2, [1, 1])
    for _ in range(30):  # past the pool's first capacity (128 positions)
        out += runner.extend(["a", "c"], [[22, 23, 24, 25]] * 2, [2, 4])
    return out


def trees(runner: ModelRunner) -> list[torch.Tensor]:
    first, logits = runner.branch_start(list("aca"), [6, 9, 4], [20, 21, 22])
    out = [logits, runner.branch_step(first, torch.tensor([30, 31, 32]))]
    second, logits = runner.branch_start(list("bab"), [4, 3, 2], [23, 24, 25])  # same layout: [2 seqs, 2]
    out += [logits, runner.branch_step(second, torch.tensor([33, 34, 35])),
            runner.branch_step(second, torch.tensor([36, 37, 38]))]
    if runner.graphs is not None:  # both trees took the static layout [2 sequences, 2 branches]
        assert first.graph_key == second.graph_key == ("branch", 2, 2)
    runner.truncate("c", 9)
    runner.truncate("b", 4)
    runner.adopt_branch(first, 1, 2)  # the first tree's branch of c, after the second tree ran
    runner.adopt_branch(second, 0, 3)  # b's first branch, three tokens
    out += runner.extend(list("cb"), [[40], [41]], [1, 1])
    return out


def test_buckets_cover_every_size_up_to_the_largest():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(12) == [1, 2, 4, 8, 12]


@pytest.mark.parametrize("kind, preallocate", [("llama", False), ("qwen3", False), ("llama", True)])
def test_static_steps_give_the_eager_logits(tiny_checkpoint, kind, preallocate):
    """preallocate: the pool as CUDA has it, its views of a store held whole from the start (model/memory.py)."""
    path = tiny_checkpoint(kind)
    eager = ModelRunner(path)
    static = static_runner(path, preallocate_kv=preallocate)
    first_capacity = static.pool.capacity
    got, want = steps(static), steps(eager)
    assert static.pool.capacity > first_capacity
    assert ("extend", 2, 4) in static.graphs._steps  # the last steps did take the static path
    assert static.graphs.supports_extend([0, 9], [3, 1]) and not static.graphs.supports_extend([0, 9], [17, 1])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_graphs_need_a_cuda_device(tiny_checkpoint):
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        ModelRunner(tiny_checkpoint("llama"), cuda_graphs=True)


def test_a_tree_whose_layout_was_claimed_again_cannot_step(tiny_checkpoint):
    """The layout's buffers now hold the newer tree: stepping the older one would read the wrong KV, so
    it is refused (it can still be adopted from: it got its own copy)."""
    runner = static_runner(tiny_checkpoint("llama"))
    runner.add("a")
    runner.extend(["a"], [[1, 2, 3, 4]], [1])
    first, _ = runner.branch_start(["a", "a"], [4, 3], [5, 6])
    second, _ = runner.branch_start(["a", "a"], [4, 2], [7, 8])
    with pytest.raises(ValueError, match="reused"):
        runner.branch_step(first, torch.tensor([9, 9]))
    runner.branch_step(second, torch.tensor([9, 9]))
    assert first.private_k is not second.private_k
