"""GrpcDraftBackend against real DraftService servers on 127.0.0.1 (ToyWorker inside, see
tests/test_grpc_toy_worker.py): the pool, pushed trees, deadlines, and a server killed mid-stream."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from saguaro_dist.distributed import codec, draft_service
from saguaro_dist.distributed.draft_pool import DraftPool
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.errors import DraftOutOfSync, DraftUnavailable, OutOfOrder, UnknownSequence
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.distributed.grpc_link import CLOSE, HANDOFF_S, Link, Outbox, await_sent
from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.engine.messages import (DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Proposal,
                                          Release, ResetPrefixCache, SpeculationTree)
from test_grpc_toy_worker import K, ToyWorker, expected_branch, toy_tokens

pytestmark = pytest.mark.timeout(60)
HERE = pathlib.Path(__file__).resolve().parent
GREEDY = DraftSampling(0.0, 0, 1.0, None)


@pytest.fixture
def pool():
    workers = [ToyWorker(), ToyWorker()]
    servers = [serve_draft(w, "127.0.0.1", 0) for w in workers]
    backend = GrpcDraftBackend([f"127.0.0.1:{port}" for _, port in servers], deadline_s=5.0)
    yield backend, workers
    backend.close()
    for server, _ in servers:
        server.stop(None)


def _start(backend, seq_ids, prompt=(5, 6), bonus=9):
    backend.prefill([PrefillRequest(s, list(prompt), GREEDY) for s in seq_ids])
    return backend.jit_draft([JitDraftRequest(s, 0, 0, bonus) for s in seq_ids])


def test_pool_round_robin_jit_and_pushed_trees(pool):
    backend, workers = pool
    proposals = _start(backend, [10, 11, 12, 13])
    assert [backend.owner_of(s) for s in (10, 11, 12, 13)] == [backend.addresses[0], backend.addresses[1]] * 2
    assert sorted(workers[0].seqs) == [10, 12] and sorted(workers[1].seqs) == [11, 13]
    assert all(p.tokens.tolist() == toy_tokens([5, 6, 9]) for p in proposals)
    trees = backend.wait_trees([(s, 0) for s in (10, 11, 12, 13)], timeout_s=5.0)
    assert sorted(trees) == [10, 11, 12, 13] and all(t.num_branches == K + 1 for t in trees.values())
    spec = proposals[0].tokens.tolist()
    bonus, tokens = expected_branch([5, 6, 9], spec, 2)
    backend.send_outcomes([Outcome(s, 0, 2, bonus, None) for s in (10, 11, 12, 13)])  # hits
    nxt = backend.wait_trees([(s, 1) for s in (10, 11, 12, 13)], timeout_s=5.0)
    assert sorted(nxt) == [10, 11, 12, 13]
    assert all(w.seqs[s].speculation == tokens for w in workers for s in w.seqs)


def test_wait_trees_times_out_gracefully(pool):
    backend, workers = pool
    _start(backend, [1])
    start = time.monotonic()
    assert backend.wait_trees([(1, 5)], timeout_s=0.3) == {}  # a round that never comes
    assert 0.25 <= time.monotonic() - start < 2.0
    workers[0].build_delay_s = 0.5  # a late tree: not there by the deadline, there afterwards
    backend.send_outcomes([Outcome(1, 0, 0, 3, [7, 8, 9])])
    assert backend.wait_trees([(1, 1)], timeout_s=0.05) == {}
    assert list(backend.wait_trees([(1, 1)], timeout_s=5.0)) == [1]


def test_worker_errors_come_back_as_the_same_exceptions(pool):
    backend, _ = pool
    _start(backend, [1])
    with pytest.raises(UnknownSequence):
        backend.jit_draft([JitDraftRequest(99, 0, 0, 1)])
    with pytest.raises(OutOfOrder):
        backend.jit_draft([JitDraftRequest(1, 7, 0, 1)])
    with pytest.raises(OutOfOrder):
        backend.prefill([PrefillRequest(1, [1], GREEDY)])
    backend.release([Release(1)])
    with pytest.raises(UnknownSequence):
        backend.jit_draft([JitDraftRequest(1, 1, 0, 1)])


def _break_the_stream(backend, workers) -> None:
    """Sequences 1 and 3 on the first server; one batch with an out-of-order outcome for 1 and a good
    one for 3: the server ends the stream, and 3's outcome is lost with the batch."""
    _start(backend, [1, 2, 3])
    assert len(backend.wait_trees([(1, 0), (3, 0)], timeout_s=5.0)) == 2 and 3 in workers[0].seqs
    backend.send_outcomes([Outcome(1, 4, 0, 3, [7, 8, 9]), Outcome(3, 0, 0, 3, [7, 8, 9])])
    deadline = time.monotonic() + 5.0
    while not backend._out_of_sync and time.monotonic() < deadline:  # the reader sees the stream end
        time.sleep(0.01)


