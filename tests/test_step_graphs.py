"""The static forward that CUDA graphs capture (model/cuda_graphs.py), run eagerly on the CPU: padding to
a batch bucket, the masked whole-capacity attention, rows gathered by index and a pool that grows under
it give the logits of the ordinary eager forward. The capture itself needs a GPU (tests/test_cuda.py)."""
from __future__ import annotations

import pytest
import torch

import saguaro_dist.model.runner as runner_module
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


@pytest.mark.parametrize("preallocate", [False, True])
def test_the_pool_narrows_once_a_long_sequence_leaves_and_stays_exact(tiny_checkpoint, preallocate, monkeypatch):
    """The static forwards attend over the pool's whole capacity: after a long sequence finishes (kept by the
    prefix cache under a new name) the pool narrows to what the live ones need, the short one's static
    steps still give the eager logits, and a prefix copied later from the long kept row is whole. (Narrowing
    starts above NARROW_ABOVE positions; lowered here to keep the model tiny.)"""
    monkeypatch.setattr(runner_module, "NARROW_ABOVE", 128)
    path = tiny_checkpoint("llama")
    long_prompt = [(7 * i) % 60 + 2 for i in range(200)]
    static, eager = static_runner(path, preallocate_kv=preallocate), ModelRunner(path)
    got, want = [], []
    for runner, out in ((static, got), (eager, want)):
        runner.add("long"), runner.add("short")
        runner.extend(["long", "short"], [long_prompt, [3, 4, 5, 6]], [1, 1])
        assert runner.pool.capacity == 256
        runner.rename("long", ("prefix", 0))  # finished, kept for its prefix
        assert runner.pool.capacity == 128
        for t in (8, 9, 10):
            out += runner.extend(["short"], [[t]], [1])
        if runner is static:  # those steps were static, over the narrowed pool
            assert ("extend", 1, 1) in static.graphs._steps and static.graphs._pool_key[1] == 128
        runner.add("again")
        runner.copy_prefix(("prefix", 0), "again", 150)
        out += runner.extend(["again", "short"], [[11], [12]], [1, 1])
    fresh = ModelRunner(path)
    fresh.add("x")
    [whole] = fresh.extend(["x"], [long_prompt[:150] + [11]], [1])
    torch.testing.assert_close(got[-2], whole, rtol=1e-5, atol=1e-5)  # the kept row's positions past 128 survived
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ("extend", 2, 1) in static.graphs._steps  # the last step took the static path (the widening dropped the rest)


def test_requests_of_a_few_hundred_positions_keep_the_pool_and_its_graphs(tiny_checkpoint):
    """A pool at or under NARROW_ABOVE positions never narrows: each narrowing drops every graph, and one
    after every request made each request of over 128 positions capture them all again (session 64)."""
    static = static_runner(tiny_checkpoint("llama"))
    for i in range(3):  # one request at a time, each to 200 positions (the pool widens to 256 once)
        static.add(i)
        static.extend([i], [[(5 * j) % 60 + 2 for j in range(196)]], [1])
        for t in range(4):
            static.extend([i], [[t + 2]], [1])
        assert static.pool.capacity == 256 and ("extend", 1, 1) in static.graphs._steps
        static.free(i)
        assert static.pool.capacity == 256 and ("extend", 1, 1) in static.graphs._steps, i  # kept for the next


def test_a_pool_narrowed_then_grown_past_its_store_keeps_every_position():
    from saguaro_dist.model.kv_cache import KVPool
    pool = KVPool(layers=1, kv_heads=1, head_dim=2, max_len=1024, device="cpu", dtype=torch.float32, rows=2)
    pool.reserve(300)
    pool.k[0, 1, 0, :300] = torch.arange(300.0)[:, None]
    pool.shrink(128)
    assert pool.capacity == 128 and pool.k.shape[3] == 128
    pool.reserve(1000)  # beyond the store: copied into a larger one, the hidden positions too
    assert pool.capacity == 1000
    torch.testing.assert_close(pool.k[0, 1, 0, :300], torch.arange(300.0)[:, None].expand(300, 2))
