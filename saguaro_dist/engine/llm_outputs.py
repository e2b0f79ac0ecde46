"""What LLM hands back, built from finished (or updated) Sequences: generate()'s RequestOutput per prompt,
and stream()'s items (n = 1: the StreamDelta the HTTP server reads; n > 1: vLLM's RequestOutput shapes).
RequestOutput / CompletionOutput carry vLLM's Logprob objects (engine/logprob_objects.py); StreamDelta keeps
the engine's plain entries. Split from engine/llm.py."""
from __future__ import annotations

from dataclasses import dataclass, field

from saguaro_dist.engine.engine import Update
from saguaro_dist.engine.llm_inputs import PromptRequest
from saguaro_dist.engine.logprob_objects import TokenTexts, logprob_entries
from saguaro_dist.engine.outputs import CompletionOutput, RequestOutput, StreamDelta, cumulative_logprob
from saguaro_dist.engine.sequence import OutputKind, Sequence
from saguaro_dist.sampling_params import SamplingParams


def request_output(request: PromptRequest, samples: list[Sequence], texts: TokenTexts) -> RequestOutput:
    """The finished samples of one prompt; the prompt's fields and the metrics are sample 0's (the one sample
    that scored the prompt)."""
    first = samples[0]
    return RequestOutput.of_samples(request.request_id, request.text, first.prompt_token_ids,
                                    prompt_logprobs(first.prompt_logprobs, first.params, texts),
                                    [completion(i, seq, texts) for i, seq in enumerate(samples)], first.metrics)


def completion(index: int, seq: Sequence, texts: TokenTexts) -> CompletionOutput:
    token_ids = list(seq.output_token_ids)
    entries = list(seq.output_logprobs) if seq.params.logprobs is not None else None
    return CompletionOutput(index, output_text(seq.params, seq.text), token_ids, cumulative_logprob(token_ids, entries),
                            sample_logprobs(entries, seq.params, texts),
                            seq.finish_reason.value if seq.finish_reason else None, seq.stop_reason)


def sample_logprobs(entries, params: SamplingParams, texts: TokenTexts):
    """Output tokens' engine entries as vLLM's {token id: Logprob} (ranked among the top params.logprobs)."""
    return logprob_entries(entries, params.logprobs, texts.decoder(params.detokenize))


def prompt_logprobs(entries, params: SamplingParams, texts: TokenTexts):
    """Prompt tokens' engine entries (None first) as vLLM's, ranked among the top params.prompt_logprobs."""
    return logprob_entries(entries, params.prompt_logprobs, texts.decoder(params.detokenize))


def output_text(params: SamplingParams, text: str) -> str:
    """The text an output shows: none with detokenize=False (vLLM's: token ids only)."""
    return text if params.detokenize else ""


def finish_fields(u: Update) -> tuple[str | None, int | str | None]:
    """(finish_reason, stop_reason) of an update: set on a sample's last one only."""
    if not u.finished:
        return None, None
    return (u.seq.finish_reason.value if u.seq.finish_reason else None), u.seq.stop_reason


def stream_delta(u: Update, request_id: str) -> StreamDelta:
    """n = 1's stream item (what the HTTP server reads): the engine's plain logprob entries, unchanged."""
    reason, stop_reason = finish_fields(u)
    return StreamDelta(request_id, output_text(u.seq.params, u.text_delta), u.token_delta, u.finished, reason,
                       u.seq.metrics if u.finished else None, u.logprobs_delta, u.prompt_logprobs, stop_reason)


def stream_shape(request: PromptRequest, kind: OutputKind, texts: TokenTexts):
    """What stream() yields for (sample index, update, every sample finished): n = 1 its StreamDelta (the
    stream's shape before n), n > 1 vLLM's RequestOutput (SampleDeltas, or SamplesAtEnd for FINAL_ONLY)."""
    if len(request.samples) == 1:
        return lambda _, update, __: stream_delta(update, request.request_id)
    return SampleDeltas(request, texts) if kind is OutputKind.DELTA else SamplesAtEnd(request, texts)


@dataclass
class SampleDeltas:
    """stream() with n > 1, DELTA: each update as a RequestOutput of its one sample (vLLM's AsyncLLM)."""
    request: PromptRequest
    texts: TokenTexts
    prompt_token_ids: list[int] = field(init=False)
    sums: dict[int, float] = field(default_factory=dict)  # each sample's cumulative log p so far

    def __post_init__(self):
        self.prompt_token_ids = list(self.request.samples[0].prompt_token_ids)  # read before the engine has them

    def __call__(self, index: int, u: Update, all_finished: bool) -> RequestOutput:
        reason, stop_reason = finish_fields(u)
        params = u.seq.params
        sample = CompletionOutput(index, output_text(params, u.text_delta), u.token_delta, self._cumulative(index, u),
                                  sample_logprobs(u.logprobs_delta, params, self.texts), reason, stop_reason)
        return RequestOutput.of_samples(self.request.request_id, self.request.text, self.prompt_token_ids,
                                        prompt_logprobs(u.prompt_logprobs, params, self.texts), [sample],
                                        u.seq.metrics if u.finished else None, all_finished)

    def _cumulative(self, index: int, u: Update) -> float | None:
        if u.logprobs_delta is None:
            return None
        self.sums[index] = self.sums.get(index, 0.0) + cumulative_logprob(u.token_delta, u.logprobs_delta)
        return self.sums[index]


@dataclass
class SamplesAtEnd:
    """stream() with n > 1, FINAL_ONLY: one RequestOutput once every sample finished, as generate() builds it."""
    request: PromptRequest
    texts: TokenTexts
    finished: dict[int, Sequence] = field(default_factory=dict)

    def __call__(self, index: int, u: Update, all_finished: bool) -> RequestOutput | None:
        self.finished[index] = u.seq
        if not all_finished:
            return None
        return request_output(self.request, [self.finished[i] for i in range(len(self.request.samples))], self.texts)
