"""The DraftService's server: a grpc.aio server on an event loop of its own thread (where the worker
runs), serving the servicer's four methods plus grpc.health.v1, and the addresses it binds: TCP on the
node's cluster address, optionally a local unix socket as well.
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading
import uuid
import weakref
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from saguaro_dist.distributed.proto import SERVICE_NAME
from saguaro_dist.distributed.proto import saguaro_pb2 as pb

if TYPE_CHECKING:
    from saguaro_dist.distributed.draft_service import DraftServicer

__all__ = ["DraftServer", "default_bind_host", "format_address", "local_address"]


def default_bind_host() -> str:
    """The node's cluster address under Ray, else loopback; never 0.0.0.0 unless asked for."""
    ray = sys.modules.get("ray")  # Ray can only be initialised if something already imported it
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def local_address() -> str | None:
    """A fresh gRPC address in Linux's abstract unix-socket namespace, for clients on this node (None
    elsewhere). Same protocol, no TCP stack: a tree's trip ~0.2 ms shorter on average than over loopback
    (docs/benchmark-history.md, session 40). Abstract names leave no file behind, even for a killed process."""
    return f"unix-abstract:saguaro-draft-{os.getpid()}-{uuid.uuid4().hex[:12]}" if sys.platform == "linux" else None


KEEPALIVE_TIMEOUT_MS = 10_000
# A client ping sooner than this after the last, while no data flows, is a strike; after two the server ends the
# connection (GOAWAY "too_many_pings"): the target's keepalive (grpc_link.Keepalive) stays above it.
MIN_PING_INTERVAL_MS = 5_000
STOPPING_WAIT_S = 5.0  # how long the interpreter's exit waits for a stop() under way (its grace, then ~ms)


def _server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
        ("grpc.keepalive_time_ms", 20_000),  # find a vanished target and end its stream
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # what closes a connection whose pings go unanswered (gRPC's default: 1 min, whatever the keepalive timeout)
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),  # the backend's keepalive pings
    ]


def _handlers(servicer: DraftServicer) -> grpc.GenericRpcHandler:
    # Requests arrive as raw bytes (no request_deserializer): the servicer parses them itself.
    unary = grpc.unary_unary_rpc_method_handler
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Prefill": unary(servicer.Prefill, response_serializer=pb.PrefillReply.SerializeToString),
        "JitDraft": unary(servicer.JitDraft, response_serializer=pb.ProposalBatch.SerializeToString),
        "Release": unary(servicer.Release, response_serializer=pb.ReleaseReply.SerializeToString),
        "Speculate": grpc.stream_stream_rpc_method_handler(
            servicer.Speculate, response_serializer=pb.SpeculateReply.SerializeToString),
    })


async def _add_health(server: grpc.aio.Server) -> health.aio.HealthServicer:
    checker = health.aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    return checker


def _bind(server: grpc.aio.Server, host: str, port: int) -> int:
    address = format_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # recent grpcio raises instead of returning 0
        raise OSError(f"cannot bind the DraftService to {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind the DraftService to {address}")
    return bound


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The server thread: the loop until stopped, then its leftover tasks cancelled, then closed."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    finally:
        loop.close()


def _stop_loop(loop: asyncio.AbstractEventLoop, once: threading.Lock) -> None:
    """Stop the loop's run_forever, once: a second stop (stop()'s, then the finalizer's at interpreter exit) cut
    _run_loop's clean-up short ("Event loop stopped before Future completed")."""
    if once.acquire(blocking=False) and not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)


def _finalize(loop: asyncio.AbstractEventLoop, once: threading.Lock, stopping: threading.Event,
              stopped: threading.Event) -> None:
    """A server dropped, or the interpreter exiting: a stop() under way ends first (up to STOPPING_WAIT_S; cut
    short, grpc's server, left running, failed at exit to schedule its shutdown on the closed loop), then the loop."""
    if stopping.is_set():
        stopped.wait(STOPPING_WAIT_S)
    _stop_loop(loop, once)


class DraftServer:
    """A started DraftService: a grpc.aio server on an event loop of its own thread, where the worker
    runs. stop() and wait_for_termination() behave like grpc.Server's."""

    def __init__(self, servicer: DraftServicer, host: str, port: int, max_message_bytes: int,
                 max_concurrent_rpcs: int | None, local: str | None = None):
        self._loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        self._stopping, self._stop_once = threading.Event(), threading.Lock()
        threading.Thread(target=_run_loop, args=(self._loop,), name="saguaro-draft-loop", daemon=True).start()
        # a server dropped without stop() ends its thread
        weakref.finalize(self, _finalize, self._loop, self._stop_once, self._stopping, self._stopped)
        try:
            self.port = self._run(self._start(servicer, host, port, max_message_bytes, max_concurrent_rpcs, local))
        except BaseException:
            _stop_loop(self._loop, self._stop_once)
            raise

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self, servicer, host, port, max_message_bytes, max_concurrent_rpcs, local) -> int:
        self._server = grpc.aio.server(options=_server_options(max_message_bytes),
                                       maximum_concurrent_rpcs=max_concurrent_rpcs)
        self._server.add_generic_rpc_handlers((_handlers(servicer),))
        self._health = await _add_health(self._server)
        bound = _bind(self._server, host, port)
        if local is not None and not self._server.add_insecure_port(local):
            raise OSError(f"cannot bind the DraftService to {local}")
        await self._server.start()
        return bound

    def stop(self, grace: float | None) -> threading.Event:
        """Stop serving (in-flight calls get `grace` seconds); the Event is set once the loop is down."""
        if not self._stopped.is_set() and not self._loop.is_closed():
            self._stopping.set()
            done = asyncio.run_coroutine_threadsafe(self._shut_down(grace), self._loop)
            done.add_done_callback(self._server_stopped)
        return self._stopped

    async def _shut_down(self, grace: float | None) -> None:
        # NOT_SERVING first (grpc.health.v1's graceful shutdown): a client watching health (gRPC's client-side
        # health checks watch) learns it is stopping during the grace, not only from its calls failing after
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)

    def _server_stopped(self, _) -> None:
        _stop_loop(self._loop, self._stop_once)
        self._stopped.set()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)
