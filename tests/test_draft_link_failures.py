"""Draft-side failures that cost speed and must stay contained: one sequence the draft refuses, a just-in-time
draft that fails during two-cohort rounds, a release lost with a failed Speculate stream, an answer of the wrong
size. Real DraftService servers on loopback (ToyWorker, or the real draft under the real SSD engine); greedy
output stays the target's own."""
from __future__ import annotations

import logging
import threading
import time

import pytest
from engine_helpers import PROMPTS, assert_greedy_equal, close_pair, hf_greedy, wait_for
from test_draft_failure_in_process import FailingOnce
from test_grpc_link_keepalive import Relay
from test_grpc_reconnect import BACK_WITHIN_S
from test_grpc_toy_worker import ToyWorker

from saguaro_dist.config import Config
from saguaro_dist.distributed.draft_pool import DraftPool
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.errors import DraftOutOfSync, DraftRpcError, DraftUnavailable
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.build import build_draft_worker, make_runner
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.engine import Engine
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Release
from saguaro_dist.engine.sd_loop import PREFILL_TRIES
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.engine.split_draft import SplitDraftBackend
from saguaro_dist.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)
GREEDY = DraftSampling(0.0, 0, 1.0, None)
REFUSED = 77  # a prompt holding this id is one the draft cannot take (RefusingPrompts)
STREAM_ENDED = "Speculate stream to"  # grpc_servers' warning when a stream ends and is reopened


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("draft_link_pair"))


@pytest.fixture
def served():
    """start(worker) -> a GrpcDraftBackend over a server running it; all closed after the test."""
    opened = []

    def start(worker, deadline_s: float = 5.0) -> GrpcDraftBackend:
        server, port = serve_draft(worker, "127.0.0.1", 0)
        backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=deadline_s)
        opened.append((server, backend))
        return backend
    yield start
    for server, backend in opened:
        backend.close()
        server.stop(None)


class RefusingPrompts:
    """worker.prefill refuses a batch holding a prompt with REFUSED in it, as the draft refuses a request it cannot
    take (an id outside a draft's own vocabulary, say): the DraftWorker's ValueError, INVALID_ARGUMENT on the wire.
    Counts each sequence's prefills."""

    def __init__(self, worker):
        self.prefills: dict[int, int] = {}
        self._real = worker.prefill
        worker.prefill = self

    def __call__(self, reqs):
        for r in reqs:
            self.prefills[r.seq_id] = self.prefills.get(r.seq_id, 0) + 1
        if any(REFUSED in r.prompt_token_ids for r in reqs):
            raise ValueError("a prompt id this draft cannot take")
        return self._real(reqs)


def run_engine(config: Config, worker, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The real SSD engine over a DraftPool of one gRPC server running `worker`; each request's output."""
    server, port = serve_draft(worker, "127.0.0.1", 0)
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=20.0)], max_batch_size=config.max_batch_size)
    engine = Engine(config, make_runner(config.model, config), pool, None, set())
    try:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        seqs = [Sequence(i, str(i), list(p), params) for i, p in enumerate(prompts)]
        for s in seqs:
            engine.add(s)
        while engine.running or engine.waiting or engine.prefilling:
            assert all(u.error is None for u in engine.step())
        return [s.output_token_ids for s in seqs]
    finally:
        engine.close()
        server.stop(None)


def stream_ends(caplog) -> int:
    return sum(STREAM_ENDED in r.getMessage() for r in caplog.records)


# ---- one sequence the draft refuses -------------------------------------------------------------------------

def test_a_sequence_the_draft_refuses_leaves_the_others_speculating(pair, caplog):
    """Old: the batch's one error marked every sequence prefilled with it lost; each round re-sent them together,
    failing every time (the healthy ones never drafted again), and the refused sequence's outcomes, still placed
    on the server, ended its Speculate stream (NOT_FOUND) for all. Now the refused one alone goes on without a
    draft, asked once more on its own; the others keep their one prefill; no stream ends."""
    caplog.set_level(logging.WARNING)
    config = Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6, draft_threads=1,
                    max_batch_size=3)
    worker = build_draft_worker(config)
    refusing = RefusingPrompts(worker)
    prompts = [PROMPTS[0], [5, REFUSED, 9], PROMPTS[1]]
    outputs = run_engine(config, worker, prompts, tokens=20)
    for got, prompt in zip(outputs, prompts):
        assert_greedy_equal(got, hf_greedy(pair["model"], prompt, 20), prompt, pair["model"])
    # the refused one: in its batch, then alone, never again; the others at most once more (alone)
    assert refusing.prefills[1] == 2 and refusing.prefills[0] <= 2 and refusing.prefills[2] <= 2, refusing.prefills
    assert stream_ends(caplog) == 0


