"""Session 86's gRPC review: GrpcDraftBackend.close() delivers the releases queued before it (a draft server that
outlives its client kept those sequences), health reports NOT_SERVING once a stop begins, and a server stopped
right before the interpreter exits leaves no traceback. Real servers on loopback, ToyWorker behind them."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.messages import DraftSampling, PrefillRequest, Release
from test_grpc_toy_worker import ToyWorker

pytestmark = pytest.mark.timeout(120)
HERE = pathlib.Path(__file__).resolve().parent
GREEDY = DraftSampling(0.0, 0, 1.0, None)


@pytest.fixture(scope="module")
def two_servers():
    """Two servers that outlive every backend of the module."""
    workers = [ToyWorker(), ToyWorker()]
    servers = [serve_draft(w, "127.0.0.1", 0) for w in workers]
    yield [f"127.0.0.1:{port}" for _, port in servers], workers
    for server, _ in servers:
        server.stop(None).wait(10)


def test_close_delivers_the_releases_queued_on_the_streams_before_it(two_servers):
    """The engine's last releases are queued on the Speculate streams; close() used to cancel the streams behind
    them, so servers that live on kept those sequences (their KV rows) for good."""
    addresses, workers = two_servers
    for trial in range(5):
        seq_ids = [10 * trial + i for i in range(4)]
        backend = GrpcDraftBackend(addresses, deadline_s=5.0)
        backend.prefill([PrefillRequest(s, [1, 2], GREEDY) for s in seq_ids])
        assert all(w.seqs for w in workers)  # round-robin: both servers hold some
        backend.release([Release(s) for s in seq_ids])
        backend.close()
        assert [sorted(w.seqs) for w in workers] == [[], []], f"trial {trial}"


class StalledRelease(ToyWorker):
    """A worker whose release blocks the server's loop until `go` is set: a stalled server."""

    def __init__(self):
        super().__init__()
        self.go, self.stalled = threading.Event(), threading.Event()

    def release(self, reqs):
        self.stalled.set()
        self.go.wait(60)
        super().release(reqs)


def test_close_ends_the_streams_of_a_stalled_server_without_waiting_for_it():
    """close() waits for a server to read its stream to the end, but only up to deadline_s."""
    worker = StalledRelease()
    server, port = serve_draft(worker, "127.0.0.1", 0)
    try:
        backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=0.5)
        backend.prefill([PrefillRequest(1, [1, 2], GREEDY)])
        backend.release([Release(1)])
        assert worker.stalled.wait(30)
        closing = threading.Thread(target=backend.close, daemon=True)
        closing.start()
        closing.join(30)
        assert not closing.is_alive(), "close() waited on a stalled server past its deadline"
    finally:
        worker.go.set()
        server.stop(None).wait(10)


def test_health_watchers_see_not_serving_once_a_stop_begins():
    """grpc.health.v1's graceful shutdown: a watcher (gRPC's client-side health checks watch) learns the server is
    stopping as its grace begins; it used to see SERVING until the call was cut at the grace's end."""
    server, port = serve_draft(ToyWorker(), "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stopped = server.stop(5.0)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        assert stopped.wait(30)
    finally:
        channel.close()
        server.stop(None).wait(10)


STOP_AND_EXIT = """
import sys
from test_grpc_toy_worker import ToyWorker
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.messages import DraftSampling, PrefillRequest
server, port = serve_draft(ToyWorker(), "127.0.0.1", 0)
backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=5.0)
backend.prefill([PrefillRequest(1, [1, 2], DraftSampling(0.0, 0, 1.0, None))])
server.stop(1.0)  # its stream still open (the stop takes the grace): the interpreter exits meanwhile
"""


def _stop_and_exit(_) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", STOP_AND_EXIT], env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.mark.slow
def test_a_server_stopped_right_before_the_interpreter_exits_leaves_no_traceback():
    """The loop used to be stopped twice (stop()'s, the finalizer's at exit) and grpc's server left running:
    "Event loop stopped before Future completed", "Event loop is closed", "'AioServer.shutdown' was never
    awaited" at exit. A race: two processes, each of which printed them about two times in three."""
    with ThreadPoolExecutor(2) as pool:
        for stderr in pool.map(_stop_and_exit, range(2)):
            assert "Traceback" not in stderr and "never awaited" not in stderr, stderr
