"""The draft side over gRPC: a DraftService servicer around any object with the DraftWorker interface.

One asyncio event loop serves every call (grpc.aio), and every call to the worker runs on that loop's
thread, inline, in arrival order: the worker is single-threaded, and running it where the message
arrives saves the thread hand-offs of a thread-per-call server (on the development VM each cost
~0.3 ms; benchmarks/bench_grpc_hops.py). The Speculate stream carries outcomes, just-in-time drafts
and releases in the order the target sent them; it answers each just-in-time draft at once and pushes
each tree batch as soon as the worker has built it: after every outcome batch, and after every
just-in-time draft (its speculation is pending, so the tree for it follows while the target already
has its proposals).

Status codes at the edge: INVALID_ARGUMENT (undecodable or malformed message, or a ValueError from
the worker), RESOURCE_EXHAUSTED (over the message size limit, sized from the worker's config by
message_limits.py; gRPC enforces it on receipt; a just-in-time answer over it goes out in parts on the stream,
and as a unary call it is refused before the worker drafts),
NOT_FOUND (UnknownSequence / KeyError), FAILED_PRECONDITION (OutOfOrder), INTERNAL (anything else).
A just-in-time draft on the stream gets its status in its JitDraftResult and the stream lives on.
A failed call never takes the server down. A unary JitDraft that overtook its outcomes on the stream
(DraftBehind) waits for them, up to JIT_CATCH_UP_S, before it fails.

The server that hosts the servicer (its event-loop thread, bound addresses, health service) is
draft_server.py; serve_draft starts the two together.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Iterator

import grpc
from google.protobuf.message import DecodeError

from saguaro_dist.distributed import codec
from saguaro_dist.distributed.cpu import yield_cpu
# local_address: re-exported for the tests and benchmarks that import it from here.
from saguaro_dist.distributed.draft_server import DraftServer, default_bind_host, format_address, local_address
from saguaro_dist.distributed.errors import DraftBehind, OutOfOrder
from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.distributed.message_limits import (DEFAULT_MAX_MESSAGE_BYTES, ReplyTooLarge, check_jit_reply,
                                                    check_limit_holds_a_row, encode_jit_result, encode_trees,
                                                    message_limit_for)
from saguaro_dist.engine.draft_backend import Lives
from saguaro_dist.engine.draft_worker import ContextFull, refuse_duplicates
from saguaro_dist.model.cuda_graphs import graph_captures

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "DraftServer", "DraftServicer", "serve_draft", "default_bind_host",
           "status_for", "format_address", "local_address"]

_PENDING_BATCHES = 64  # tree batches kept while no stream is open (a reconnecting target picks them up)
JIT_CATCH_UP_S = 2.0  # how long a just-in-time draft that overtook its outcomes waits for them
_RELEASED_KEPT = 4096  # released sequence ids remembered, so that a late outcome of one is dropped
# Stream requests after which the target asks again within a round (its next outcome, or the tree it
# waits for): the loop spins after these. After a release or a catch-up it may not ask for long, and
# a spinning vCPU slowed the target's verify beside it (b = 1 greedy on Ray, mostly n-gram rounds).
WANTED_AGAIN_WITHIN_A_ROUND = frozenset({"outcomes", "jit_draft"})


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed call answers with; see the module docstring."""
    if isinstance(exc, ContextFull):  # well-formed, but past the draft's context
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (DecodeError, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {exc}"
    if isinstance(exc, ReplyTooLarge):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, KeyError):  # UnknownSequence included; str(KeyError) would add quotes
        return grpc.StatusCode.NOT_FOUND, str(exc.args[0]) if exc.args else "unknown sequence"
    if isinstance(exc, OutOfOrder):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "draft worker out of memory"
    return grpc.StatusCode.INTERNAL, f"draft worker failed: {type(exc).__name__}: {exc}"


