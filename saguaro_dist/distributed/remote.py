"""Messages between the driver (LLM) and the target's rank 0, which runs the engine on the cluster."""
from __future__ import annotations

from dataclasses import dataclass

from saguaro_dist.engine.metrics import EngineLoad, RequestMetrics
from saguaro_dist.engine.sequence import OutputKind
from saguaro_dist.lora_request import LoRARequest
from saguaro_dist.sampling_params import SamplingParams


@dataclass
class RemoteRequest:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: OutputKind = OutputKind.DELTA
    stream_interval_s: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # every target rank loads it into the same slot (tp_runner.py)


@dataclass
class RemoteUpdate:
    request_id: str
    text_delta: str
    token_delta: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None   # the engine failed this request (retriable), or the request failed alone (invalid)
    invalid: bool = False      # error is the request's own (a ValueError: a grammar llguidance cannot follow), not retriable
    logprobs_delta: list[dict[int, float]] | None = None  # per token of token_delta, if the request asked
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first update, if the request asked
    stop_reason: int | str | None = None  # with the last update: the stop_token_id or stop string that ended it


@dataclass
class RemotePoll:
    """Rank 0's answer to a poll: the updates since the last one, and what its engine holds now."""
    updates: list[RemoteUpdate]
    load: EngineLoad
    lost: str | None = None  # why its tensor-parallel group broke (tp_runner.BroadcastRunner.lost): it runs no more