def test_a_stream_error_reopens_the_stream_and_its_sequences_prefill_again(pool):
    backend, workers = pool
    _break_the_stream(backend, workers)
    start = time.monotonic()
    assert backend.wait_trees([(3, 1)], timeout_s=3.0) == {}  # its outcome is gone: not waited for
    assert time.monotonic() - start < 1.0
    with pytest.raises(DraftOutOfSync) as info:  # not OutOfOrder from the server, seconds later
        backend.jit_draft([JitDraftRequest(3, 1, 0, 3), JitDraftRequest(2, 1, 0, 3)])
    assert info.value.seq_ids == [3] and list(info.value.partial) == [2]  # 2 lives on the other server
    backend.send_outcomes([Outcome(3, 1, 0, 3, [7, 8, 9])])  # dropped: the server is behind for 3
    backend.release([Release(3)])  # the toy refuses a second prefill (a DraftWorker restarts the sequence)
    deadline = time.monotonic() + 5.0
    while 3 in workers[0].seqs and time.monotonic() < deadline:
        time.sleep(0.01)
    backend.prefill([PrefillRequest(3, [5, 6, 9, 3], GREEDY)])  # what the engine does next round
    assert backend.jit_draft([JitDraftRequest(3, 0, 0, 4)])[0].tokens.tolist() == toy_tokens([5, 6, 9, 3, 4])
    assert list(backend.wait_trees([(3, 0)], timeout_s=5.0)) == [3]  # on the reopened stream
    assert backend.dead_addresses == []


def test_a_unary_release_that_overtakes_the_last_outcome_costs_nothing(pool):
    """The backend releases on the stream, behind the sequence's outcomes; a client that releases with
    the unary call can have its last outcome arrive after the release. That stale outcome is dropped;
    it must not end the stream, whose other outcomes (here sequence 3's, in the same batch) would be
    lost with it."""
    backend, workers = pool
    _start(backend, [1, 2, 3])  # round-robin: 1 and 3 on the first server
    assert len(backend.wait_trees([(1, 0), (3, 0)], timeout_s=5.0)) == 2 and 3 in workers[0].seqs
    link = backend._links[0]
    link.stub.Release(codec.release_batch_to_proto([Release(1)]), timeout=5)
    stale = [Outcome(1, 0, 0, 3, [7, 8, 9]), Outcome(3, 0, 0, 3, [7, 8, 9])]
    link.send(pb.SpeculateRequest(outcomes=codec.outcome_batch_to_proto(stale)))
    assert list(backend.wait_trees([(3, 1)], timeout_s=5.0)) == [3]
    assert workers[0].seqs[3].round == 1  # observed once: the stream was never torn down and reopened
    assert backend._out_of_sync == set()


def test_a_prefix_cache_reset_reaches_every_server_behind_what_came_before(pool):
    backend, workers = pool
    _start(backend, [1, 2])
    backend.release([Release(1), Release(2)])
    backend.reset_prefix_cache(ResetPrefixCache())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all("reset_prefix_cache" in w.calls for w in workers):
        time.sleep(0.01)
    for w in workers:
        assert w.calls[-2:] == ["release", "reset_prefix_cache"]  # in order on the stream
    assert _start(backend, [3])  # the streams stay up


