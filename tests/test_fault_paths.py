"""Fault paths of the draft side, over real gRPC on loopback and a real draft child process: a worker that
fails in the middle of a cohort's drafts, a worker the pool marked dead, a tree-side child that died."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

from engine_helpers import PROMPTS, close_pair, wait_for
from saguaro_dist.config import Config
from saguaro_dist.distributed.draft_pool import LATE_TREE_WAITS_BEFORE_DEAD, DraftPool
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.errors import DraftUnavailable
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.draft_process import DraftProcess
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest
from saguaro_dist.engine.split_draft import SplitDraftBackend

pytestmark = pytest.mark.timeout(180)
GREEDY = DraftSampling(0.0, 0, 1.0, None)
SEEDED = DraftSampling(0.8, 0, 1.0, 7)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("fault_paths_pair"))


@pytest.fixture(scope="module")
def config(pair):
    return Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6, draft_threads=1)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafts_a_cohort_got_before_another_worker_failed_reach_the_local_copy(config, sampling):
    """Two cohorts: the tree side drafts a cohort beside the verify. One pool worker fails, so taking the
    drafts raises DraftUnavailable with the other worker's drafts in `partial`, which the engine verifies.
    The local copy must learn them as it learns any the tree side made: unlearned, a first draft left it at
    round 0 with nothing speculated, the next round's draft (nothing accepted) passed its round check and
    it committed the bonus without the first token, then drafted from that wrong context, at the length
    whose numbers the tree side had drawn the first draft with (a seeded request's draws reused)."""
    servers = [serve_draft(build_draft_worker(config), "127.0.0.1", 0) for _ in range(2)]
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0) for _, port in servers], max_batch_size=2)
    split = SplitDraftBackend(LocalDraftBackend(build_draft_worker(config)), pool)
    seen_all = LocalDraftBackend(build_draft_worker(config))  # a draft that sees every round of sequence 1
    try:
        split.prefill([PrefillRequest(1, PROMPTS[0], sampling), PrefillRequest(2, PROMPTS[1], sampling)])
        assert pool.groups == {1: [0], 2: [1]}
        seen_all.prefill([PrefillRequest(1, PROMPTS[0], sampling)])
        servers[1][0].stop(None).wait()  # sequence 2's worker goes
        wait_for(lambda: pool.backends[1].dead_addresses)
        first = [JitDraftRequest(1, 0, 0, 5, skip_tree=True), JitDraftRequest(2, 0, 0, 6, skip_tree=True)]
        with pytest.raises(DraftUnavailable) as info:  # drafted beside the verify, taken after it
            split.start_jit_draft(first).result()
        assert info.value.seq_ids == [2] and set(info.value.partial) == {1}
        want = seen_all.jit_draft(first[:1])[0]
        assert info.value.partial[1].tokens.tolist() == want.tokens.tolist()
        # The engine verified sequence 1's draft: nothing accepted, bonus 9. Its next draft is made here.
        nxt = [JitDraftRequest(1, 1, 0, 9, skip_tree=True)]
        got, want = split.jit_draft(nxt)[0], seen_all.jit_draft(nxt)[0]
        assert split.jit.worker.seqs[1].committed == seen_all.worker.seqs[1].committed
        assert got.tokens.tolist() == want.tokens.tolist()
    finally:
        split.close()
        seen_all.close()
        servers[0][0].stop(None)


@contextlib.contextmanager
def _stalled_pool(config, deadline_s: float):
    """(pool, resume): sequence 1 on the pool's one worker, whose tree build for round 0 stalls (its server's
    loop stops in plan_trees) until resume is set. No split: the pool drafts just in time as well."""
    worker = build_draft_worker(config)
    resume = threading.Event()
    planning = worker.plan_trees
    worker.plan_trees = lambda: resume.wait(60) and planning()
    server, port = serve_draft(worker, "127.0.0.1", 0)
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=deadline_s)], max_batch_size=4)
    try:
        pool.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        pool.jit_draft([JitDraftRequest(1, 0, 0, 5, skip_tree=True)])
        pool.send_outcomes([Outcome(1, 0, 1, 7, next_tokens=[3, 4, 5], target_proposed=True)])  # wants a tree
        yield pool, resume
    finally:
        resume.set()
        pool.close()
        server.stop(None)


def test_a_worker_the_pool_marked_dead_is_not_asked_for_drafts(config):
    """The pool marks a worker whose trees stay late dead: its sequences are `lost`. Without the split, the
    engine learns that from their next just-in-time draft, which must fail at once (the fast backup, then a
    prefill on a live worker) rather than be asked of the stalled worker and wait out the draft deadline."""
    deadline_s = 4.0
    with _stalled_pool(config, deadline_s) as (pool, _):
        for _ in range(LATE_TREE_WAITS_BEFORE_DEAD):
            assert pool.wait_trees([(1, 1)], 0.2) == {}
        assert pool.workers() == (0, 1) and pool.lost([1]) == [1]
        start = time.monotonic()
        with pytest.raises(DraftUnavailable) as info:
            pool.jit_draft([JitDraftRequest(1, 2, 0, 8)])
        assert info.value.seq_ids == [1]
        assert time.monotonic() - start < deadline_s / 2


