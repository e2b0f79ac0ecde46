"""The draft pool's revival of a worker it marked dead, and the gRPC backend's own revival of a server, over real
gRPC on loopback (ToyWorker servers): what the revival releases there (each sequence of the life it had), how
long a worker taken back before waits (the backoff starts over once it served a while), and that neither
revival outlives close()."""
from __future__ import annotations

import threading
import time

import pytest
from test_grpc_link_keepalive import Relay, wait_until
from test_grpc_toy_worker import ToyWorker

from saguaro_dist.distributed import draft_pool, grpc_servers
from saguaro_dist.distributed.draft_pool import REVIVAL_RESET_S, DraftPool, revival_delay_s, revivals_counted
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.errors import DraftUnavailable
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest, Release

pytestmark = pytest.mark.timeout(90)
GREEDY = DraftSampling(0.0, 0, 1.0, None)


class StallingToyWorker(ToyWorker):
    """A ToyWorker whose just-in-time drafts wait while `going` is clear: its server's loop stops in them (a
    stall: the pool's draft deadline passes, the process lives on and answers at its old address after)."""

    def __init__(self):
        super().__init__()
        self.going = threading.Event()
        self.going.set()

    def jit_draft(self, reqs):
        self.going.wait(30)
        return super().jit_draft(reqs)


class RefusingToyWorker(ToyWorker):
    """A ToyWorker whose releases fail (INTERNAL) while `refusing` is set; counts the refusals."""

    def __init__(self):
        super().__init__()
        self.refusing = False
        self.refused = 0

    def release(self, reqs):
        if self.refusing:
            self.refused += 1
            raise RuntimeError("refusing releases")
        super().release(reqs)


@pytest.fixture
def stalling():
    """(worker, address) of a served StallingToyWorker."""
    worker = StallingToyWorker()
    server, port = serve_draft(worker, "127.0.0.1", 0)
    yield worker, f"127.0.0.1:{port}"
    worker.going.set()
    server.stop(None)


def _pool(address: str, revive, **kwargs) -> DraftPool:
    """One worker, a 0.5 s draft deadline (a stall marks it dead); revive(i) builds its next backend."""
    return DraftPool([GrpcDraftBackend([address], deadline_s=0.5)], max_batch_size=4, revive=revive, **kwargs)


def _at_address(address: str):
    return lambda i: GrpcDraftBackend([address], deadline_s=0.5)  # it answers where it was; a stall again: dead


def _stall_until_dead(pool: DraftPool, worker: StallingToyWorker, seq_id: int) -> None:
    """Sequence seq_id prefilled on the pool's worker, whose draft then misses the deadline: marked dead."""
    pool.prefill([PrefillRequest(seq_id, [5, 6], GREEDY)])
    worker.going.clear()
    with pytest.raises(DraftUnavailable):
        pool.jit_draft([JitDraftRequest(seq_id, 0, 0, 9)])
    assert pool.workers() == (0, 1)


def _taken_back(pool: DraftPool, worker: StallingToyWorker) -> float:
    """End the stall; seconds until the pool takes the worker back."""
    worker.going.set()
    return wait_until(lambda: pool.accepting() and pool.workers() == (1, 1), timeout_s=15.0, step_s=0.01)


def test_a_revival_releases_only_the_life_a_sequence_had_when_its_worker_was_marked_dead(stalling):
    """Sequence 1 (its first life) sits on a worker the pool marks dead. Before the revival's Release reaches the
    server, a later life of sequence 1 is there: here its old life released and a new one prefilled over the old
    backend, which stays connected until the worker is taken back. The revival must end only the life it knew
    of: the later life stays held, as a late release of an earlier life leaves it on the stream (released
    with no life named, 'any life', it was gone, and its next round a miss and a re-prefill)."""
    worker, address = stalling
    may_revive = threading.Event()
    pool = _pool(address, lambda i: may_revive.wait(30) and _at_address(address)(i))
    try:
        _stall_until_dead(pool, worker, seq_id=1)
        worker.going.set()
        old = pool.backends[0]
        old.release([Release(1)])  # on its stream: the prefill (unary) goes once the server has it
        wait_until(lambda: 1 not in worker.seqs, timeout_s=10.0, step_s=0.01)
        later = PrefillRequest(1, [7, 8], GREEDY)
        old.prefill([later])
        assert worker.seqs[1].committed == [7, 8]
        may_revive.set()
        _taken_back(pool, worker)
        assert 1 in worker.seqs and worker.seqs[1].committed == [7, 8]
    finally:
        may_revive.set()
        pool.close()


def test_a_revival_still_releases_the_life_it_knew_of(stalling):
    """The other half: what the worker held when marked dead (the same life) is released there."""
    worker, address = stalling
    pool = _pool(address, _at_address(address))
    try:
        _stall_until_dead(pool, worker, seq_id=1)
        _taken_back(pool, worker)
        assert 1 not in worker.seqs and pool.lost([1]) == [1]
    finally:
        pool.close()