def test_jit_drafts_follow_their_outcomes_and_a_refused_one_leaves_the_stream_up(pool):
    """A JIT rides the stream behind the outcomes sent before it: no server-side wait, no overtaking
    (the server does not wait for outcomes on the stream: a round it is not at is refused at once).
    A refused JIT is answered in band; the stream, and what is queued on it, lives on."""
    backend, workers = pool
    _start(backend, [1])
    workers[0].build_delay_s = 0.3  # the outcome's tree is still building when the JIT is queued
    backend.send_outcomes([Outcome(1, 0, 0, 3, [7, 8, 9])])
    start = time.monotonic()
    assert backend.jit_draft([JitDraftRequest(1, 2, 1, 4)])[0].tokens.shape == (K,)  # round 1's outcome + this
    assert time.monotonic() - start < 2.0
    calls = workers[0].calls
    assert calls.count("jit_draft") == 2 and calls.index("observe") < len(calls) - 1 - calls[::-1].index("jit_draft")
    with pytest.raises(OutOfOrder):
        backend.jit_draft([JitDraftRequest(1, 9, 0, 1)])
    workers[0].build_delay_s = 0.0
    backend.send_outcomes([Outcome(1, 2, 0, 5, [7, 8, 9])])
    assert list(backend.wait_trees([(1, 3)], timeout_s=5.0)) == [1]  # the same stream, still in sync
    assert backend._out_of_sync == set() and backend.dead_addresses == []


def test_the_draft_pool_keeps_a_server_whose_stream_failed():
    """DraftOutOfSync is a DraftUnavailable (the engine re-prefills those sequences) that does not
    take the server out of the pool, as a dead one's DraftUnavailable does."""
    worker = ToyWorker()
    server, port = serve_draft(worker, "127.0.0.1", 0)
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=5.0)], max_batch_size=4)
    try:
        pool.prefill([PrefillRequest(s, [5, 6], GREEDY) for s in (1, 3)])
        pool.jit_draft([JitDraftRequest(s, 0, 0, 9) for s in (1, 3)])
        pool.wait_trees([(1, 0), (3, 0)], timeout_s=5.0)
        pool.send_outcomes([Outcome(1, 4, 0, 3, [7, 8, 9]), Outcome(3, 0, 0, 3, [7, 8, 9])])  # ends the stream
        deadline = time.monotonic() + 5.0
        while not pool.backends[0]._out_of_sync and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(DraftUnavailable) as info:
            pool.jit_draft([JitDraftRequest(3, 1, 0, 3)])
        assert info.value.seq_ids == [3] and pool.dead == set()
    finally:
        pool.close()
        server.stop(None)


def test_each_servers_capture_count_reaches_the_target_and_a_pool_sums_them(monkeypatch):
    """Every reply carries its server's CUDA-graph capture count: a capture there stalls the target's
    round, which its tree gate then leaves out (engine/ssd_loop.py)."""
    monkeypatch.setattr(draft_service, "graph_captures", lambda: 5)
    servers = [serve_draft(ToyWorker(), "127.0.0.1", 0) for _ in range(2)]
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=5.0) for _, port in servers], max_batch_size=4)
    try:
        assert pool.graph_captures() == 0  # nothing heard yet
        _start(pool, [1, 2])
        assert [b.graph_captures() for b in pool.backends] == [5, 5] and pool.graph_captures() == 10
    finally:
        pool.close()
        for server, _ in servers:
            server.stop(None)


def _spawn_toy_server(tmp_path) -> tuple[subprocess.Popen, int]:
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, str(HERE / "test_grpc_toy_worker.py"), str(port_file)],
                            env={**os.environ, "PYTHONPATH": str(HERE)})
    deadline = time.monotonic() + 30.0
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("toy draft server did not start")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def test_server_killed_mid_stream_is_marked_dead_and_the_rest_goes_on(tmp_path):
    proc, remote_port = _spawn_toy_server(tmp_path)
    local, local_port = serve_draft(ToyWorker(), "127.0.0.1", 0)
    backend = GrpcDraftBackend([f"127.0.0.1:{local_port}", f"127.0.0.1:{remote_port}"], deadline_s=5.0)
    try:
        _start(backend, [1, 2])  # 1 -> local, 2 -> the subprocess
        assert len(backend.wait_trees([(1, 0), (2, 0)], timeout_s=5.0)) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        backend.send_outcomes([Outcome(1, 0, 0, 3, [7, 8, 9]), Outcome(2, 0, 0, 3, [7, 8, 9])])
        start = time.monotonic()
        assert list(backend.wait_trees([(1, 1), (2, 1)], timeout_s=10.0)) == [1]
        assert time.monotonic() - start < 5.0  # did not wait out the deadline for the dead one
        assert backend.dead_addresses == [f"127.0.0.1:{remote_port}"]
        with pytest.raises(DraftUnavailable) as info:
            backend.jit_draft([JitDraftRequest(1, 2, 0, 4), JitDraftRequest(2, 1, 0, 4)])
        assert info.value.seq_ids == [2] and list(info.value.partial) == [1]
        backend.prefill([PrefillRequest(3, [1, 2], GREEDY), PrefillRequest(2, [5, 6, 9, 3], GREEDY)])
        assert backend.owner_of(3) == backend.owner_of(2) == f"127.0.0.1:{local_port}"  # re-assigned
        assert backend.jit_draft([JitDraftRequest(3, 0, 0, 4)])[0].tokens.tolist() == toy_tokens([1, 2, 4])
    finally:
        backend.close()
        local.stop(None)
        proc.kill()


