"""The draft side over gRPC: a DraftService servicer around any object with the DraftWorker interface.

The worker is single-threaded, so every call to it goes through one worker thread, in arrival order.
The Speculate stream carries outcomes, just-in-time drafts and releases in the order the target sent
them; it answers each just-in-time draft at once and pushes each tree batch as soon as the worker has
built it: after every outcome batch, and after every just-in-time draft (its speculation is pending,
so the tree for it follows while the target already has its proposals).

Status codes at the edge: INVALID_ARGUMENT (undecodable or malformed message, or a ValueError from
the worker), RESOURCE_EXHAUSTED (over the message size limit; gRPC enforces it on receipt),
NOT_FOUND (UnknownSequence / KeyError), FAILED_PRECONDITION (OutOfOrder), INTERNAL (anything else).
A just-in-time draft on the stream gets its status in its JitDraftResult and the stream lives on.
A failed call never takes the server down. A unary JitDraft that overtook its outcomes on the stream
(DraftBehind) waits for them, up to JIT_CATCH_UP_S, before it fails.
"""
from __future__ import annotations

import collections
import logging
import queue
import sys
import threading
import time
import weakref
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from saguaro_dist.distributed import codec
from saguaro_dist.distributed.errors import DraftBehind, OutOfOrder
from saguaro_dist.distributed.proto import SERVICE_NAME
from saguaro_dist.distributed.proto import saguaro_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "DraftServicer", "serve_draft", "default_bind_host", "status_for", "format_address"]

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a dense [K, V] tree batch fits; anything larger is a bug
_PENDING_BATCHES = 64  # tree batches kept while no stream is open (a reconnecting target picks them up)
JIT_CATCH_UP_S = 2.0  # how long a just-in-time draft that overtook its outcomes waits for them
_RELEASED_KEPT = 4096  # released sequence ids remembered, so that a late outcome of one is dropped