def test_a_tree_side_child_that_died_loses_its_sequences_at_once(config):
    """One host, split: the child building the trees dies. The drafts are made on the engine's thread, so no
    call of the child's fails; its sequences must read as lost (their next draft raises DraftUnavailable and
    the engine prefills them again, starting a new child), not run on without trees until another request's
    prefill happens to restart it."""
    split = SplitDraftBackend(LocalDraftBackend(build_draft_worker(config)), DraftProcess(config))
    try:
        split.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        split.jit_draft([JitDraftRequest(1, 0, 0, 5)])
        split.send_outcomes([])
        assert 1 in split.wait_trees([(1, 0)], 30.0)
        child = split.trees._proc
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        split.send_outcomes([Outcome(1, 0, 0, 7, next_tokens=[3, 4, 5], target_proposed=True)])
        assert split.wait_trees([(1, 1)], 0.5) == {}  # the parent reads the child's end
        assert split.workers() == (0, 1)
        assert split.trees.lost([1]) == [1]
        with pytest.raises(DraftUnavailable):
            split.jit_draft([JitDraftRequest(1, 2, 0, 9)])
        split.prefill([PrefillRequest(1, PROMPTS[0] + [5, 7], GREEDY, prompt_len=len(PROMPTS[0]))])  # a new child
        assert split.workers() == (1, 1) and split.trees.lost([1]) == []
    finally:
        split.close()


def test_a_late_tree_of_a_sequences_earlier_life_is_not_taken_after_its_re_prefill(config):
    """A re-prefill restarts a sequence at round 0 on the same server (its stream failed, or the draft lost
    track of it). A tree of its earlier life that came after its round's wait stays in the inbox under
    (seq_id, round); the new life's round of that number must not take it as its own tree."""
    worker = build_draft_worker(config)
    build = threading.Event()
    planning = worker.plan_trees
    worker.plan_trees = lambda: build.wait(30) and planning()
    server, port = serve_draft(worker, "127.0.0.1", 0)
    backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)
    try:
        backend.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        backend.jit_draft([JitDraftRequest(1, 0, 0, 5, skip_tree=True)])
        backend.send_outcomes([Outcome(1, 0, 1, 7, next_tokens=[3, 4, 5], target_proposed=True)])
        assert backend.wait_trees([(1, 1)], 0.2) == {}  # late
        build.set()
        wait_for(lambda: (1, 1) in backend._trees)  # ... and in after its wait
        backend.prefill([PrefillRequest(1, PROMPTS[0] + [5, 3, 7], GREEDY, prompt_len=len(PROMPTS[0]))])
        backend.jit_draft([JitDraftRequest(1, 0, 0, 8, skip_tree=True)])
        assert backend.wait_trees([(1, 1)], 0.0) == {}  # the new life has built no tree yet
    finally:
        build.set()
        backend.close()
        server.stop(None)


def test_a_tree_the_child_pushed_before_a_re_prefill_is_not_taken_after_it(config):
    """One host: the child pushes a tree; the sequence is prefilled again (the engine's net for a draft out of
    step) before the tree was waited for. The new life's round 0 must not take the earlier life's tree."""
    process = DraftProcess(config)
    try:
        process.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        process.jit_draft([JitDraftRequest(1, 0, 0, 5)])
        process.send_outcomes([])  # the child builds round 0's tree and pushes it
        assert process._pump(lambda: len(process.inbox) == 1, time.monotonic() + 30)  # in before the prefill
        process.prefill([PrefillRequest(1, PROMPTS[0] + [5, 3, 7], GREEDY, prompt_len=len(PROMPTS[0]))])
        assert process.wait_trees([(1, 0)], 0.0) == {}
    finally:
        process.close()


def test_a_tree_the_worker_thread_built_before_a_re_prefill_is_not_taken_after_it(config):
    """The same on the in-process draft (the thread executor's LocalDraftBackend)."""
    backend = LocalDraftBackend(build_draft_worker(config))
    try:
        backend.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        backend.jit_draft([JitDraftRequest(1, 0, 0, 5)])
        backend.send_outcomes([])  # the worker thread builds round 0's tree; the prefill runs after it
        backend.prefill([PrefillRequest(1, PROMPTS[0] + [5, 3, 7], GREEDY, prompt_len=len(PROMPTS[0]))])
        assert backend.wait_trees([(1, 0)], 0.0) == {}
    finally:
        backend.close()