def test_unreachable_server_starts_dead_and_close_is_idempotent():
    local, port = serve_draft(ToyWorker(), "127.0.0.1", 0)
    probe, dead_port = serve_draft(ToyWorker(), "127.0.0.1", 0)
    probe.stop(None).wait()  # a port nobody listens on any more
    backend = GrpcDraftBackend([f"127.0.0.1:{dead_port}", f"127.0.0.1:{port}"], connect_timeout_s=0.5)
    try:
        assert backend.dead_addresses == [f"127.0.0.1:{dead_port}"]
        _start(backend, [1, 2])
        assert {backend.owner_of(1), backend.owner_of(2)} == {f"127.0.0.1:{port}"}
    finally:
        backend.close()
        backend.close()
        local.stop(None)


def test_merged_shard_slices_keep_every_branch_and_the_slowest_build():
    slices = [SpeculationTree.from_rows(7, 3, [(k, 10 + k, Proposal(torch.tensor([k, k]), None))], build_s=s)
              for k, s in ((0, 0.004), (1, 0.009))] + [SpeculationTree(7, 3, build_s=0.001)]  # a shard with no branch
    tree = SpeculationTree.concat(slices)
    assert (tree.seq_id, tree.round, tree.build_s) == (7, 3, 0.009)
    assert tree.keys() == [(0, 10), (1, 11)] and tree.proposals.tokens.tolist() == [[0, 0], [1, 1]]


def test_the_outbox_counts_a_request_sent_when_grpc_asks_for_the_next():
    box = Outbox()
    requests = box.requests()
    assert box.put("a") == 1 and box.put("b") == 2  # tickets
    assert next(requests) == "a" and box.sent == 0   # taken, not yet sent
    assert next(requests) == "b" and box.sent == 1   # asked again: "a" went out
    box.put(CLOSE)
    assert list(requests) == [] and box.sent == 2


def test_sending_waits_for_grpc_but_not_longer_than_handoff_s():
    link = Link("127.0.0.1:1", [])  # no stream: nothing will ever send
    try:
        start = time.perf_counter()
        await_sent([link.send(pb.SpeculateRequest())])
        assert HANDOFF_S <= time.perf_counter() - start < 1.0
        assert (link.outbox.queued, link.outbox.sent) == (1, 0)
    finally:
        link.channel.close()


def test_a_live_stream_counts_its_requests_sent(pool):
    backend, _ = pool
    backend.prefill([PrefillRequest(0, [5, 6, 7], GREEDY)])
    backend.jit_draft([JitDraftRequest(0, 0, 0, 9)])
    link = backend._owner[0]
    tree = backend.wait_trees([(0, 0)], 5.0)[0]
    for _ in range(20):  # each outcome's tree comes back, so each outcome was sent
        backend.send_outcomes([Outcome(0, tree.round, tree.accepted[0], tree.bonus_tokens[0], cache_hit=True,
                                       next_tokens=tree.proposal(0).tokens.tolist())])
        tree = backend.wait_trees([(0, tree.round + 1)], 5.0)[0]
    # Counted once gRPC asks for the next request: all but the last, or all of them (send_outcomes waited).
    assert link.outbox.queued == 21 and link.outbox.sent >= 20
