"""Exceptions shared by the draft side (DraftWorker, DraftService) and the target side (backends).

The same types surface on both transports: the gRPC server maps them to status codes and the gRPC
client maps the codes back, so the engine handles a LocalDraftBackend and a GrpcDraftBackend alike.
"""
from __future__ import annotations


class UnknownSequence(KeyError):
    """The draft holds no sequence with this id (never prefilled, or already released). gRPC: NOT_FOUND."""


class OutOfOrder(RuntimeError):
    """A stale or out-of-order round for a known sequence. gRPC: FAILED_PRECONDITION."""


class DraftBehind(OutOfOrder):
    """A just-in-time draft for a round past the next one: the outcomes before it have not been
    observed. Over gRPC they may still be on the Speculate stream (another call, so the JIT can
    overtake them); the DraftService waits for them before it answers FAILED_PRECONDITION."""


class DraftUnavailable(RuntimeError):
    """The draft server holding these sequences cannot answer (dead, unreachable or past the deadline).

    The engine falls back to the fast backup for `seq_ids`; `partial` holds the proposals that other,
    healthy servers did return in the same call (seq_id -> Proposal), so they need not be redone.
    """

    def __init__(self, message: str, seq_ids=(), partial=None):
        super().__init__(message)
        self.seq_ids = list(seq_ids)
        self.partial = dict(partial or {})


class DraftOutOfSync(DraftUnavailable):
    """The server is alive but lost these sequences' outcomes (they were queued on a Speculate stream
    that failed), so it no longer knows what the target verifies. The engine treats them as it treats
    sequences of a dead server, fast backup then a fresh prefill, but the server stays in the pool."""


class DraftRpcError(RuntimeError):
    """Any other status a draft server answered (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, INTERNAL, ...)."""

    def __init__(self, message: str, code=None):
        super().__init__(message)
        self.code = code  # the grpc.StatusCode, when it came from gRPC


class DraftRefused(DraftRpcError, ValueError):
    """INVALID_ARGUMENT: the server refused what the request holds (the DraftWorker's ValueError, a malformed
    message; draft_service.status_for), so sent again it is refused again. A ValueError, as the worker's own is in
    this process: the engine tells it from a failure that may pass (INTERNAL, RESOURCE_EXHAUSTED: out of memory)."""
