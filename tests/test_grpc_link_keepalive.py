"""The target's keepalive to its draft servers over real gRPC on loopback, through a TCP relay that can go
silent (a NAT or load balancer that dropped the connection's state, a node gone without a reset) or cut
its connections: an idle Speculate stream keeps pinging, at a rate the server's ping policy accepts."""
from __future__ import annotations

import socket
import threading
import time

import pytest
from test_grpc_toy_worker import ToyWorker

from saguaro_dist.distributed import draft_server
from saguaro_dist.distributed.draft_service import DEFAULT_MAX_MESSAGE_BYTES, serve_draft
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.distributed.grpc_link import KEEPALIVE_FLOOR_MS, SERVER_MIN_PING_INTERVAL_MS, Keepalive, channel_options
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest

pytestmark = pytest.mark.timeout(90)
GREEDY = DraftSampling(0.0, 0, 1.0, None)
PING_FRAME_BYTES = 17  # HTTP/2 frame header (9) + 8 bytes of opaque data


class Relay:
    """A TCP relay from a port of its own to `upstream_port`: silent() drops every byte from then on (the
    sockets stay open), cut() closes every connection and refuses new ones until reopen()."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.quiet = False
        self.refusing = False
        self.sockets: list[socket.socket] = []
        self.chunks: list[tuple[float, str, int]] = []  # (time, "up" or "down", bytes) of what was relayed
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            if self.refusing:
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        try:
            while data := src.recv(65536):
                if not self.quiet:
                    self.chunks.append((time.monotonic(), way, len(data)))
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def silent(self) -> None:
        self.quiet = True

    def cut(self) -> None:
        self.refusing = True
        sockets, self.sockets = self.sockets, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def reopen(self) -> None:
        self.refusing = False

    def pings_since(self, start: float, way: str = "up") -> int:
        """Chunks the size of a PING frame (or its ack) relayed `way` ("up": client to server) since `start`."""
        return sum(1 for t, w, n in list(self.chunks) if w == way and t >= start and n == PING_FRAME_BYTES)

    def close(self) -> None:
        self.listener.close()
        self.cut()


def wait_until(condition, timeout_s: float, step_s: float = 0.05) -> float:
    """Seconds until condition() held; fails the test after timeout_s."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s")
        time.sleep(step_s)
    return time.monotonic() - start


def test_a_keepalive_the_server_would_answer_with_goaway_is_refused():
    """The draft server counts a ping sooner than 5 s after the last as a strike and sends GOAWAY
    "too_many_pings" after two: a client keepalive under that (with a margin) is a configuration error."""
    with pytest.raises(ValueError, match="keepalive"):
        Keepalive(time_ms=KEEPALIVE_FLOOR_MS - 1)
    with pytest.raises(ValueError, match="timeout_ms"):
        Keepalive(timeout_ms=0)
    options = dict(channel_options(1 << 20))
    assert options["grpc.keepalive_time_ms"] >= KEEPALIVE_FLOOR_MS
    assert options["grpc.http2.max_pings_without_data"] == 0  # else pings on an idle stream stop after two


def server_options(max_message_bytes: int) -> dict:
    return dict(draft_server._server_options(max_message_bytes))


def test_the_client_options_agree_with_the_servers():
    """Same message size limits both ways, and a keepalive the server's ping policy accepts (the floor mirrors
    draft_service's min_ping_interval_without_data_ms)."""
    server = server_options(DEFAULT_MAX_MESSAGE_BYTES)
    client = dict(channel_options(DEFAULT_MAX_MESSAGE_BYTES))
    for limit in ("grpc.max_send_message_length", "grpc.max_receive_message_length"):
        assert client[limit] == server[limit] == DEFAULT_MAX_MESSAGE_BYTES
    assert server["grpc.http2.min_ping_interval_without_data_ms"] == SERVER_MIN_PING_INTERVAL_MS
    assert server.get("grpc.keepalive_permit_without_calls") == 1  # pings on a connection without calls welcome
    assert client["grpc.keepalive_time_ms"] > SERVER_MIN_PING_INTERVAL_MS


@pytest.mark.slow
def test_a_server_gone_silent_on_an_idle_stream_is_found_within_keepalive():
    """A stream idle for longer than two keepalive periods (a quiet server) keeps pinging without the server
    sending it away, and a server that goes silent then is found within keepalive time + timeout. Before,
    gRPC's default of two pings without data left it unnoticed ~70 s (one ping a minute after those two)."""
    # A ping's round trip runs through two Python relay threads on a loaded box: 5 s, not 1 s, for its ack.
    keepalive = Keepalive(time_ms=KEEPALIVE_FLOOR_MS, timeout_ms=5_000)
    server, port = serve_draft(ToyWorker(), "127.0.0.1", 0)
    relay = Relay(port)
    backend = GrpcDraftBackend([f"127.0.0.1:{relay.port}"], deadline_s=5.0, keepalive=keepalive)
    try:
        backend.prefill([PrefillRequest(1, [5, 6], GREEDY)])
        backend.jit_draft([JitDraftRequest(1, 0, 0, 9)])
        idle_from = time.monotonic()
        # The two pings gRPC allows without data by default, both answered: the next one is what the fix adds.
        wait_until(lambda: relay.pings_since(idle_from, "up") >= 2 and relay.pings_since(idle_from, "down") >= 2,
                   timeout_s=30.0)
        assert backend.dead_addresses == []  # pinged all along, never sent away for pinging too often
        relay.silent()
        found_s = wait_until(lambda: backend.dead_addresses, timeout_s=30.0)
        # time + timeout, plus 5 s for a loaded box: still far under the ~70 s of no ping after the first two.
        assert found_s < (keepalive.time_ms + keepalive.timeout_ms) / 1000 + 5.0
    finally:
        backend.close()
        relay.close()
        server.stop(None)
