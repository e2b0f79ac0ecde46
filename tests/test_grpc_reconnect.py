"""A draft server that comes back over real gRPC on loopback: restarted at the same address, or its
connection cut while the process lives on (a relay in between), or not up yet when the target starts. Its
sequences go to the fast backup meanwhile (DraftUnavailable); once it serves again it takes prefills."""
from __future__ import annotations

import time

import pytest
from test_grpc_link_keepalive import Relay, wait_until
from test_grpc_toy_worker import ToyWorker, toy_tokens

from saguaro_dist.distributed import grpc_link
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.errors import DraftUnavailable
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.distributed.grpc_link import MAX_RECONNECT_BACKOFF_MS
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest

pytestmark = pytest.mark.timeout(90)
GREEDY = DraftSampling(0.0, 0, 1.0, None)
BACK_WITHIN_S = MAX_RECONNECT_BACKOFF_MS / 1000 * 1.2 + 2.0  # gRPC's capped backoff, its jitter, and a margin


def _draft(backend, seq_id: int, prompt=(5, 6), bonus=9) -> list[int]:
    backend.prefill([PrefillRequest(seq_id, list(prompt), GREEDY)])
    return backend.jit_draft([JitDraftRequest(seq_id, 0, 0, bonus)])[0].tokens.tolist()


def test_a_server_restarted_at_the_same_address_serves_again():
    server, port = serve_draft(ToyWorker(), "127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    backend = GrpcDraftBackend([address], deadline_s=5.0)
    try:
        assert _draft(backend, 1) == toy_tokens([5, 6, 9])
        server.stop(None).wait()
        wait_until(lambda: backend.dead_addresses == [address], timeout_s=10.0)
        with pytest.raises(DraftUnavailable):  # the engine gives it the fast backup
            backend.jit_draft([JitDraftRequest(1, 1, 0, 4)])
        server, _ = serve_draft(ToyWorker(), "127.0.0.1", port)
        wait_until(lambda: backend.dead_addresses == [], timeout_s=BACK_WITHIN_S)
        assert backend.lost([1]) == [1]  # the new process holds none of it: prefilled again
        assert _draft(backend, 1, (1, 2), 4) == toy_tokens([1, 2, 4])
        assert _draft(backend, 2) == toy_tokens([5, 6, 9]) and backend.lost([1, 2]) == []
    finally:
        backend.close()
        server.stop(None)


def test_a_server_whose_connection_was_cut_releases_what_it_held_when_taken_back():
    """The process lived on: what it held when the link died, and moved elsewhere or released since, is
    released there before it takes prefills again; what stayed placed there is out of sync until prefilled."""
    cut_worker, other_worker = ToyWorker(), ToyWorker()
    (cut_server, cut_port), (other_server, other_port) = (serve_draft(w, "127.0.0.1", 0)
                                                          for w in (cut_worker, other_worker))
    relay = Relay(cut_port)
    backend = GrpcDraftBackend([f"127.0.0.1:{relay.port}", f"127.0.0.1:{other_port}"], deadline_s=5.0)
    try:
        for seq_id in (1, 2, 3):  # round robin: 1 and 3 through the relay, 2 on the other server
            _draft(backend, seq_id)
        assert sorted(cut_worker.seqs) == [1, 3]
        relay.cut()
        wait_until(lambda: backend.dead_addresses, timeout_s=10.0)
        _draft(backend, 1, (1, 2), 4)  # re-prefilled meanwhile: on the other server
        assert backend.owner_of(1) == f"127.0.0.1:{other_port}"
        relay.reopen()
        wait_until(lambda: backend.dead_addresses == [], timeout_s=BACK_WITHIN_S)
        assert 1 not in cut_worker.seqs and sorted(other_worker.seqs) == [1, 2]
        assert backend.lost([1, 2, 3]) == [3]
        assert _draft(backend, 3, (7, 8), 2) == toy_tokens([7, 8, 2])
        assert backend.owner_of(3) == f"127.0.0.1:{relay.port}" and sorted(cut_worker.seqs) == [3]
    finally:
        backend.close()
        relay.close()
        for server in (cut_server, other_server):
            server.stop(None)


def test_a_server_not_up_at_start_is_taken_in_once_it_serves():
    probe, port = serve_draft(ToyWorker(), "127.0.0.1", 0)
    probe.stop(None).wait()  # a port nobody listens on yet
    backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=5.0, connect_timeout_s=0.2)
    server = None
    try:
        assert backend.dead_addresses == [f"127.0.0.1:{port}"]
        server, _ = serve_draft(ToyWorker(), "127.0.0.1", port)
        wait_until(lambda: backend.dead_addresses == [], timeout_s=BACK_WITHIN_S)
        assert _draft(backend, 1) == toy_tokens([5, 6, 9])
    finally:
        backend.close()
        if server is not None:
            server.stop(None)


@pytest.mark.slow
def test_a_server_back_after_a_long_outage_is_redialled_within_the_capped_backoff(monkeypatch):
    """gRPC's reconnect backoff grows x1.6 to 120 s by default: dials at ~1, 2.6, 5.2, 9.3, 15.8, 26, 43 s...
    (each step jittered +-20%), so after 30 s down the next is ~13 s away (under 5 s only if the jitter of all 7 steps
    ran short). Capped (here at 1 s; the product's 5 s cap would need a far longer outage), a server back is
    used again within the cap."""
    monkeypatch.setattr(grpc_link, "MAX_RECONNECT_BACKOFF_MS", 1_000)  # read as each backend builds its channels
    # The capped redial (<= 1.2 s), then the reviver's Release RPC and the liveness flip: roomy for a loaded box,
    # still well under the uncapped ~13 s. (A 10 s outage left the uncapped next dial only ~5 s away.)
    back_within_s = 5.0
    server, port = serve_draft(ToyWorker(), "127.0.0.1", 0)
    backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=5.0)
    try:
        server.stop(None).wait()
        wait_until(lambda: backend.dead_addresses, timeout_s=30.0)  # (not what is measured: roomy for a loaded box)
        time.sleep(30.0)
        server, _ = serve_draft(ToyWorker(), "127.0.0.1", port)
        back_s = wait_until(lambda: backend.dead_addresses == [], timeout_s=30.0)
        assert back_s < back_within_s
    finally:
        backend.close()
        server.stop(None)