def default_bind_host() -> str:
    """The node's cluster address under Ray, else loopback; never 0.0.0.0 unless asked for."""
    ray = sys.modules.get("ray")  # Ray can only be initialised if something already imported it
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed call answers with; see the module docstring."""
    if isinstance(exc, (DecodeError, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {exc}"
    if isinstance(exc, KeyError):  # UnknownSequence included; str(KeyError) would add quotes
        return grpc.StatusCode.NOT_FOUND, str(exc.args[0]) if exc.args else "unknown sequence"
    if isinstance(exc, OutOfOrder):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "draft worker out of memory"
    return grpc.StatusCode.INTERNAL, f"draft worker failed: {type(exc).__name__}: {exc}"


class _WorkerThread:
    """Runs callables one at a time, in submission order, on one daemon thread."""

    def __init__(self, name: str = "saguaro-draft-worker", spin_s: float = 0.0):
        self.spin_s = spin_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> futures.Future:
        fut: futures.Future = futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def call(self, fn, *args):
        return self.submit(fn, *args).result()

    def close(self) -> None:
        self._jobs.put(None)

    def _next(self):
        """The next job; polled for spin_s first so this CPU does not halt between rounds (a halted
        vCPU is slow to wake: engine/draft_process.py). sleep(0) lets the gRPC threads take the GIL."""
        end = time.perf_counter() + self.spin_s
        while time.perf_counter() < end:
            try:
                return self._jobs.get_nowait()
            except queue.Empty:
                time.sleep(0)
        return self._jobs.get()

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            fut, fn, args = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # handed to the caller, who maps it to a status
                    fut.set_exception(exc)


_END = object()


class _Stream:
    """One open Speculate call: encoded replies (tree batches, JIT results), then _END or a (code, details) failure."""

    def __init__(self):
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def push(self, reply: pb.SpeculateReply) -> None:
        self.items.put(reply)

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        self.items.put((code, details))

    def finish(self) -> None:
        self.items.put(_END)


class DraftServicer:
    """saguaro.v1.DraftService around `worker` (prefill / jit_draft / observe / build_trees / release)."""

    def __init__(self, worker, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.worker = worker
        self.max_message_bytes = max_message_bytes
        config = getattr(worker, "config", None)
        self._thread = _WorkerThread(spin_s=getattr(config, "draft_spin_s", 0.0))
        self._lock = threading.Lock()  # guards the open streams and the pending batches
        self._streams: list[_Stream] = []
        self._pending: collections.deque = collections.deque(maxlen=_PENDING_BATCHES)
        self._observed = threading.Condition()  # notified after each outcome batch the worker observed
        self._observed_batches = 0
        self._released: dict[int, None] = {}  # recently released ids, oldest first; worker thread only

    def close(self) -> None:
        self._thread.close()

    # ---- unary calls -------------------------------------------------------------------------------
    def Prefill(self, raw: bytes, context) -> pb.PrefillReply:
        reqs = self._decode(context, raw, pb.PrefillBatch, codec.prefill_batch_from_proto)
        self._call(context, self._prefill, reqs)
        return pb.PrefillReply()

    def _prefill(self, reqs) -> None:
        self.worker.prefill(reqs)
        for r in reqs:  # a sequence placed here again is live again
            self._released.pop(r.seq_id, None)

    def JitDraft(self, raw: bytes, context) -> pb.ProposalBatch:
        reqs = self._decode(context, raw, pb.JitDraftBatch, codec.jit_batch_from_proto)
        proposals = self._call(context, self.worker.jit_draft, reqs, via=self._after_outcomes)
        # Queued behind the JIT on the worker thread; this reply goes out while the tree is built.
        self._thread.submit(self._build_and_broadcast)
        reply = codec.proposal_batch_to_proto(proposals)
        if too_big := self._oversize(reply):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_big)
        return reply

    def _oversize(self, reply) -> str | None:
        """Why a reply may not be sent (over the size limit), or None."""
        size = reply.ByteSize()
        return f"{size} byte reply exceeds the {self.max_message_bytes} byte limit" if size > self.max_message_bytes else None

    def _after_outcomes(self, jit_draft, reqs):
        """The target sends round r's outcome on the stream and, a verify later, round r + 1's JIT as a
        unary call: on a busy host the JIT can get here first. Then it waits for the stream's outcomes
        (on this gRPC thread: the worker thread must stay free to observe them)."""
        deadline = time.monotonic() + JIT_CATCH_UP_S
        while True:
            seen = self._observed_batches
            try:
                return self._thread.call(jit_draft, reqs)
            except DraftBehind:
                with self._observed:
                    if not self._observed.wait_for(lambda: self._observed_batches > seen, deadline - time.monotonic()):
                        raise

    def Release(self, raw: bytes, context) -> pb.ReleaseReply:
        reqs = self._decode(context, raw, pb.ReleaseBatch, codec.release_batch_from_proto)
        self._call(context, self._release, reqs)
        return pb.ReleaseReply()

    def _release(self, reqs) -> None:
        """Release travels as a unary call, outcomes on the stream: a finished sequence's last outcome
        can arrive after its release. Remembering the released ids lets that outcome be dropped; as an
        error it would end the stream, and the other sequences' outcomes queued on it with it."""
        self.worker.release(reqs)
        for r in reqs:
            self._released[r.seq_id] = None
        while len(self._released) > _RELEASED_KEPT:
            del self._released[next(iter(self._released))]

    def _decode(self, context, raw: bytes, message_type, from_proto):
        """Parse and validate here, not in gRPC's deserializer, so bad bytes get INVALID_ARGUMENT."""
        try:
            return from_proto(message_type.FromString(raw))
        except (DecodeError, ValueError) as exc:
            context.abort(*status_for(exc))

    def _call(self, context, fn, reqs, via=None):
        """fn(reqs) on the worker thread (through `via` if given); a failure becomes the call's status."""
        try:
            return (via or self._thread.call)(fn, reqs)
        except Exception as exc:
            self._log_failure(fn, exc)
            context.abort(*status_for(exc))

    @staticmethod
    def _log_failure(fn, exc: Exception) -> None:
        code, _ = status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.error("draft worker %s failed", getattr(fn, "__name__", fn), exc_info=exc)
        else:
            log.info("draft worker %s refused a request (%s): %s", getattr(fn, "__name__", fn), code.name, exc)

    # ---- the Speculate stream ----------------------------------------------------------------------
    def Speculate(self, request_iterator, context):
        stream = self._open_stream()
        context.add_callback(stream.finish)  # a cancelled call wakes the loop below
        reader = threading.Thread(target=self._read_requests, args=(request_iterator, context, stream),
                                  name="saguaro-speculate-reader", daemon=True)
        reader.start()
        try:
            while (item := stream.items.get()) is not _END:
                if isinstance(item, tuple):
                    context.abort(*item)
                yield item
        finally:
            self._close_stream(stream)

    def _read_requests(self, requests, context, stream: _Stream) -> None:
        """Stream requests in arrival order -> the worker thread, which observes, drafts, builds and pushes.

        The reader does not wait for the worker: the worker thread pushes what it encodes itself, one
        thread hand-off fewer between an outcome and its tree (each costs a wake-up on a busy box)."""
        try:
            for raw in requests:
                self._dispatch(pb.SpeculateRequest.FromString(raw), context, stream)
        except Exception as exc:
            if context.is_active():  # not a client that went away
                self._log_failure(self._read_requests, exc)
                stream.fail(*status_for(exc))
                return
        self._thread.submit(stream.finish)  # after the work queued before it

    def _dispatch(self, msg: pb.SpeculateRequest, context, stream: _Stream) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "outcomes":
            self._thread.submit(self._observe_build_push, codec.outcome_batch_from_proto(msg.outcomes), context, stream)
        elif kind == "jit_draft":
            self._dispatch_jit(msg.jit_draft, stream)
        elif kind == "releases":
            self._thread.submit(self._release_logged, codec.release_batch_from_proto(msg.releases))
        else:
            raise codec.CodecError("SpeculateRequest carries none of outcomes, jit_draft, releases")

    def _dispatch_jit(self, call: pb.JitDraftCall, stream: _Stream) -> None:
        try:
            call_id, reqs = codec.jit_call_from_proto(call)
        except codec.CodecError as exc:  # answered in band: the stream and its queued outcomes live on
            stream.push(self._jit_error(call.call_id, exc))
            return
        self._thread.submit(self._jit_build_push, call_id, reqs, stream)

    def _jit_build_push(self, call_id: int, reqs, stream: _Stream) -> None:
        """Worker thread: answer the just-in-time draft at once, then build the tree that follows it.

        On the stream nothing can overtake the outcomes before it, so a round the worker is not at is a
        real protocol error, answered FAILED_PRECONDITION without waiting."""
        try:
            reply = codec.jit_result_to_proto(call_id, self.worker.jit_draft(reqs))
        except Exception as exc:
            self._log_failure(self.worker.jit_draft, exc)
            stream.push(self._jit_error(call_id, exc))
            return
        if too_big := self._oversize(reply):
            reply = codec.jit_error_to_proto(call_id, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], too_big)
        stream.push(reply)
        self._build_push(stream)

    @staticmethod
    def _jit_error(call_id: int, exc: BaseException) -> pb.SpeculateReply:
        code, details = status_for(exc)
        return codec.jit_error_to_proto(call_id, code.value[0], details)

    def _release_logged(self, reqs) -> None:
        try:
            self._release(reqs)
        except Exception as exc:  # nobody waits on a release; say what went wrong
            self._log_failure(self._release, exc)

    def _observe_build_push(self, outcomes, context, stream: _Stream) -> None:
        try:
            self.worker.observe([o for o in outcomes if o.seq_id not in self._released])
            self._note_observed()
        except Exception as exc:
            if context.is_active():
                self._log_failure(self.worker.observe, exc)
                stream.fail(*status_for(exc))
            return
        self._build_push(stream)

    def _build_push(self, stream: _Stream) -> None:
        for batch in self._built_trees():
            stream.push(batch)

    def _built_trees(self) -> list[pb.SpeculateReply]:
        """Build the pending trees and encode them; none if that fails."""
        try:
            return self._encode_trees(self.worker.build_trees())
        except Exception:  # the target's wait times out and it falls back: a miss, never a wrong token
            log.exception("building speculation trees failed")
            return []

    def _note_observed(self) -> None:
        with self._observed:
            self._observed_batches += 1
            self._observed.notify_all()

    def _build_and_broadcast(self) -> None:
        """After a unary JitDraft: the tree goes to every open stream (or waits for one)."""
        batches = self._built_trees()
        with self._lock:
            for batch in batches:
                if not self._streams:
                    self._pending.append(batch)
                for stream in self._streams:
                    stream.push(batch)

    def _encode_trees(self, trees) -> list[pb.SpeculateReply]:
        """Tree batches that each fit the size limit; a single tree over it is dropped (a miss)."""
        replies, current, current_bytes = [], pb.SpeculateReply(), 0
        for tree in trees:
            msg = codec.tree_to_proto(tree)
            size = msg.ByteSize() + 16  # field tags and length prefixes
            if size > self.max_message_bytes:
                log.error("tree of sequence %s round %s is %d bytes, over the %d byte limit: dropped",
                          tree.seq_id, tree.round, size, self.max_message_bytes)
                continue
            # A running sum: the batch's own ByteSize() would serialise it again for every tree added.
            if current_bytes and current_bytes + size > self.max_message_bytes:
                replies, current, current_bytes = replies + [current], pb.SpeculateReply(), 0
            current.trees.trees.append(msg)
            current_bytes += size
        return replies + [current] if current_bytes else replies

    def _open_stream(self) -> _Stream:
        stream = _Stream()
        with self._lock:
            self._streams.append(stream)
            while self._pending:
                stream.push(self._pending.popleft())
        return stream

    def _close_stream(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.remove(stream)


def _server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
        ("grpc.keepalive_time_ms", 20_000),  # find a vanished target and end its stream
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),  # the backend's keepalive pings are welcome
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


def _add_health(server: grpc.Server) -> None:
    checker = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)


def serve_draft(worker, host: str | None = None, port: int = 0, *,
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_workers: int = 16) -> tuple[grpc.Server, int]:
    """Start a DraftService (plus grpc.health.v1) for `worker`; returns the started server and its port.

    host: None binds the node's cluster address (default_bind_host()). port 0 picks a free port.
    max_workers bounds concurrent calls; every open Speculate stream holds one for its lifetime.
    """
    host = default_bind_host() if host is None else host
    servicer = DraftServicer(worker, max_message_bytes)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="saguaro-draft-rpc"),
                         options=_server_options(max_message_bytes))
    server.add_generic_rpc_handlers((_handlers(servicer),))
    _add_health(server)
    bound = _bind(server, host, port)
    server.start()
    weakref.finalize(server, servicer.close)  # the worker thread ends with the server object
    log.info("DraftService listening on %s", format_address(host, bound))
    return server, bound


def _bind(server: grpc.Server, host: str, port: int) -> int:
    address = format_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # recent grpcio raises instead of returning 0
        raise OSError(f"cannot bind the DraftService to {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind the DraftService to {address}")
    return bound