def test_a_sequence_left_on_a_worker_taken_back_fails_alone(config):
    """Sequences 1 and 3 on a worker that misses a draft deadline (marked dead; the pool takes it back once it
    answers, having released 1 and 3 there), 2 on another. Sequence 3 was not drafted meanwhile (its rounds
    used trees or n-gram proposals), so its next draft is the first to meet the worker taken back: it must
    fail alone (DraftUnavailable, the others' drafts kept), not with UnknownSequence for the whole batch."""
    slow = build_draft_worker(config)
    resume = threading.Event()
    drafting = slow.jit_draft
    slow.jit_draft = lambda reqs: resume.wait(30) and drafting(reqs)
    servers = [serve_draft(slow, "127.0.0.1", 0), serve_draft(build_draft_worker(config), "127.0.0.1", 0)]
    address = f"127.0.0.1:{servers[0][1]}"
    revive = lambda i: GrpcDraftBackend([address], deadline_s=10.0)  # noqa: E731 - it answers where it was
    pool = DraftPool([GrpcDraftBackend([address], deadline_s=0.5),
                      GrpcDraftBackend([f"127.0.0.1:{servers[1][1]}"], deadline_s=10.0)], max_batch_size=4, revive=revive)
    try:
        pool.prefill([PrefillRequest(s, PROMPTS[s - 1], GREEDY) for s in (1, 2, 3)])
        assert pool.groups == {1: [0], 2: [1], 3: [0]}
        with pytest.raises(DraftUnavailable) as info:
            pool.jit_draft([JitDraftRequest(1, 0, 0, 5), JitDraftRequest(2, 0, 0, 5)])
        assert info.value.seq_ids == [1] and list(info.value.partial) == [2]
        assert pool.workers() == (1, 2)
        resume.set()
        wait_for(lambda: pool.accepting() and pool.workers() == (2, 2))
        assert 3 not in slow.seqs and pool.lost([3]) == [3]
        with pytest.raises(DraftUnavailable) as info:
            pool.jit_draft([JitDraftRequest(3, 0, 0, 5), JitDraftRequest(2, 1, 0, 9)])
        assert info.value.seq_ids == [3] and list(info.value.partial) == [2]
    finally:
        resume.set()
        pool.close()
        for server, _ in servers:
            server.stop(None)


def test_a_sequence_whose_tree_side_died_is_prefilled_again_without_a_draft_asked(pair):
    """One host, split, trees every round, misses on the fast backup: the child building the trees dies
    mid-request. No just-in-time draft is ever asked of the running sequence, yet it must be prefilled again
    (a new child, trees again), not run to its end on the fast backup; its tokens stay the target's."""
    from engine_helpers import assert_greedy_equal, hf_greedy
    from test_draft_process import draft_children, wait_for

    from saguaro_dist import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=110, ignore_eos=True)
    want = hf_greedy(pair["model"], PROMPTS[0], params.max_tokens)
    before = draft_children()
    with LLM(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=12, draft_threads=1,
             draft_executor="split", tree_policy="always", fallback="fast") as llm:
        [child] = draft_children() - before
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            out=llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0]))
        worker.start()
        wait_for(lambda: llm.metrics.cache_hits + llm.metrics.cache_misses >= 2)
        os.kill(child, signal.SIGKILL)
        worker.join(timeout=120)
        assert not worker.is_alive()
        assert_greedy_equal(result["out"].token_ids, want, PROMPTS[0], pair["model"])
        assert len(draft_children() - before) == 1, "no new child: the sequence was never prefilled again"


def _failing_once(method, exc: BaseException):
    """`method`, raising `exc` on its first call only."""
    calls = []

    def once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise exc
        return method(*args)
    return once


@pytest.mark.parametrize("where, exc", [("prefill", MemoryError()), ("jit_draft", RuntimeError("a bug"))],
                         ids=["prefill-out-of-memory", "draft-internal"])
def test_a_draft_server_error_costs_its_sequences_speed_not_the_batch(pair, where, exc):
    """A draft server answering RESOURCE_EXHAUSTED (out of memory at a prefill) or INTERNAL (a draft that
    raised) failed the engine step: every request in flight got an EngineError. Now those sequences go
    on with the fast backup, then a fresh prefill, as when the server is unreachable; tokens stay AR's."""
    from engine_helpers import assert_greedy_equal, hf_greedy

    from saguaro_dist.engine.build import make_runner
    from saguaro_dist.engine.engine import Engine
    from saguaro_dist.engine.sequence import Sequence
    from saguaro_dist.sampling_params import SamplingParams
    config = Config(model=pair["target"], draft=pair["close"], mode="sd", k=3, draft_threads=1)
    worker = build_draft_worker(config)
    setattr(worker, where, _failing_once(getattr(worker, where), exc))
    server, port = serve_draft(worker, "127.0.0.1", 0)
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)], max_batch_size=2)
    engine = Engine(config, make_runner(config.model, config), pool, None, set())
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.add(Sequence(i, str(i), list(prompt), params))
        seqs = list(engine.waiting)
        while engine.running or engine.waiting or engine.prefilling:
            assert all(u.error is None for u in engine.step())
        for seq, prompt in zip(seqs, PROMPTS[:2]):
            assert_greedy_equal(seq.output_token_ids, hf_greedy(pair["model"], prompt, 12), prompt, pair["model"])
    finally:
        engine.close()
        server.stop(None)
