"""What callers get back."""
from __future__ import annotations

from dataclasses import dataclass

from saguaro_dist.engine.metrics import RequestMetrics


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None   # "stop", "length" or "abort"
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None  # per token of token_ids: {token id: log p}, if asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token (the first: None), if asked for
    stop_reason: int | str | None = None  # the stop_token_id or stop string that ended it (vLLM's); None otherwise


@dataclass
class StreamDelta:
    request_id: str
    text: str                    # new text since the previous delta
    token_ids: list[int]         # new token ids since the previous delta
    finished: bool
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None  # on the final delta
    logprobs: list[dict[int, float]] | None = None  # per token of token_ids, if the request asked for them
    prompt_logprobs: list[dict[int, float] | None] | None = None  # on the first delta, if asked for
    stop_reason: int | str | None = None  # on the final delta: the stop_token_id or stop string that ended it
