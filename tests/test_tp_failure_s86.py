"""A replayed runner call that fails on ONE tensor-parallel rank only (a CUDA OOM on rank 0, which also holds the
engine's tensors; a MemoryError on a follower) fails its request at once with a named error, and the group is
noted lost (the driver then fails the engine; LLM.rebuild() starts fresh ranks). The ranks once ended up in
mismatched collectives (a follower took any failure for rank 0's too and waited for its next call while rank 0 sat
in the forward's all-reduce; rank 0's PING after its own failure met a follower's pending all-reduce), and every
request waited out the group's timeout (30 min on gloo, 10 on NCCL) before anything failed.

Real TargetRanks on a real gloo group, one process a rank (no Ray: TargetRank is the plain class Ray wraps), a real
checkpoint. Simulated: only the fault, raised by one rank's runner (its pool's reserve, or a decoder layer's
forward) once the test arms it. The group's timeout is long (600 s): a hang fails the test by the bounded waits
(BOUND_S: the request gets no answer), no time is measured. A refusal by the runner's checks (ValueError, alike on
every rank) keeps the group."""
from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta

import pytest
from test_tp_idle import ask, grouped_rank

pytestmark = pytest.mark.slow
GROUP_TIMEOUT = timedelta(seconds=600)  # far beyond BOUND_S: waiting it out is the hang this test catches
MAX_TOKENS = 6
BOUND_S = 30  # an answer's wait (milliseconds here): the old code hung until the group's timeout
START_S = 120  # a rank's start-up (imports, the checkpoint) on a loaded CI host


def inject(runner, where: str, armed) -> None:
    """The one simulated part: once `armed` is set, this rank's next pool reserve (before the forward's first
    collective) or decoder layer 1's next forward (after the embedding's all-reduce) raises, as an OOM would."""
    import torch
    owner, name = (runner.pool, "reserve") if where == "reserve" else (runner.model.model.layers[1], "forward")
    real, fired = getattr(owner, name), []

    def failing(*args, **kwargs):
        if armed.is_set() and not fired:
            fired.append(True)
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected into {where})")
        return real(*args, **kwargs)
    setattr(owner, name, failing)


def target_rank(rank: int, path: str, fault: tuple[int, str], masters, armed, results, prompts: list) -> None:
    """One rank's process. Rank 0: a refused call, a request (the group kept), then, armed, a request that meets
    the fault and one after it. (The process imports this module: engine_helpers, ~5 s of CPU a process loading
    transformers' models, is imported by the test's side alone.)"""
    import saguaro_dist.engine.build as build
    made, make_runner = [], build.make_runner
    build.make_runner = lambda *a, **k: made.append(make_runner(*a, **k)) or made[-1]  # this rank's runner
    target = grouped_rank(path, rank, masters, GROUP_TIMEOUT, START_S)
    if rank == fault[0]:
        inject(made[0], fault[1], armed)
    if rank > 0:
        target.followed()
        return
    try:
        target.thread.engine.target.runner.truncate("no such sequence", 0)
        refused = None
    except ValueError as err:
        refused = repr(err)
    first = ask(target, 1, prompts[0], BOUND_S)
    armed.set()
    failed = ask(target, 2, prompts[1], BOUND_S)
    results.put((refused, first, failed, target.poll(0).lost, ask(target, 3, prompts[2], BOUND_S)))
    results.close()
    results.join_thread()  # (the queue's feeder thread sends it: os._exit would not wait)
    os._exit(0)  # (a broken gloo group's teardown may wait on its peer)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from engine_helpers import llama_config, save_model
    path = tmp_path_factory.mktemp("tp_failure") / "target"
    model = save_model(path, llama_config(96, 64, 2), seed=0)
    return str(path), model


@pytest.mark.parametrize("fault", [(0, "reserve"), (1, "forward")],
                         ids=["rank0-before-forward", "follower-mid-forward"])
def test_a_call_failing_on_one_rank_fails_its_request_by_name_and_loses_the_group(target, fault):
    from engine_helpers import PROMPTS, hf_greedy
    from saguaro_dist.distributed.tp_runner import FOLLOWER_LOST_EXIT
    path, model = target
    spawn = multiprocessing.get_context("spawn")
    masters, armed, results = spawn.Queue(), spawn.Event(), spawn.Queue()
    ranks = [spawn.Process(target=target_rank, args=(r, path, fault, masters, armed, results, PROMPTS[:3]))
             for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        refused, first, failed, lost, after = results.get(timeout=START_S + 3 * BOUND_S)
        if fault[0] == 1:
            ranks[1].join(timeout=BOUND_S)
            assert ranks[1].exitcode == FOLLOWER_LOST_EXIT  # it left lock-step: its process ended
    finally:
        for p in ranks:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert refused is not None and "no such sequence" in refused
    assert first == (hf_greedy(model, PROMPTS[0], MAX_TOKENS), None)  # the refusal kept the ranks in lock-step
    assert failed[1] is not None and "RankLost" in failed[1], failed
    if fault[0] == 0:
        assert "injected into reserve" in failed[1], failed  # rank 0's own failure, named
    assert lost is not None, "rank 0 did not note its group lost"
    assert after[1] is not None and "RankLost" in after[1], after  # refused at once, until a rebuild
