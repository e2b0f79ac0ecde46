"""One DraftService as the target side holds it (Link: channel, stub, the Speculate stream's outbox, its
just-in-time calls in flight), the hand-off of requests to gRPC's request thread (await_sent), and the
engine's exceptions for gRPC statuses. GrpcDraftBackend (grpc_backend.py) runs a pool of these."""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from saguaro_dist.distributed import codec
from saguaro_dist.distributed.cpu import yield_cpu
from saguaro_dist.distributed.draft_server import MIN_PING_INTERVAL_MS
from saguaro_dist.distributed.errors import (DraftOutOfSync, DraftRefused, DraftRpcError, DraftUnavailable, OutOfOrder,
                                          UnknownSequence)
from saguaro_dist.distributed.proto import saguaro_pb2 as pb, saguaro_pb2_grpc
from saguaro_dist.engine.messages import JitDraftRequest, Release

log = logging.getLogger(__name__)

CLOSE = object()  # ends a stream's request iterator
TRANSPORT_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
HANDOFF_S = 0.002  # how long send_outcomes yields for gRPC's threads to send the outcomes (await_sent)
# Release batches kept per stream until a later answer on it shows the server read them (Link.send_releases): a
# stream with no just-in-time drafts on it (the split draft's) keeps only the latest this many.
UNCONFIRMED_RELEASES_KEPT = 4096


SERVER_MIN_PING_INTERVAL_MS = MIN_PING_INTERVAL_MS  # (draft_server.py) a keepalive under it gets a GOAWAY
KEEPALIVE_FLOOR_MS = SERVER_MIN_PING_INTERVAL_MS + 1_000
# gRPC's reconnect backoff grows x1.6 up to 120 s by default: a server back after minutes away would wait
# up to that long to be dialled again. Capped, a restarted server serves again within ~this (+20% jitter).
MAX_RECONNECT_BACKOFF_MS = 5_000


@dataclass(frozen=True)
class Keepalive:
    """The target's HTTP/2 keepalive pings to each server: a server gone without a reset (its node lost, a NAT
    or load balancer that dropped the connection's state) is found within time_ms + timeout_ms, idle or not."""
    time_ms: int = 10_000
    timeout_ms: int = 5_000

    def __post_init__(self):
        if self.time_ms < KEEPALIVE_FLOOR_MS:
            raise ValueError(f"keepalive time_ms={self.time_ms} is under {KEEPALIVE_FLOOR_MS}: the draft server "
                             f"allows a ping every {SERVER_MIN_PING_INTERVAL_MS} ms and ends connections that ping more")
        if self.timeout_ms <= 0:
            raise ValueError(f"keepalive timeout_ms must be positive, got {self.timeout_ms}")


DEFAULT_KEEPALIVE = Keepalive()