def test_the_backoff_starts_over_once_a_worker_taken_back_served_a_while(stalling, monkeypatch):
    """A worker taken back backs off longer each time it is marked dead again soon after (flapping), but not
    after it served revival_reset_s: then it is taken back at once, as after its first death. Before, the count
    never fell, and a worker that served for hours waited the longest delay (30 s) at its next stall."""
    worker, address = stalling
    reset_s = 30.0  # far above any stall between a take-back and the next death (flapping must stay flapping)
    chosen, revived_at = [], []  # (each delay the reviver chose, when); when it then asked the worker back

    def delay_s(revivals: int) -> float:
        chosen.append((revival_delay_s(revivals), time.monotonic()))
        return chosen[-1][0]

    def revive(i):
        # The revival's Release gets a deadline no stall reaches (missed, it counts a revival and backs off
        # again); once taken back the worker's drafts get the 0.5 s that its stalls must miss (taken_back).
        revived_at.append(time.monotonic())
        return GrpcDraftBackend([address], deadline_s=10.0)

    def taken_back() -> None:
        _taken_back(pool, worker)
        pool.backends[0].deadline_s = 0.5

    monkeypatch.setattr(draft_pool, "revival_delay_s", delay_s)
    pool = _pool(address, revive, revival_reset_s=reset_s)
    try:
        _stall_until_dead(pool, worker, seq_id=1)
        taken_back()
        assert pool.revivals == [1]
        _stall_until_dead(pool, worker, seq_id=2)  # at once: flapping, it waits revival_delay_s(1) first
        taken_back()
        assert pool.revivals == [2]
        pool._taken_back_at[0] -= reset_s  # as if it then served reset_s in placement, no miss
        _stall_until_dead(pool, worker, seq_id=3)
        taken_back()
        assert pool.revivals == [1]
        assert [delay for delay, _ in chosen] == [0.0, revival_delay_s(1), 0.0]
        # each delay waited out (measured on the reviver's side: a stall only lengthens it)
        assert all(asked - at >= delay - 0.01 for (delay, at), asked in zip(chosen, revived_at, strict=True))
    finally:
        pool.close()


def test_revivals_counted_forgets_them_after_the_reset_time():
    assert revivals_counted(5, None) == 5  # never taken back
    assert revivals_counted(5, REVIVAL_RESET_S - 1.0) == 5
    assert revivals_counted(5, REVIVAL_RESET_S) == 0
    assert revivals_counted(3, 2.0, reset_s=1.0) == 0
    with pytest.raises(ValueError, match="revival_reset_s"):
        DraftPool([], max_batch_size=1, revival_reset_s=-1.0)


def _revival_threads(i: int) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"saguaro-revive-{i}"]


def test_close_ends_a_revival_waiting_out_its_backoff_and_revives_nothing_after(stalling):
    """A worker marked dead after many revivals waits up to 30 s before it is asked back. close() must end that
    wait: before, the thread slept on, then revived the worker of a closed pool (a Ray actor asked again, a
    backend built and closed)."""
    worker, address = stalling
    asked = []
    pool = _pool(address, lambda i: asked.append(i) or _at_address(address)(i))
    try:
        pool.revivals[0] = 5  # revival_delay_s(5) = 16 s
        _stall_until_dead(pool, worker, seq_id=1)
        worker.going.set()
        assert _revival_threads(0)
    finally:
        pool.close()
    wait_until(lambda: not _revival_threads(0), timeout_s=8.0, step_s=0.01)  # half the backoff close() must end
    assert asked == []


def test_a_backend_revived_after_close_is_closed_not_queued(stalling):
    """A revival that returns a backend while the pool closes closes it (nobody would take it back)."""
    worker, address = stalling
    reviving, may_return, built = threading.Event(), threading.Event(), []

    def revive(i):
        reviving.set()
        may_return.wait(30)
        built.append(_at_address(address)(i))
        return built[-1]

    pool = _pool(address, revive)
    try:
        _stall_until_dead(pool, worker, seq_id=1)
        worker.going.set()
        assert reviving.wait(10)
    finally:
        pool.close()
    may_return.set()
    wait_until(lambda: not _revival_threads(0), timeout_s=15.0, step_s=0.01)
    assert built and built[0]._closed and pool._revived.empty()


def test_closing_a_backend_whose_server_refuses_the_revival_does_not_wait_out_the_poll(monkeypatch):
    """The backend's own revival: its server came back but refuses the Release (asked again after REVIVE_POLL_S).
    The pool closes such a backend on the engine's thread when it takes a new one for that worker: close() must
    end the reviver's pause at once, not block the engine for up to REVIVE_POLL_S."""
    poll_s = 30.0  # far above any stall of close(): waiting the pause out, it would fail
    monkeypatch.setattr(grpc_servers, "REVIVE_POLL_S", poll_s)
    worker = RefusingToyWorker()
    server, port = serve_draft(worker, "127.0.0.1", 0)
    relay = Relay(port)
    backend = GrpcDraftBackend([f"127.0.0.1:{relay.port}"], deadline_s=5.0)
    try:
        backend.prefill([PrefillRequest(1, [5, 6], GREEDY)])
        worker.refusing = True
        relay.cut()
        wait_until(lambda: backend.dead_addresses, timeout_s=10.0)
        relay.reopen()
        wait_until(lambda: worker.refused, timeout_s=15.0, step_s=0.005)
        time.sleep(0.05)  # the reviver has read the refusal: it pauses now
        start = time.monotonic()
        backend.close()
        assert time.monotonic() - start < poll_s / 3
        assert not [t for t in threading.enumerate() if t.name == f"saguaro-revive-127.0.0.1:{relay.port}"]
    finally:
        backend.close()
        relay.close()
        server.stop(None)
