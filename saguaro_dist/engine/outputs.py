"""What callers get back."""
from __future__ import annotations

from dataclasses import dataclass, field

from saguaro_dist.engine.logprob_objects import Logprob, logprob_value
from saguaro_dist.engine.metrics import RequestMetrics

SampleLogprobs = list[dict[int, Logprob]]  # vLLM's: per output token, {token id: Logprob}
PromptLogprobs = list[dict[int, Logprob] | None]  # vLLM's: per prompt token (the first: None)


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput): SamplingParams.n of them per prompt."""
    index: int                   # the sample's place among the request's n (0..n-1)
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the chosen tokens' log p; None unless logprobs were asked (vLLM's)
    logprobs: SampleLogprobs | None  # per token of token_ids: {token id: Logprob}, the chosen first, if asked for
    finish_reason: str | None = None   # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop_token_id or stop string that ended it (vLLM's); None otherwise

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result (vLLM's RequestOutput): its samples in `outputs`, in index order. The flat text /
    token_ids / finish_reason / logprobs / stop_reason of earlier releases stay, as sample 0's (the same
    objects as outputs[0]'s); built from them alone (the old constructor), outputs is that one sample."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None   # "stop", "length" or "abort"
    metrics: RequestMetrics     # sample 0's: its timings and speculation counters
    logprobs: SampleLogprobs | None = None  # per token of token_ids: {token id: Logprob}, if asked for
    prompt_logprobs: PromptLogprobs | None = None  # per prompt token (the first: None), if asked for
    stop_reason: int | str | None = None  # the stop_token_id or stop string that ended it (vLLM's); None otherwise
    outputs: list[CompletionOutput] = field(default_factory=list)  # the SamplingParams.n samples
    finished: bool = True

    def __post_init__(self):
        if not self.outputs:
            self.outputs = [CompletionOutput(0, self.text, self.token_ids, cumulative_logprob(self.token_ids, self.logprobs),
                                             self.logprobs, self.finish_reason, self.stop_reason)]

    @classmethod
    def of_samples(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                   prompt_logprobs: PromptLogprobs | None, outputs: list[CompletionOutput],
                   metrics: RequestMetrics, finished: bool = True) -> RequestOutput:
        """vLLM's fields; the flat ones are outputs[0]'s."""
        first = outputs[0]
        return cls(request_id, prompt, prompt_token_ids, first.text, first.token_ids, first.finish_reason, metrics,
                   first.logprobs, prompt_logprobs, first.stop_reason, outputs, finished)


def cumulative_logprob(token_ids: list[int], logprobs: list[dict[int, Logprob | float]] | None) -> float | None:
    """The sum of each chosen token's log-probability (every logprobs dict holds its chosen token, as a Logprob
    or, in the engine's entries, a float); None without logprobs, as vLLM's."""
    if logprobs is None:
        return None
    return float(sum(logprob_value(lp[t]) for t, lp in zip(token_ids, logprobs)))


@dataclass
class StreamDelta:
    """stream()'s item for n = 1, which the HTTP server reads: its logprobs stay the engine's plain entries
    ({token id: log p}, the chosen token first, its rank as `.rank`), which the server shapes itself."""
    request_id: str
    text: str                    # new text since the previous delta
    token_ids: list[int]         # new token ids since the previous delta
    finished: bool
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None  # on the final delta
    logprobs: list[dict[int, float]] | None = None  # per token of token_ids, if the request asked for them
    prompt_logprobs: list[dict[int, float] | None] | None = None  # on the first delta, if asked for
    stop_reason: int | str | None = None  # on the final delta: the stop_token_id or stop string that ended it