def test_a_draft_that_fails_once_in_cohort_rounds_ends_no_stream(pair, caplog):
    """Old: the sequences re-prefilled after the failure took the fast backup with their earlier life's round
    number (and the draft asked of that life, landed): the server answered OutOfOrder, which ended the Speculate
    stream, every sequence on it prefilled again, again and again (7 streams ended in 60 tokens)."""
    caplog.set_level(logging.WARNING)
    config = Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6, draft_threads=1,
                    max_batch_size=4, tree_policy="never", jit_cohorts=2)
    worker = build_draft_worker(config)
    failing = FailingOnce(worker, "jit_draft", 3, RuntimeError("one transient draft failure"))
    prompts = [list(PROMPTS[i]) + [i + 1] for i in range(4)]
    outputs = run_engine(config, worker, prompts, tokens=40)
    for got, prompt in zip(outputs, prompts):
        assert_greedy_equal(got, hf_greedy(pair["model"], prompt, 40), prompt, pair["model"])
    assert failing.calls > 3  # it failed, and drafted again after
    assert stream_ends(caplog) == 0


# ---- the gRPC backend ---------------------------------------------------------------------------------------

class Refusing(ToyWorker):
    def prefill(self, reqs):
        if any(REFUSED in r.prompt_token_ids for r in reqs):
            raise ValueError("a prompt id this draft cannot take")
        return super().prefill(reqs)


def test_a_refused_prefill_leaves_the_sequence_held_nowhere(served, caplog):
    """Old: the refused sequence kept its owner: lost() said it was held, its outcomes went to the server, whose
    NOT_FOUND ended the stream, and the healthy sequence on it fell out of sync (prefilled again)."""
    caplog.set_level(logging.WARNING)
    worker = Refusing()
    backend = served(worker)
    backend.prefill([PrefillRequest(1, [5, 6], GREEDY)])
    backend.jit_draft([JitDraftRequest(1, 0, 0, 9)])
    with pytest.raises(DraftRpcError, match="INVALID_ARGUMENT"):
        backend.prefill([PrefillRequest(2, [5, REFUSED], GREEDY)])
    assert backend.lost([2]) == [2] and backend.owner_of(2) is None
    backend.send_outcomes([Outcome(2, 0, 0, 9, next_tokens=[1, 2, 3])])  # the fast backup's, of a lost sequence
    backend.jit_draft([JitDraftRequest(1, 1, 0, 4)])  # answered on the same stream, after that outcome
    assert backend.lost([1]) == [] and stream_ends(caplog) == 0
    assert sorted(worker.seqs) == [1]


class SlowToy(ToyWorker):
    """A busy draft worker (each outcome batch takes a while), whose prefill restarts a sequence it holds (as the
    DraftWorker's does: the target moved it)."""

    def observe(self, outcomes):
        time.sleep(0.2)
        return super().observe(outcomes)

    def prefill(self, reqs):
        super().release([Release(r.seq_id) for r in reqs if r.seq_id in self.seqs])
        return super().prefill(reqs)


def _fail_the_stream_with_a_release_behind(backend) -> None:
    """Sequences 1 and 2 prefilled and drafted; an outcome the server refuses (a wrong round) ends the stream, and
    the release of 2 queued right behind it is never read there."""
    backend.prefill([PrefillRequest(1, [5, 6], GREEDY), PrefillRequest(2, [5, 6], GREEDY)])
    backend.jit_draft([JitDraftRequest(1, 0, 0, 9), JitDraftRequest(2, 0, 0, 9)])
    backend.send_outcomes([Outcome(1, 7, 0, 3, next_tokens=None)])
    backend.release([Release(2)])


def test_a_release_lost_with_a_failed_stream_is_sent_again(served):
    """Old: release() forgot the owner at once and the failed stream dropped the queued release: the server held
    sequence 2 (its state, its KV) until it restarted."""
    worker = SlowToy()
    backend = served(worker)
    _fail_the_stream_with_a_release_behind(backend)
    wait_for(lambda: 2 not in worker.seqs)
    assert backend.lost([1]) == [1]  # its outcomes died with the stream: prefilled again