class _StreamFailed(Exception):
    """Ends a Speculate stream with this status (raised where the handler cannot await an abort)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _Stream:
    """One open Speculate call: tree batches pushed to it from elsewhere (after a unary JitDraft)."""

    def __init__(self):
        self.pushed: asyncio.Queue = asyncio.Queue()


class DraftServicer:
    """saguaro.v1.DraftService around `worker` (prefill / jit_draft / observe / plan_trees /
    finish_trees / release).
    Every method runs on the server's event loop; the worker is called there, inline."""

    def __init__(self, worker, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, announce_plans: bool = False):
        """announce_plans: push the worker's tree plans ahead of its trees (see serve_draft)."""
        check_limit_holds_a_row(worker, max_message_bytes)
        self.worker = worker
        self.max_message_bytes, self.announce_plans = max_message_bytes, announce_plans
        self.spin_s = getattr(getattr(worker, "config", None), "draft_spin_s", 0.0)
        self._streams: list[_Stream] = []
        self._pending: collections.deque = collections.deque(maxlen=_PENDING_BATCHES)
        self._observed: asyncio.Event | None = None  # set (and replaced) after each outcome batch observed
        self._released: dict[int, None] = {}  # recently released ids, oldest first
        # Each sequence's life as last prefilled here: a late release of an earlier life (a re-prefill overtook it)
        # is dropped, not remembered as released, which would drop the new life's outcomes. (The worker drops
        # late outcomes and drafts of an earlier life itself.)
        self._lives = Lives()
        self._spin_until = 0.0

    # ---- unary calls -------------------------------------------------------------------------------
    async def Prefill(self, raw: bytes, context) -> pb.PrefillReply:
        reqs = await self._decode(context, raw, pb.PrefillBatch, codec.prefill_batch_from_proto)
        await self._call(context, self._prefill, reqs)
        return pb.PrefillReply()

    def _prefill(self, reqs) -> None:
        self.worker.prefill(reqs)
        self._lives.begin(reqs)
        for r in reqs:  # a sequence placed here again is live again
            self._released.pop(r.seq_id, None)

    async def JitDraft(self, raw: bytes, context) -> pb.ProposalBatch:
        reqs = await self._decode(context, raw, pb.JitDraftBatch, codec.jit_batch_from_proto)
        proposals = await self._call(context, self._jit_after_outcomes, reqs)
        # The tree for this speculation is built once this handler has handed its reply to gRPC.
        asyncio.get_running_loop().call_soon(self._build_and_broadcast)
        reply = codec.proposal_batch_to_proto(proposals)
        if too_big := self._oversize(reply):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_big)
        return reply

    def _oversize(self, reply) -> str | None:
        """Why a reply may not be sent (over the size limit), or None."""
        size = reply.ByteSize()
        return f"{size} byte reply exceeds the {self.max_message_bytes} byte limit" if size > self.max_message_bytes else None

    async def _jit_after_outcomes(self, reqs):
        """The target sends round r's outcome on the stream and, a verify later, round r + 1's JIT as a
        unary call: on a busy host the JIT can get here first. Then it waits for the stream's outcomes."""
        deadline = time.monotonic() + JIT_CATCH_UP_S
        while True:
            observed = self._observed_event()
            try:
                check_jit_reply(self.worker, reqs, self.max_message_bytes, in_parts=False)  # one message
                return self.worker.jit_draft(reqs)
            except DraftBehind:
                try:
                    await asyncio.wait_for(observed.wait(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise DraftBehind(f"just-in-time draft still ahead of its outcomes after {JIT_CATCH_UP_S} s") from None

    def _observed_event(self) -> asyncio.Event:
        if self._observed is None:
            self._observed = asyncio.Event()
        return self._observed

    def _note_observed(self) -> None:
        if self._observed is not None:
            self._observed.set()
            self._observed = None

    async def Release(self, raw: bytes, context) -> pb.ReleaseReply:
        reqs = await self._decode(context, raw, pb.ReleaseBatch, codec.release_batch_from_proto)
        await self._call(context, self._release, reqs)
        return pb.ReleaseReply()

    def _release(self, reqs) -> None:
        """Release travels as a unary call, outcomes on the stream: a finished sequence's last outcome
        can arrive after its release. Remembering the released ids lets that outcome be dropped; as an
        error it would end the stream, and the other sequences' outcomes queued on it with it."""
        reqs = self._of_current_lives(reqs)
        self.worker.release(reqs)
        self._lives.end(r.seq_id for r in reqs)
        for r in reqs:
            self._released[r.seq_id] = None
        while len(self._released) > _RELEASED_KEPT:
            del self._released[next(iter(self._released))]

    def _of_current_lives(self, reqs: list) -> list:
        """The releases of their sequences' current lives; the others are logged (debug) and dropped."""
        stale = [(r.seq_id, r.generation) for r in reqs if self._lives.stale(r)]
        if stale:
            log.debug("dropped %d release(s) of an earlier life (seq_id, generation): %s", len(stale), stale[:8])
        return [r for r in reqs if not self._lives.stale(r)]

    async def _decode(self, context, raw: bytes, message_type, from_proto):
        """Parse and validate here, not in gRPC's deserializer, so bad bytes get INVALID_ARGUMENT."""
        try:
            return from_proto(message_type.FromString(raw))
        except (DecodeError, ValueError) as exc:
            await context.abort(*status_for(exc))

    async def _call(self, context, fn, reqs):
        """fn(reqs) (awaited if it is a coroutine function); a failure becomes the call's status."""
        try:
            result = fn(reqs)
            return await result if asyncio.iscoroutine(result) else result
        except Exception as exc:
            self._log_failure(fn, exc)
            await context.abort(*status_for(exc))

    @staticmethod
    def _log_failure(fn, exc: Exception) -> None:
        code, _ = status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.error("draft worker %s failed", getattr(fn, "__name__", fn), exc_info=exc)
        else:
            log.info("draft worker %s refused a request (%s): %s", getattr(fn, "__name__", fn), code.name, exc)

    # ---- the Speculate stream ----------------------------------------------------------------------
    async def Speculate(self, request_iterator, context):
        """Answers each request as it arrives (its replies go out before the next is read), and
        forwards what other calls push to this stream meanwhile."""
        stream = self._open_stream()
        requests = request_iterator.__aiter__()
        incoming = asyncio.ensure_future(anext(requests))
        pushed = asyncio.ensure_future(stream.pushed.get())
        try:
            while True:
                done, _ = await asyncio.wait((incoming, pushed), return_when=asyncio.FIRST_COMPLETED)
                if pushed in done:
                    yield _stamped(pushed.result())
                    pushed = asyncio.ensure_future(stream.pushed.get())
                if incoming in done:
                    try:
                        raw = incoming.result()
                    except StopAsyncIteration:
                        return
                    try:
                        msg = pb.SpeculateRequest.FromString(raw)
                        for reply in self._replies(msg):
                            yield _stamped(reply)
                    except Exception as exc:
                        await self._fail_stream(context, exc)  # raises: the stream ends
                    if msg.WhichOneof("kind") in WANTED_AGAIN_WITHIN_A_ROUND:
                        self._keep_polling()
                    incoming = asyncio.ensure_future(anext(requests))
        finally:
            incoming.cancel()
            pushed.cancel()
            self._close_stream(stream)

    async def _fail_stream(self, context, exc: Exception) -> None:
        if not isinstance(exc, _StreamFailed):  # a malformed request (the worker's own failures are logged)
            self._log_failure(self.Speculate, exc)
            exc = _StreamFailed(*status_for(exc))
        await context.abort(exc.code, exc.details)

    def _replies(self, msg: pb.SpeculateRequest) -> Iterator[pb.SpeculateReply]:
        """One request's replies, computed lazily: a just-in-time draft's answer is sent before the
        tree that follows it is built."""
        kind = msg.WhichOneof("kind")
        if kind == "outcomes":
            self._observe(codec.outcome_batch_from_proto(msg.outcomes))
            yield from self._built_trees()
        elif kind == "jit_draft":
            yield from self._jit_on_stream(msg.jit_draft)
        elif kind == "releases":
            self._release_logged(codec.release_batch_from_proto(msg.releases))
        elif kind == "reset_prefix_cache":
            codec.reset_prefix_cache_from_proto(msg.reset_prefix_cache)
            self.worker.reset_prefix_cache()
        elif kind == "catch_up":
            rounds = codec.outcome_rounds_from_proto(msg.catch_up)
            for outcomes in rounds:  # every round checked before the first is observed
                refuse_duplicates(outcomes, "catch-up round's outcome")
            for outcomes in rounds:  # in order: each follows the one before
                self._observe(outcomes)
        else:
            raise codec.CodecError("SpeculateRequest carries none of outcomes, jit_draft, releases, reset_prefix_cache, "
                                   "catch_up")

    def _observe(self, outcomes) -> None:
        try:
            self.worker.observe([o for o in outcomes if o.seq_id not in self._released])
        except Exception as exc:
            self._log_failure(self.worker.observe, exc)
            raise _StreamFailed(*status_for(exc)) from exc
        self._note_observed()

    def _jit_on_stream(self, call: pb.JitDraftCall) -> Iterator[pb.SpeculateReply]:
        """Answer the just-in-time draft, then build the tree that follows it. On the stream nothing can
        overtake the outcomes before it, so a round the worker is not at is a real protocol error,
        answered FAILED_PRECONDITION in band without waiting."""
        try:
            call_id, reqs = codec.jit_call_from_proto(call)
            check_jit_reply(self.worker, reqs, self.max_message_bytes, in_parts=True)
            replies = encode_jit_result(call_id, self.worker.jit_draft(reqs), self.max_message_bytes)
        except Exception as exc:
            self._log_failure(self.worker.jit_draft, exc)
            yield self._jit_error(call.call_id, exc)
            return
        yield from replies  # back to back: nothing else is yielded between a call's parts
        yield from self._built_trees()

    @staticmethod
    def _jit_error(call_id: int, exc: BaseException) -> pb.SpeculateReply:
        code, details = status_for(exc)
        return codec.jit_error_to_proto(call_id, code.value[0], details)

    def _release_logged(self, reqs) -> None:
        try:
            self._release(reqs)
        except Exception as exc:  # nobody waits on a release; say what went wrong
            self._log_failure(self._release, exc)

    def _built_trees(self) -> Iterator[pb.SpeculateReply]:
        """Build the pending trees and encode them, their plans first (if any, sent before the branches
        are decoded); nothing more if that fails. A plan that carries a guess goes out even without
        announce_plans: the target draws that tree's bonus against it (coupled bonus draws)."""
        try:
            plans = self.worker.plan_trees()
            if not self.announce_plans:
                plans = [p for p in plans if p.guess_ids is not None]
            if plans:
                yield pb.SpeculateReply(plans=codec.plan_batch_to_proto(plans))
            trees = self.worker.finish_trees()
        except Exception:  # the target's wait times out and it falls back: a miss, never a wrong token
            log.exception("building speculation trees failed")
            return
        yield from self._encode_trees(trees)

    def _build_and_broadcast(self) -> None:
        """After a unary JitDraft: the tree goes to every open stream (or waits for one)."""
        for batch in self._built_trees():
            if not self._streams:
                self._pending.append(batch)
            for stream in self._streams:
                stream.pushed.put_nowait(batch)

    def _encode_trees(self, trees) -> list[pb.SpeculateReply]:
        return encode_trees(trees, self.max_message_bytes)

    def _open_stream(self) -> _Stream:
        stream = _Stream()
        self._streams.append(stream)
        while self._pending:
            stream.pushed.put_nowait(self._pending.popleft())
        return stream

    def _close_stream(self, stream: _Stream) -> None:
        self._streams.remove(stream)

    def _keep_polling(self) -> None:
        """Keep the loop polling (a ready callback makes it poll its sockets without blocking) for
        spin_s after a message the target follows up within a round, instead of blocking: a blocked
        process lets its virtual CPU halt, and waking it is slow (docs/architecture.md, "Waiting without
        halting")."""
        now = time.perf_counter()
        idle = self._spin_until <= now
        self._spin_until = max(self._spin_until, now + self.spin_s)
        if idle and self.spin_s > 0:
            asyncio.get_running_loop().call_soon(self._spin)

    def _spin(self) -> None:
        if time.perf_counter() < self._spin_until:
            # Yield the CPU as well: gRPC's poller thread, which hands the loop its next message, runs on
            # this vCPU (b = 1 greedy on Ray: tok/s +0.7-3.8% in three alternated process pairs).
            yield_cpu()
            asyncio.get_running_loop().call_soon(self._spin)


def _stamped(reply: pb.SpeculateReply) -> pb.SpeculateReply:
    """The reply with this process's CUDA-graph capture count as it leaves: the target's tree gate leaves
    out a round during which the count moved (it timed a capture; engine/ssd_loop.py)."""
    reply.graph_captures = graph_captures()
    return reply


def serve_draft(worker, host: str | None = None, port: int = 0, *, max_message_bytes: int | None = None,
                max_concurrent_rpcs: int | None = None, local: str | None = None,
                announce_plans: bool = False) -> tuple[DraftServer, int]:
    """Start a DraftService (plus grpc.health.v1) for `worker`; returns the started server and its port.

    host: None binds the node's cluster address (default_bind_host()). port 0 picks a free port.
    max_message_bytes: None sizes it from the worker's config (message_limits.message_limit_for).
    max_concurrent_rpcs: calls beyond it get RESOURCE_EXHAUSTED (None: no bound).
    local: also serve on this gRPC address for clients on the node (local_address()), None: not.
    announce_plans: push each tree's TreePlan ahead of it while the target waits for trees. Off by default:
    measured on loopback CPUs it cost more than the tree waits it saved: the pushed plan wakes the target's
    stream reader during its verify, and this service cannot stop a tree mid-build once the target has
    moved on (docs/architecture.md, "Tree plans"); the target side honours plans from any server that
    sends them.
    """
    host = default_bind_host() if host is None else host
    max_message_bytes = message_limit_for(worker) if max_message_bytes is None else max_message_bytes
    server = DraftServer(DraftServicer(worker, max_message_bytes, announce_plans), host, port, max_message_bytes,
                         max_concurrent_rpcs, local)
    log.info("DraftService listening on %s%s", format_address(host, server.port), f" and {local}" if local else "")
    return server, server.port
