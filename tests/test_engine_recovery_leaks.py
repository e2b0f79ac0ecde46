"""The engine's failure-recovery path frees every KV row: a release that fails (a draft gone) or a start whose
prefix copy fails leaves no row held by nobody, and a request that completed is told so, not failed.
The faults are injected by making one real method fail once (the fault, not a stand-in for a part)."""
from __future__ import annotations

import queue

import pytest

from engine_helpers import PROMPTS, assert_greedy_equal, close_pair
from saguaro_dist import SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_local_engine
from saguaro_dist.engine.engine import ReleaseError, Update
from saguaro_dist.engine.loop_thread import EngineError, EngineThread
from saguaro_dist.engine.sequence import FinishReason, Sequence

LONG = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)  # still running when the fault comes


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("recovery_pair"))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def fail_once(obj, name: str) -> None:
    """obj.name raises on its next call, then is itself again."""
    real = getattr(obj, name)

    def failing(*args, **kwargs):
        setattr(obj, name, real)
        raise RuntimeError(f"injected: {name} failed")
    setattr(obj, name, failing)


def run_all(engine, seqs: list[Sequence]) -> list[list[int]]:
    for s in seqs:
        engine.add(s)
    while engine.has_work():
        engine.step()
    return [s.output_token_ids for s in seqs]


def ar_tokens(pair, prompt: list[int], n: int) -> list[int]:
    engine, _ = build_local_engine(Config(model=pair["target"], mode="ar"))
    try:
        return run_all(engine, [Sequence(0, "ref", prompt, greedy(n))])[0]
    finally:
        engine.close()


class Reader:
    """One request's listener: its tokens, and how it ended (its last Update, or the error it got)."""

    def __init__(self):
        self.items: queue.Queue = queue.Queue()
        self.tokens: list[int] = []

    def __call__(self, item) -> None:
        self.items.put(item)

    def next(self):
        item = self.items.get(timeout=60)
        if isinstance(item, Update):
            self.tokens += item.token_delta
        return item

    def end(self):
        item = self.next()
        while isinstance(item, Update) and not item.finished:
            item = self.next()
        return item


def assert_nothing_held(engine, draft_lost: set[int]) -> None:
    """Every request is gone: after reset_prefix_cache no target row is held, no namespace kept, and the draft
    holds only draft_lost (the sequences whose draft release the fault dropped). (Called after EngineThread.stop,
    whose draft shutdown runs the draft's queued calls first.)"""
    runner = engine.target.runner
    assert not runner._seqs and runner.spare_rows() == runner.pool.rows, list(runner._seqs)
    assert not engine.target.prefixes.namespaces
    worker = engine.draft.worker
    assert set(worker.seqs) == set(worker.runner._seqs) == draft_lost, (list(worker.seqs), list(worker.runner._seqs))


def reset_and_drain(thread: EngineThread) -> None:
    """reset_prefix_cache, then wait until the draft's thread ran every call queued before (its release of the last
    request, the reset): EngineThread.stop closes the draft, which cancels calls still queued, and their rows would
    read as leaked."""
    thread.reset_prefix_cache()
    thread.engine.draft.submit(lambda _: None, None).result(timeout=60)


def serve_after_recovery(pair, thread: EngineThread) -> None:
    """The engine serves a new request, exactly (greedy = mode ar)."""
    c = Reader()
    thread.submit(Sequence(7, "c", PROMPTS[2], greedy(12)), c)
    end = c.end()
    assert isinstance(end, Update) and end.seq.finish_reason is FinishReason.LENGTH
    assert_greedy_equal(c.tokens, ar_tokens(pair, PROMPTS[2], 12), PROMPTS[2], pair["model"])


def sd_thread(pair, **config) -> EngineThread:
    engine, _ = build_local_engine(Config(model=pair["target"], draft=pair["close"], mode="sd", k=3, max_batch_size=2,
                                          **config))
    return EngineThread(engine)


def test_an_abort_whose_draft_release_fails_frees_every_other_row(pair):
    thread = sd_thread(pair)
    try:
        fail_once(thread.engine.draft, "release")  # the target's side of the release went first
        a, b = Reader(), Reader()
        thread.submit_many([(Sequence(0, "a", PROMPTS[0], LONG), a), (Sequence(1, "b", PROMPTS[1], LONG), b)])
        a.next(), b.next()  # both running
        thread.abort("a")
        # a failed abort is a failed step's case: the engine recovered, every request in flight failed
        assert isinstance(a.end(), EngineError) and isinstance(b.end(), EngineError)
        serve_after_recovery(pair, thread)
        reset_and_drain(thread)
    finally:
        thread.stop()
    assert_nothing_held(thread.engine, draft_lost={0})


def test_a_request_that_finished_is_delivered_though_its_release_fails(pair):
    thread = sd_thread(pair)
    try:
        fail_once(thread.engine.draft, "release")
        a, b = Reader(), Reader()
        thread.submit_many([(Sequence(0, "a", PROMPTS[0], greedy(40)), a), (Sequence(1, "b", PROMPTS[1], LONG), b)])
        end_a, end_b = a.end(), b.end()
        assert isinstance(end_a, Update) and end_a.seq.finish_reason is FinishReason.LENGTH, end_a
        assert_greedy_equal(a.tokens, ar_tokens(pair, PROMPTS[0], 40), PROMPTS[0], pair["model"])
        assert isinstance(end_b, EngineError)
        serve_after_recovery(pair, thread)
        reset_and_drain(thread)
    finally:
        thread.stop()
    assert_nothing_held(thread.engine, draft_lost={0})