def test_a_release_sent_again_leaves_a_later_life_of_its_sequence_alone(served):
    """The release sent again names the life it ended: sequence 2, prefilled again meanwhile (a new life under
    the same id), is kept on the server, whichever reaches it first."""
    worker = SlowToy()
    backend = served(worker)
    link = backend._links[0]
    first_stream = link.call
    _fail_the_stream_with_a_release_behind(backend)
    backend.prefill([PrefillRequest(2, [7, 8], GREEDY)])  # read by the server once the failing outcome is done
    wait_for(lambda: link.call is not first_stream)  # reopened: the release went out again first
    backend.prefill([PrefillRequest(3, [5, 6], GREEDY)])
    backend.jit_draft([JitDraftRequest(3, 0, 0, 9)])  # answered once the server read what came before it
    assert worker.seqs[2].committed == [7, 8]


def test_a_release_lost_with_a_dead_connection_is_made_when_the_server_is_taken_back():
    """The connection dies with the release unread (its bytes lost on the way); the process lives on. Old: the
    reviver released only what was still placed there, and the server kept sequence 2 for good."""
    worker = ToyWorker()
    server, port = serve_draft(worker, "127.0.0.1", 0)
    relay = Relay(port)
    backend = GrpcDraftBackend([f"127.0.0.1:{relay.port}"], deadline_s=5.0)
    try:
        backend.prefill([PrefillRequest(s, [5, 6], GREEDY) for s in (1, 2)])
        backend.jit_draft([JitDraftRequest(s, 0, 0, 9) for s in (1, 2)])
        relay.silent()  # what goes out now is lost on the way
        backend.release([Release(2)])
        relay.cut()
        wait_for(lambda: backend.dead_addresses != [])
        relay.quiet = False
        relay.reopen()
        wait_for(lambda: backend.dead_addresses == [], within_s=BACK_WITHIN_S)
        assert worker.seqs == {}  # 1 as placed there when it died (out of sync: prefilled again), 2 as released
    finally:
        backend.close()
        relay.close()
        server.stop(None)


class ShortAnswers(ToyWorker):
    """A buggy or mismatched peer: one proposal fewer than the sequences asked."""

    def jit_draft(self, reqs):
        return super().jit_draft(reqs)[:-1]


def test_an_answer_of_the_wrong_size_costs_its_server_s_drafts_only(served):
    """Old: the backend zipped the short answer (one sequence dropped silently, then a bare KeyError), which the
    pool does not catch: the healthy server's drafts were lost with it."""
    short, healthy = served(ShortAnswers()), served(ToyWorker())
    pool = DraftPool([short, healthy], max_batch_size=2)
    try:
        pool.prefill([PrefillRequest(s, [5, 6], GREEDY) for s in (1, 2)])  # one sequence per server
        on_short = next(s for s in (1, 2) if pool.groups[s] == [0])
        with pytest.raises(DraftUnavailable) as caught:
            pool.jit_draft([JitDraftRequest(s, 0, 0, 9) for s in (1, 2)])
        assert caught.value.seq_ids == [on_short] and list(caught.value.partial) == [3 - on_short]
        assert pool.lost([1, 2]) == [on_short] and not pool.dead  # prefilled again; the server stays in the pool
    finally:
        pool.close()


# ---- the draft worker ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["extend", "duplicate id"])
def test_a_prefill_that_fails_part_way_holds_none_of_its_sequences(pair, fault):
    """The target takes a refused prefill for sequences the draft does not hold (and never releases them). Old: a
    forward that failed (out of memory) left them held, state and KV; an id twice in a batch left the first one's
    KV row taken, and every later prefill of that id failed ("already exists")."""
    worker = build_draft_worker(Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, draft_threads=1))
    batch = [PrefillRequest(7, [5, 6, 7], GREEDY), PrefillRequest(8 if fault == "extend" else 7, [5, 9], GREEDY)]
    if fault == "extend":
        FailingOnce(worker.runner, "extend", 1, MemoryError("no room for the batch's KV"))
    with pytest.raises((MemoryError, ValueError)):
        worker.prefill(batch)
    assert worker.seqs == {} and worker.lives.of(7) == 0
    worker.prefill([PrefillRequest(7, [5, 6, 7], GREEDY)])  # the same id, taken afresh
    assert sorted(worker.seqs) == [7] and worker.runner.length(7) == 3


