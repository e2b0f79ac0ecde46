"""A stream's reading state, shared by Stream / AsyncStream and their reader."""
from __future__ import annotations

from enum import Enum

import httpx

from saguaro_dist.client._common import StreamAccumulator
from saguaro_dist.client.errors import StreamClosedError

# A stream's facts, read through Stream / AsyncStream: StreamAccumulator's public attributes
STREAM_FACTS = frozenset({"texts", "finish_reason", "usage", "speculation", "model", "id", "tool_calls", "reasoning",
                          "stop_reason"})


class StreamState(Enum):
    """Where a Stream / AsyncStream is: what a second loop over it does (start_reading)."""
    NEW = "new"
    READING = "reading"
    ENDED = "ended"    # read to its end (or its error)
    CLOSED = "closed"  # closed before its end: a loop left early, close(), a read cancelled or interrupted


def start_reading(state: StreamState) -> bool:
    """Whether a read of the stream (a loop, next(), chunks()) goes on reading it: loops and next() share one reader,
    so a loop after next() goes on where it left off. After its end another loop yields nothing, as openai's Stream
    (one generator, exhausted); after an early close the rest is gone, which a quiet end would hide."""
    if state in (StreamState.NEW, StreamState.READING):
        return True
    if state is StreamState.ENDED:
        return False
    raise StreamClosedError("the stream was closed before its end (a loop left early, close(), or a read cancelled "
                            "or interrupted): its remaining deltas are gone; iterate a stream once, or take its first "
                            "delta with next(stream)")


class StreamCore:
    """What a stream's reader needs: the reply, its facts, the state. The reader holds this, never the Stream, so a
    Stream dropped mid-read has no reference cycle waiting for the cyclic GC: it is freed at once and its finalizer
    gives the connection back (a saguaro server stops generating)."""

    def __init__(self, response: httpx.Response, expected_choices: int | None = None):
        self.response = response
        self.acc = StreamAccumulator(response.status_code, expected_choices)
        self.state = StreamState.NEW

    def mark_ended(self) -> None:
        """Read to its end or its error, unless closed first."""
        if self.state is StreamState.READING:
            self.state = StreamState.ENDED

    def mark_closed(self) -> None:
        if self.state is not StreamState.ENDED:
            self.state = StreamState.CLOSED