def channel_options(max_message_bytes: int, keepalive: Keepalive = DEFAULT_KEEPALIVE) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive.time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.timeout_ms),
        # What gRPC waits for a ping's ack (1 min by default when keepalive is on); since core moved keepalive onto
        # its ping manager this, not keepalive_timeout_ms, is what closes a connection whose peer went silent.
        ("grpc.http2.ping_timeout_ms", keepalive.timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # By default gRPC sends 2 pings without data, then one a minute (grpc/grpc#25722): on a Speculate stream
        # idle for minutes (a quiet server) a vanished server went unnoticed ~70 s, not time_ms + timeout_ms.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


class Outbox:
    """One Speculate stream's requests: queued by the engine, taken and sent by gRPC's request thread."""

    def __init__(self):
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.queued = 0  # requests put (the engine's thread writes it)
        self.sent = 0    # requests sent (the request thread writes it)

    def put(self, item) -> int:
        """Queue `item`; returns its ticket: it is sent once `sent` reaches it."""
        self.pending.put(item)
        self.queued += 1
        return self.queued

    def requests(self):
        """The stream's request iterator, until close. gRPC's request thread asks for the next request
        only once the last one is sent, so each ask after the first counts one more sent."""
        while (item := self.pending.get()) is not CLOSE:
            yield item
            self.sent += 1


def await_sent(tickets: list[tuple[Outbox, int]]) -> None:
    """Yield the GIL until gRPC's request threads have sent every ticketed request (at most HANDOFF_S).

    The engine verifies right after sending outcomes. Left to compete with that verify for the GIL and
    a CPU, gRPC's threads put an outcome on the wire 0.4 ms after it was queued at the median but
    3.5-4.5 ms at the 90th percentile (a scheduler tick on the 2-vCPU development VM), and the draft's
    next tree came that much later (docs/architecture.md, "Sending outcomes before the verify"). The
    wait yields the CPU too, not only the GIL: gRPC's threads are then runnable on the engine's vCPU
    (the other one is the draft's), and time.sleep(0) kept it from them until the scheduler stepped in."""
    end = time.perf_counter() + HANDOFF_S
    while any(outbox.sent < ticket for outbox, ticket in tickets) and time.perf_counter() < end:
        yield_cpu()


def error_from_status(code: grpc.StatusCode, details: str, address: str, seq_ids: list[int]) -> Exception:
    """The exception the engine would have seen from an in-process DraftWorker (or DraftUnavailable)."""
    if code in TRANSPORT_FAILURES or code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return DraftUnavailable(f"draft server {address}: {code.name}: {details}", seq_ids)
    if code is grpc.StatusCode.NOT_FOUND:
        return UnknownSequence(details)
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return OutOfOrder(details)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return DraftRefused(f"draft server {address}: {code.name}: {details}", code)
    return DraftRpcError(f"draft server {address}: {code.name}: {details}", code)


def error_from_rpc(err: grpc.RpcError, address: str, seq_ids: list[int]) -> Exception:
    return error_from_status(err.code(), err.details(), address, seq_ids)


class Link:
    """One DraftService: channel, stub, the open Speculate stream, its JIT calls in flight, liveness."""

    def __init__(self, address: str, options):
        self.address = address
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = saguaro_pb2_grpc.DraftServiceStub(self.channel)
        self.alive = True
        self.graph_captures = 0  # the server's CUDA-graph capture count, as its last reply said
        self.lock = threading.Lock()  # the request queue and the calls in flight change together
        self.outbox = Outbox()
        self.calls: dict[int, tuple[Future, list[int], int]] = {}  # call_id -> (answer, its seq_ids, its ticket)
        self.parts: dict[int, list[pb.JitDraftResult]] = {}  # call_id -> the parts of its answer come so far
        # Releases queued on this stream that no answer has shown read yet, by ticket: lost with a failed stream
        # (restart_queue), they are sent again (ServerLinks): else the server kept those sequences until it restarted.
        self.unconfirmed: list[tuple[int, list[Release]]] = []
        self.call = None
        self.reader: threading.Thread | None = None
        self.requests_ended = False  # end_requests ran (the backend is closing): no stream opens again
        self._call_ids = itertools.count(1)

    def open_stream(self) -> None:
        with self.lock:  # end_requests either closes the queue this stream reads or comes first and refuses it
            if self.requests_ended:
                raise ValueError("Channel closed: the backend is closing")  # what a closed channel raises
            self.call = self.stub.Speculate(self.outbox.requests())

    def send(self, request: pb.SpeculateRequest) -> tuple[Outbox, int]:
        """Queue `request` on the stream; returns its outbox and ticket (see await_sent)."""
        with self.lock:
            return self.outbox, self.outbox.put(request)

    def send_releases(self, releases: list[Release]) -> tuple[Outbox, int]:
        """Queue releases on the stream (see send), kept until an answer shows them read (unconfirmed); not one
        naming no life (generation 0 ends any): sent again, it could end a life begun there since."""
        request = pb.SpeculateRequest(releases=codec.release_batch_to_proto(releases))
        with self.lock:
            ticket = self.outbox.put(request)
            self.unconfirmed.append((ticket, [r for r in releases if r.generation]))
            if len(self.unconfirmed) > UNCONFIRMED_RELEASES_KEPT:
                del self.unconfirmed[0]
            return self.outbox, ticket

    def call_jit(self, reqs: list[JitDraftRequest]) -> tuple[int, Future]:
        """Queue a just-in-time draft: (call_id, a future of its proposals or the exception it maps to)."""
        answer: Future = Future()
        with self.lock:
            call_id = next(self._call_ids)
            call = pb.JitDraftCall(call_id=call_id, batch=codec.jit_batch_to_proto(reqs))
            ticket = self.outbox.put(pb.SpeculateRequest(jit_draft=call))
            self.calls[call_id] = (answer, [r.seq_id for r in reqs], ticket)
        return call_id, answer

    def answer(self, result: pb.JitDraftResult) -> None:
        """Take a just-in-time answer, or a part of one (parts_after > 0: kept until its last part)."""
        with self.lock:
            if result.parts_after and result.call_id in self.calls and not result.HasField("error"):
                self.parts.setdefault(result.call_id, []).append(result)
                return
            parts = self.parts.pop(result.call_id, []) + [result]
            answer, seq_ids, ticket = self.calls.pop(result.call_id, (None, None, 0))
            # The server reads a stream in order and answers a draft once read: what was queued before it was read.
            self.unconfirmed = [(t, releases) for t, releases in self.unconfirmed if t > ticket]
        if answer is None:  # it timed out meanwhile
            return
        if result.HasField("error"):
            code = STATUS_BY_NUMBER.get(result.error.code, grpc.StatusCode.UNKNOWN)
            answer.set_exception(error_from_status(code, result.error.message, self.address, seq_ids))
            return
        try:
            answer.set_result(self._proposals(parts, seq_ids))
        except Exception as exc:  # a bug or a mismatched peer: those sequences drafted afresh, the others kept
            log.error("draft server %s answered a malformed draft: %s", self.address, exc)
            answer.set_exception(DraftOutOfSync(f"draft server {self.address} answered a malformed draft: {exc}",
                                                seq_ids))

    @staticmethod
    def _proposals(parts: list[pb.JitDraftResult], seq_ids: list[int]) -> list:
        """The proposals of an answer's parts, joined in order (each part counts the parts after it)."""
        if [p.parts_after for p in parts] != list(range(len(parts) - 1, -1, -1)):
            raise codec.CodecError(f"an answer's parts count {[p.parts_after for p in parts][:8]} parts after them")
        proposals = [p for part in parts for p in codec.proposal_batch_from_proto(part.proposals)]
        if len(proposals) != len(seq_ids):
            raise codec.CodecError(f"{len(proposals)} proposals for the {len(seq_ids)} sequences asked {seq_ids[:8]}")
        return proposals

    def forget(self, call_id: int) -> None:
        with self.lock:
            self.calls.pop(call_id, None)
            self.parts.pop(call_id, None)

    def restart_queue(self, error) -> list[Release]:
        """What was queued for the old stream is lost with it: fail its calls, start a fresh queue. Returns its
        releases not shown read (to send again).

        error(seq_ids) -> the exception each call in flight gets."""
        with self.lock:
            calls, self.calls, self.parts = self.calls, {}, {}
            unconfirmed, self.unconfirmed = self.unconfirmed, []
            self.outbox.put(CLOSE)
            self.outbox = Outbox()
        for answer, seq_ids, _ in calls.values():
            answer.set_exception(error(seq_ids))
        return [r for _, releases in unconfirmed for r in releases]

    def end_stream(self) -> list[Release]:
        """Cancel the stream; returns its releases not shown read (restart_queue)."""
        unconfirmed = self.restart_queue(lambda seq_ids: DraftUnavailable(f"draft server {self.address}: stream closed",
                                                                          seq_ids))
        if self.call is not None:
            self.call.cancel()
        return unconfirmed

    def end_requests(self) -> None:
        """Half-close the stream: the requests queued on it still go out (the releases the engine sent last: a
        server that outlives this client keeps what it never reads, KV rows included), then the stream's requests
        end; its calls in flight fail (restart_queue). finish_stream waits for the server to end it."""
        with self.lock:
            self.requests_ended = True
        self.restart_queue(lambda seq_ids: DraftUnavailable(f"draft server {self.address}: stream closed", seq_ids))

    def finish_stream(self, deadline: float) -> None:
        """After end_requests: wait until the server has read the stream to its end and ended it, or until
        `deadline` (time.monotonic()) for one stalled or unreachable, then cancel it."""
        if self.call is None:
            return
        try:
            self.call.exception(timeout=max(0.0, deadline - time.monotonic()))
        except grpc.FutureTimeoutError:
            log.warning("draft server %s did not end its Speculate stream in time; cancelled, what was queued on it "
                        "may be lost", self.address)
        except grpc.FutureCancelledError:
            pass
        self.call.cancel()

    def unconfirmed_releases(self) -> list[Release]:
        with self.lock:
            return [r for _, releases in self.unconfirmed for r in releases]