# ---- a draft failure that may pass (out of memory, INTERNAL) is not a refusal -----------------------------------

class FailingPrefills:
    """worker.prefill fails (RuntimeError: INTERNAL on the wire, as a CUDA out-of-memory error) its first `first`
    calls, and every batch holding a prompt with REFUSED in it; counts each sequence's prefills and records those
    it took."""

    def __init__(self, worker, first: int = 0):
        self.calls, self.first, self.took, self.prefills = 0, first, set(), {}
        self._real = worker.prefill
        worker.prefill = self

    def __call__(self, reqs):
        self.calls += 1
        for r in reqs:
            self.prefills[r.seq_id] = self.prefills.get(r.seq_id, 0) + 1
        if self.calls <= self.first or any(REFUSED in r.prompt_token_ids for r in reqs):
            raise RuntimeError("CUDA out of memory (a failure that may pass)")
        self._real(reqs)
        self.took.update(r.seq_id for r in reqs)


def test_a_draft_failure_of_a_moment_at_admission_costs_no_sequence_its_draft(pair):
    """Old: every error but DraftUnavailable counted as the sequence's own: the batch's sequences were retried
    alone at once, in the same step, and the one whose retry the same moment's failure hit went draftless for
    life. Now a failure that may pass leaves them lost, prefilled again on a later round."""
    config = Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6, draft_threads=1,
                    max_batch_size=4)
    worker = build_draft_worker(config)
    failing = FailingPrefills(worker, first=2)  # the admission's batch, and the next try
    prompts = [list(PROMPTS[i]) + [i + 1] for i in range(4)]
    outputs = run_engine(config, worker, prompts, tokens=24)
    for got, prompt in zip(outputs, prompts):
        assert_greedy_equal(got, hf_greedy(pair["model"], prompt, 24), prompt, pair["model"])
    assert failing.took == {0, 1, 2, 3}, failing.prefills


def test_a_sequence_whose_draft_prefill_keeps_failing_goes_without_a_draft_alone(pair):
    """A failure that may pass but does not (here one sequence's, every time): prefilled again at most
    PREFILL_TRIES times with its batch, then once alone; then it goes on without a draft, the others with theirs."""
    config = Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6, draft_threads=1,
                    max_batch_size=3)
    worker = build_draft_worker(config)
    failing = FailingPrefills(worker)
    prompts = [PROMPTS[0], [5, REFUSED, 9], PROMPTS[1]]
    outputs = run_engine(config, worker, prompts, tokens=20)
    for got, prompt in zip(outputs, prompts):
        assert_greedy_equal(got, hf_greedy(pair["model"], prompt, 20), prompt, pair["model"])
    assert failing.prefills[1] <= PREFILL_TRIES + 1 and failing.took == {0, 2}, failing.prefills


def test_a_tree_side_that_refuses_a_sequence_leaves_it_its_just_in_time_drafts(pair):
    """The split executor: old, the tree side's refusal failed the prefill, and the engine took the sequence off
    the draft for good, though the thread's half held it. Now a batch is refused whole (the engine then prefills
    each alone), and one refused alone is drafted here, without trees, never reported lost."""
    config = Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6, draft_threads=1)
    tree_worker = build_draft_worker(config)
    RefusingPrompts(tree_worker)
    server, port = serve_draft(tree_worker, "127.0.0.1", 0)
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)], max_batch_size=4)
    split = SplitDraftBackend(LocalDraftBackend(build_draft_worker(config)), pool)
    seen_all = LocalDraftBackend(build_draft_worker(config))
    try:
        batch = [PrefillRequest(1, list(PROMPTS[0]), GREEDY), PrefillRequest(2, [5, REFUSED, 9], GREEDY)]
        with pytest.raises(ValueError):
            split.prefill(batch)
        for r in batch:
            split.prefill([r])
        seen_all.prefill(batch)
        assert split.lost([1, 2]) == []
        reqs = [JitDraftRequest(1, 0, 0, 9), JitDraftRequest(2, 0, 0, 9)]
        got = split.start_jit_draft(reqs).result()
        assert [p.tokens.tolist() for p in got] == [p.tokens.tolist() for p in seen_all.jit_draft(reqs)]
        assert split.lost([1, 2]) == []
    finally:
        split.close()
        seen_all.close()
        server.stop(None)