def test_reset_frees_each_sequence_though_one_release_fails(pair):
    """reset: one sequence's failed release keeps neither the others' rows nor the kept prefixes."""
    engine, _ = build_local_engine(Config(model=pair["target"], draft=pair["close"], mode="sd", k=3, max_batch_size=3))
    try:
        kept = list(range(30, 50))  # a finished request's row stays, a kept prefix
        run_all(engine, [Sequence(0, "kept", kept, greedy(3))])
        assert engine.target.prefixes.entries
        seqs = [Sequence(i, f"r{i}", PROMPTS[i], LONG) for i in (1, 2, 3)]
        for s in seqs:
            engine.add(s)
        engine.step()
        fail_once(engine.target, "release")
        engine.reset()
        assert not engine.has_work() and not engine.target.prefixes.entries
        # the failed one's row (its release never ran) is all that is left
        assert set(engine.target.runner._seqs) == {seqs[0].seq_id}
        engine.target.runner.free(seqs[0].seq_id)
        [again] = run_all(engine, [Sequence(9, "again", PROMPTS[2], greedy(12))])
        assert_greedy_equal(again, ar_tokens(pair, PROMPTS[2], 12), PROMPTS[2], pair["model"])
    finally:
        engine.close()


def test_a_release_that_fails_part_way_frees_the_rest_one_by_one(pair):
    """Three requests finish in one step and the first one's release fails: the step's updates still come (on
    ReleaseError), and the others' rows are freed one at a time, the failed one's tried once more."""
    engine, _ = build_local_engine(Config(model=pair["target"], mode="ar", max_batch_size=3))
    try:
        seqs = [Sequence(i, f"r{i}", PROMPTS[i], greedy(3)) for i in (0, 1, 2)]
        for s in seqs:
            engine.add(s)
        engine.step()  # prefill and one round: two tokens each
        assert not any(s.finished for s in seqs)
        fail_once(engine.target, "release")
        with pytest.raises(ReleaseError) as failed:
            engine.step()
        assert {u.seq.request_id for u in failed.value.updates if u.finished} == {"r0", "r1", "r2"}
        assert not engine.has_work() and not engine.target.runner._seqs
        for s in seqs:
            assert s.output_token_ids == ar_tokens(pair, s.prompt_token_ids, 3)
    finally:
        engine.close()


def test_a_start_whose_prefix_copy_fails_holds_nothing_and_keeps_the_queue(pair):
    """The prefix copy of a starting request fails: it holds no row, and it and the request deferred before it
    (a prefix it shares is still being prefilled) wait again, in their order; the engine goes on exactly."""
    engine, _ = build_local_engine(Config(model=pair["target"], draft=pair["close"], mode="sd", k=3, max_batch_size=4,
                                          max_num_batched_tokens=8))
    try:
        kept, long = list(range(30, 54)), list(range(1, 41))
        run_all(engine, [Sequence(0, "kept", kept, greedy(2))])
        first = Sequence(1, "long", long, greedy(5))
        engine.add(first)
        engine.step()  # its first 8 prompt tokens: it stays prefilling
        deferred, copying = Sequence(2, "deferred", long[:30] + [7], greedy(5)), Sequence(3, "copying", kept + [9], greedy(5))
        engine.add(deferred), engine.add(copying)
        fail_once(engine.target.runner, "copy_prefix")
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
        assert list(engine.waiting) == [deferred, copying]
        assert copying.seq_id not in engine.target.runner._seqs
        assert copying.seq_id not in engine.target.prefixes.namespaces
        while engine.has_work():
            engine.step()
        for s in (first, deferred, copying):
            assert_greedy_equal(s.output_token_ids, ar_tokens(pair, s.prompt_token_ids, 5), s.prompt_token_ids,
                                pair["model"])
        engine.reset_prefix_cache()
        assert not engine.target.runner._seqs and not engine.target.prefixes.namespaces
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_a_target_release_failing_part_way_still_frees_every_draft_side(pair, mode):
    """Three requests finish in one step and the target's second release fails: the loop's draft side runs for all
    three anyway (before, the first's draft row stayed on the draft worker for good: its target row was freed, so
    the engine's retry skipped it, and the draft release came after the target's), and no draft side twice."""
    thread = EngineThread(build_local_engine(Config(model=pair["target"], draft=pair["close"], mode=mode, k=3,
                                                    max_batch_size=3, draft_executor="thread"))[0])
    engine = thread.engine
    real, calls = engine.target.release, []

    def second_fails(s):
        calls.append(s.seq_id)
        if len(calls) == 2:
            raise RuntimeError("injected: the target's second release failed")
        return real(s)
    engine.target.release = second_fails
    readers = [Reader() for _ in range(3)]
    thread.submit_many([(Sequence(i, f"r{i}", PROMPTS[i], greedy(1)), readers[i]) for i in range(3)])
    ends = [r.end() for r in readers]
    assert all(isinstance(e, Update) and e.finished for e in ends), ends
    engine.target.release = real
    reset_and_drain(thread)
    thread.stop()
    assert_nothing_held(engine, draft_lost=set())