# ---- a prefix copy that fails, a stale answer, releases in flight, a pool's refused parts ---------------------

def test_a_prefill_whose_prefix_copy_fails_holds_none_of_its_sequence(pair):
    """Old: PrefixCache.start added the row, then the copy failed (out of room): the row stayed taken and every
    later prefill of that id failed ("sequence 2 already exists")."""
    worker = build_draft_worker(Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, draft_threads=1))
    prompt = list(range(1, 40))
    worker.prefill([PrefillRequest(1, prompt, GREEDY)])  # a live source of the prefix
    FailingOnce(worker.runner, "copy_prefix", 1, MemoryError("no room to copy the prefix"))
    with pytest.raises(MemoryError):
        worker.prefill([PrefillRequest(2, prompt + [50], GREEDY)])
    assert sorted(worker.seqs) == [1]
    worker.prefill([PrefillRequest(2, prompt + [50], GREEDY)])  # the same id, taken afresh
    assert sorted(worker.seqs) == [1, 2] and worker.runner.length(2) == len(prompt) + 1


def test_a_lost_stream_s_answer_taken_after_a_re_prefill_leaves_the_new_life_in_sync(served):
    """Old: the draft asked of the old life failed with its stream; the engine re-prefilled the sequence (a new
    life, in sync) before it took that answer, which then marked the new life out of sync: one more prefill and a
    round of the fast backup each time."""
    backend = served(SlowToy())
    link = backend._links[0]
    first_stream = link.call
    backend.prefill([PrefillRequest(1, [5, 6], GREEDY)])
    backend.jit_draft([JitDraftRequest(1, 0, 0, 9)])
    backend.send_outcomes([Outcome(1, 7, 0, 3, next_tokens=None)])  # a wrong round: the server ends the stream
    pending = backend.start_jit_draft([JitDraftRequest(1, 1, 0, 4)])  # in flight, lost with the stream
    wait_for(lambda: link.call is not first_stream)
    backend.prefill([PrefillRequest(1, [5, 6, 9, 4], GREEDY)])  # the engine's _readmit: a new life
    with pytest.raises(DraftOutOfSync):
        pending.result()
    assert backend.lost([1]) == []


def test_releases_moved_to_a_dead_server_s_reviver_are_always_in_sight():
    """unconfirmed_releases (what the pool releases again on a revived worker) read the dead servers' owed
    releases, then the links' lists. Old: a reader thread marking a server dead in between had taken them from
    the link, not yet put them in _owed: lost, the server kept those sequences. Now they move under one lock."""
    server, port = serve_draft(ToyWorker(), "127.0.0.1", 0)
    backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=5.0)
    link, seen, readers = backend._links[0], [], []
    real_end_stream = link.end_stream

    def end_stream():  # read them from another thread right as they leave the link
        link.end_stream = real_end_stream
        unconfirmed = real_end_stream()
        readers.append(threading.Thread(target=lambda: seen.extend(backend.unconfirmed_releases())))
        readers[0].start()
        readers[0].join(1.0)  # old: done at once; now it waits for the move to finish
        return unconfirmed
    link.end_stream = end_stream
    try:
        backend.prefill([PrefillRequest(s, [5, 6], GREEDY) for s in (1, 2)])
        backend.release([Release(2)])  # on the stream, no answer after it: unconfirmed
        server.stop(None)
        wait_for(lambda: readers and not readers[0].is_alive())
        assert [r.seq_id for r in seen] == [2]
    finally:
        backend.close()


def test_a_pool_takes_every_worker_s_prefill_even_after_one_refused(served):
    """Old: DraftPool stopped at the first worker that refused; another's refusal was never taken, and its backend
    kept the sequence placed there (said held, its outcomes sent to a server that holds none of it)."""
    first, second = served(Refusing()), served(Refusing())
    pool = DraftPool([first, second], max_batch_size=2)
    try:
        with pytest.raises(DraftRpcError, match="INVALID_ARGUMENT"):
            pool.prefill([PrefillRequest(s, [5, REFUSED], GREEDY) for s in (1, 2)])  # one sequence per server
        assert first.owner_of(1) is None and second.owner_of(2) is None
        assert pool.lost([1, 2]) == [1, 2]
    finally:
        pool.close()
