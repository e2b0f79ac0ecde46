"""The public entry point: `LLM(...).generate(...)`, `LLM.stream(...)` for serving."""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from tqdm import tqdm

from saguaro_dist.config import Config, Mode, SchedulingPolicy
from saguaro_dist.engine.engine import Update, check_prompt_ids
from saguaro_dist.engine.loop_thread import EngineThread
from saguaro_dist.engine.metrics import EngineLoad
from saguaro_dist.engine.outputs import CompletionOutput, RequestOutput, StreamDelta, cumulative_logprob
from saguaro_dist.engine.sequence import OutputKind, Sequence, engine_request_seed
from saguaro_dist.engine.structured import GrammarCompiler
from saguaro_dist.engine.text import encode_text
from saguaro_dist.model.loader import load_generation_defaults
from saguaro_dist.sampling_params import (SamplingParams, as_token_ids, as_tuple, check_against_model, truncate_prompt,
                                          until_context_end, with_bad_word_ids)

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "StreamDelta"]
log = logging.getLogger(__name__)


@dataclass
class PromptRequest:
    """One prompt as submitted: its SamplingParams.n samples, each a Sequence of its own, in index order."""
    request_id: str
    text: str | None
    samples: list[Sequence]


class LLM:
    """An SSD / SD / AR engine over a target (and draft) checkpoint.

    >>> llm = LLM(model=TARGET, draft=DRAFT, mode="ssd", k=4, fan_out=12)
    >>> llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=32))[0].text
    """

    def __init__(self, model: str, draft: str | None = None, **kwargs):
        self._setup(Config(model=model, draft=draft, **kwargs))

    @classmethod
    def from_config(cls, config: Config) -> "LLM":
        llm = cls.__new__(cls)
        llm._setup(config)
        return llm

    def _setup(self, config: Config) -> None:
        self.config = config
        self.generation_defaults = generation_defaults(config)  # before any engine starts: a bad file leaks nothing
        self._ids = itertools.count()
        self._open: dict[str, tuple[str, ...]] = {}  # request id of each open stream -> its samples' engine ids
        if config.cluster is None:
            from saguaro_dist.engine.build import build_local_engine
            engine, self.tokenizer = build_local_engine(config)
            self._thread = EngineThread(engine)
        else:
            from saguaro_dist.distributed.cluster import build_cluster_engine
            self._thread, self.tokenizer = build_cluster_engine(config)
        # A speculative round scores up to K+1 positions past the last token: keep them inside the model.
        headroom = 0 if config.mode is Mode.AR else config.k + 1
        self.max_model_len = self._thread.max_model_len - headroom
        if headroom and self.max_model_len < 2:  # else every request failed against a max length of 0 or less
            self._thread.stop()
            raise ValueError(f"k = {config.k} leaves no room in a context of {self._thread.max_model_len} tokens: a "
                             f"round scores K+1 positions past a prompt token and a generated one (lower k, or "
                             f"raise max_model_len)")
        self.vocab_size, self.eos_token_ids = self._thread.vocab_size, self._thread.eos_token_ids
        self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)


    def default_sampling_params(self) -> SamplingParams:
        """The SamplingParams generate / chat / stream use when given none: the generation config's
        defaults (vLLM's get_default_sampling_params)."""
        return SamplingParams(**self.generation_defaults)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's name for default_sampling_params()."""
        return self.default_sampling_params()

    def get_tokenizer(self):
        """vLLM's: the tokenizer prompts are encoded and outputs decoded with."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (pass prompt_token_ids; outputs carry token ids)")
        return self.tokenizer

    @property
    def metrics(self):
        """Engine-wide counters and the time split of the round loop."""
        return self._thread.metrics

    @property
    def load(self) -> EngineLoad:
        """What the engine holds now: requests running and waiting, and the share of the KV budget they use
        (a snapshot as of the engine's last step; on Ray, of rank 0's last poll)."""
        return self._thread.load

    # ---- requests ---------------------------------------------------------------------------
    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, *, use_tqdm: bool | Callable = True,
                 lora_request=None, priority: list[int] | None = None,
                 tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate for every prompt (continuously batched); outputs in prompt order, each with
        SamplingParams.n samples in `outputs` (index order; sample i of a seeded request draws from seed + i).
        priority: one int per prompt, lower admitted first (needs scheduling_policy="priority", as vLLM).
        use_tqdm: vLLM's progress bar of finished samples and output tokens/s, on stderr when it is a
        terminal; a callable (vLLM's) makes the bar instead of tqdm. An interrupt (Ctrl-C) aborts the
        samples not yet finished before it propagates. lora_request / tokenization_kwargs: vLLM's, refused
        unless empty (no LoRA adapters; prompts are encoded as the model's tokenizer does by default)."""
        refuse_unsupported(lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)
        requests = self._requests(prompts, prompt_token_ids, sampling_params, priority)
        seqs = [seq for request in requests for seq in request.samples]
        finished: queue.Queue[int] = queue.Queue()
        results: list = [None] * len(seqs)
        for seq in seqs:
            seq.output_kind = OutputKind.FINAL_ONLY
        try:
            self._thread.submit_many([(seq, self._collector(i, results, finished)) for i, seq in enumerate(seqs)])
            self._wait(results, finished, use_tqdm)
        except BaseException:  # Ctrl-C (a notebook's interrupt): the batch must not run on ahead of the next call
            self._abort_unfinished([seq for seq, result in zip(seqs, results) if result is None])
            raise
        for r in results:
            if isinstance(r, BaseException):
                raise r
        done = iter(results)
        return [self._output(request, [next(done) for _ in request.samples]) for request in requests]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, tokenization_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None, *, priority: list[int] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat (its arguments, in its positional order): one conversation (OpenAI messages: role,
        content, tool_calls, tool_call_id) or a list of them, rendered as the server renders
        /v1/chat/completions (`chat_template`, a Jinja template or a file of one, else the tokenizer's, with
        `tools`; a plain transcript without one; add_generation_prompt / continue_final_message as vLLM's),
        then generated; outputs in conversation order. Message content reaches the template as a string
        (chat_template_content_format "auto" or "string"); lora_request, tokenization_kwargs and
        mm_processor_kwargs are refused unless empty."""
        refuse_unsupported(lora_request=lora_request, tokenization_kwargs=tokenization_kwargs,
                           mm_processor_kwargs=mm_processor_kwargs)
        check_content_format(chat_template_content_format)
        from saguaro_dist.serve.prompts import load_chat_template
        from saguaro_dist.serve.prompts import encode_chat  # the HTTP layer's message model: one rendering
        from saguaro_dist.serve.protocol import ChatMessage, ChatPromptFields, Tool
        end = ChatPromptFields(add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message).prompt_end()
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: chat needs one to render messages")
        conversations = _conversations(messages)
        tools = [Tool(**t) for t in tools or []]
        template = load_chat_template(chat_template) if chat_template else None
        ids = [encode_chat(self.tokenizer, [ChatMessage(**m) for m in conv], tools, chat_template_kwargs, template,
                           end=end) for conv in conversations]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, priority=priority, use_tqdm=use_tqdm)

    async def stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                     prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                     output_kind: OutputKind | str = OutputKind.DELTA, stream_interval_s: float = 0.0,
                     priority: int = 0) -> AsyncIterator[StreamDelta | RequestOutput]:
        """Deltas of one request as rounds finish; closing the iterator early aborts the request (every sample).

        stream_interval_s: once some text went out, rounds closer than this share one delta (as vLLM's
        stream_interval; the engine then decodes and hands off less often). output_kind FINAL_ONLY: one
        delta, when the request finishes, with every token and the whole text, as generate() gets it.
        request_id: names the deltas (and abort()'s target); one open stream at a time may hold it, and it is
        free again once its stream is closed.
        n > 1 (SamplingParams.n, the samples generate() makes: sample i seeded seed + i): RequestOutput items,
        vLLM's AsyncLLM shape. DELTA: one a sample's update, whose single CompletionOutput's index names the
        sample (text, token_ids, logprobs: the new ones; cumulative_logprob: so far); `finished` once every
        sample has, `metrics` the sample's on its last update (None before). FINAL_ONLY: one RequestOutput
        when every sample finished, as generate() returns it."""
        kind = OutputKind(output_kind)  # a ValueError names a wrong kind before any work
        if isinstance(stream_interval_s, bool) or not (isinstance(stream_interval_s, (int, float))
                                                       and 0 <= stream_interval_s < float("inf")):
            raise ValueError(f"stream_interval_s must be a finite number >= 0, got {stream_interval_s!r}")
        request = self._requests(None if prompt is None else [prompt],
                                 None if prompt_token_ids is None else [prompt_token_ids], sampling_params, [priority])[0]
        for seq in request.samples:
            seq.output_kind, seq.stream_interval_s = kind, float(stream_interval_s)
        request_id = self._open_stream(request, request_id)
        shape = stream_shape(request, kind)
        queue: asyncio.Queue = asyncio.Queue()
        submitted = asyncio.ensure_future(self._submit_samples(request.samples, queue, asyncio.get_running_loop()))
        running = {i: seq.request_id for i, seq in enumerate(request.samples)}  # the samples the engine still holds
        try:
            await asyncio.shield(submitted)  # a cancel here leaves the submit running: the abort must follow it
            while running:
                index, item = await queue.get()
                if isinstance(item, BaseException) or item.finished:
                    running.pop(index)  # the engine holds it no more
                if isinstance(item, BaseException):
                    raise item
                out = shape(index, item, not running)
                if out is not None:
                    yield out
        finally:
            self._open.pop(request_id, None)  # the caller's id is free now, whenever the engine takes the abort
            if running:
                self._abort_once_submitted(submitted, list(running.values()))

    async def _submit_samples(self, samples: list[Sequence], queue: asyncio.Queue, loop) -> None:
        """Each sample to the engine in index order, its updates onto `queue` as (index, update); a failed submit
        aborts the samples submitted before it (nobody would read them)."""
        submitted: list[str] = []
        try:
            for index, seq in enumerate(samples):
                await self._thread.submit_async(seq, enqueuer(loop, queue, index))
                submitted.append(seq.request_id)
        except BaseException:
            if submitted:
                self._thread.abort_many(submitted)
            raise

    def _open_stream(self, request: PromptRequest, request_id: str | None) -> str:
        """Claim the caller's request id (the request's fresh one if none) for this stream, or raise ValueError
        while another open stream holds it (vLLM's "already running"). The engine knows each sample by an id of
        its own, "<request id>#<seq id>" ("<i>_<request id>#<seq id>" with n > 1): a closed stream's abort may
        reach the engine after a new stream of the same id was submitted, and must neither refuse that one nor
        abort it."""
        if request_id:
            request.request_id = request_id
            for seq, sample_id in zip(request.samples, sample_ids(request_id, len(request.samples))):
                seq.request_id = f"{sample_id}#{seq.seq_id}"
        engine_ids = tuple(seq.request_id for seq in request.samples)
        if self._open.setdefault(request.request_id, engine_ids) != engine_ids:  # (atomic: streams on any thread)
            raise ValueError(f"request id {request.request_id!r} is already running")
        return request.request_id

    def _abort_once_submitted(self, submitted: asyncio.Future, engine_ids: list[str]) -> None:
        """Abort now, or once the submit call returns: an abort sent before it could overtake it and find nothing."""
        if not submitted.done():
            submitted.add_done_callback(lambda _: self._abort_once_submitted(submitted, engine_ids))
        elif submitted.cancelled() or submitted.exception() is None:  # (a failed submit aborted what it submitted)
            self._thread.abort_many(engine_ids)

    def abort(self, request_id: str) -> None:
        """End the open stream of this request id, every sample of it (its caller gets a last delta, finish_reason
        "abort")."""
        self._thread.abort_many(list(self._open.get(request_id, (request_id,))))

    def _abort_unfinished(self, seqs: list[Sequence]) -> None:
        self._thread.abort_many([seq.request_id for seq in seqs])  # on Ray: one actor call, not one a request

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every kept prefix, target and draft, so later prompts compute theirs afresh (a cold
        start for benchmarks, or after changing what prompts share). Running requests are untouched."""
        self._thread.reset_prefix_cache()
        return True

    def check_health(self) -> None:
        """Raise EngineError (retriable) when the engine cannot serve: shut down, or on Ray its target actors
        died (LLM.rebuild() makes a fresh one). Serving replicas report it to Ray Serve and on /health."""
        self._thread.check_health()

    def shutdown(self) -> None:
        """Stop the engine and free everything it holds (threads; on Ray: actors, servers, ports)."""
        self._thread.stop()

    def rebuild(self) -> None:
        """After a fatal engine error (e.g. a target actor died): a fresh engine with the same Config."""
        try:
            self.shutdown()
        finally:
            self._setup(self.config)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ---- edges ------------------------------------------------------------------------------
    def _requests(self, prompts, prompt_token_ids, sampling_params, priority=None) -> list[PromptRequest]:
        """Validate everything before any work; one PromptRequest (n Sequences) per prompt."""
        texts, ids = self._prompt_ids(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(ids))
        priorities = self._priorities(priority, len(ids))
        out = []
        for text, tokens, p, rank in zip(texts, ids, params, priorities):
            tokens = truncate_prompt(tokens, p.truncate_prompt_tokens, self.max_model_len)
            p = until_context_end(p, len(tokens), self.max_model_len)
            p = with_bad_word_ids(p, self._encode_bad_word if self.tokenizer is not None else None)
            self._check_prompt(tokens, p)
            out.append(self._prompt_request(text, tokens, p, rank))
        return out

    def _prompt_request(self, text: str | None, tokens: list[int], params: SamplingParams, rank: int) -> PromptRequest:
        """params.n Sequences of the prompt; with n > 1, sample i's engine id is "<i>_<request id>" (vLLM's)."""
        request_id = uuid.uuid4().hex
        samples = [self._sample(seq_id, tokens, p, rank)
                   for seq_id, p in zip(sample_ids(request_id, params.n), sample_params(params))]
        return PromptRequest(request_id, text, samples)

    def _sample(self, seq_id: str, tokens: list[int], params: SamplingParams, rank: int) -> Sequence:
        """One sample's Sequence. Under Config.seed an unseeded sample is seeded from it and its engine id (its
        order of arrival), as vLLM's seeded global RNG: the seed travels with it to every worker."""
        sid = next(self._ids)
        if self.config.seed is not None and params.seed is None:
            params = replace(params, seed=engine_request_seed(self.config.seed, sid))
        return Sequence(sid, seq_id, list(tokens), params, priority=rank)

    def _prompt_ids(self, prompts, prompt_token_ids) -> tuple[list, list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            what = "a list of prompts, each a list of token ids"
            ids = [as_token_ids(p) for p in as_tuple(prompt_token_ids, "prompt_token_ids", what)]
            return [None] * len(ids), ids
        what = "a string or a list of strings (or of vLLM's {'prompt': ...} / {'prompt_token_ids': [...]} dicts)"
        prompts = [prompts] if isinstance(prompts, (str, Mapping)) else list(as_tuple(prompts, "prompts", what))
        pairs = [self._prompt(p, i) for i, p in enumerate(prompts)]
        return [text for text, _ in pairs], [ids for _, ids in pairs]

    def _prompt(self, prompt, i: int) -> tuple[str | None, list[int]]:
        """One prompt's (text, token ids): a string or vLLM's TextPrompt / TokensPrompt dict (a dict failed
        as "every prompt must be a non-empty string")."""
        if isinstance(prompt, Mapping):
            return self._dict_prompt(prompt, i)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"every prompt must be a non-empty string or a prompt dict; prompt {i} is {prompt!r}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
        return prompt, encode_text(self.tokenizer, prompt, param=f"prompt {i}")

    def _dict_prompt(self, prompt: Mapping, i: int) -> tuple[str | None, list[int]]:
        """{"prompt": text} or {"prompt_token_ids": ids}; keys we cannot honour (multi_modal_data, ...) are refused."""
        if not prompt or set(prompt) - {"prompt", "prompt_token_ids"}:
            raise ValueError(f"prompt {i} must be {{'prompt': text}} or {{'prompt_token_ids': [...]}}, "
                             f"got keys {sorted(map(str, prompt))}")
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:  # (its text, if given, names it in the output, as vLLM's)
            return text if isinstance(text, str) else None, as_token_ids(prompt["prompt_token_ids"])
        if not isinstance(text, str):
            raise ValueError(f"prompt {i}'s 'prompt' must be a non-empty string, got {text!r}")
        return self._prompt(text, i)

    def _params(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(as_tuple(sampling_params, "sampling_params", "a SamplingParams or a list of them"))
        if not all(isinstance(p, SamplingParams) for p in params):  # a dict failed deep inside with an AttributeError
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {sampling_params!r}")
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        return params

    def _priorities(self, priority, n: int) -> list[int]:
        if priority is None:
            return [0] * n
        if len(priority) != n or any(type(p) is not int for p in priority):
            raise ValueError(f"priority must be one int per prompt ({n}), got {priority!r}")
        if any(priority) and self.config.scheduling_policy is not SchedulingPolicy.PRIORITY:
            raise ValueError("priority needs scheduling_policy='priority' (this engine serves first come, first served)")
        return list(priority)

    def _encode_bad_word(self, word: str) -> list[int]:
        return encode_text(self.tokenizer, word, add_special_tokens=False, param="bad_words")

    def _check_prompt(self, tokens: list[int], params: SamplingParams) -> None:
        check_prompt_ids(tokens, self.vocab_size)
        check_against_model(params, self.vocab_size, self.eos_token_ids)
        self._grammars.check(params)
        # vLLM's offline LLM: a max_tokens past the context's end is capped there (finish "length", the engine's
        # check), only a prompt with no room (or none for its min_tokens) is refused
        room, need = self.max_model_len - len(tokens), max(1, params.min_tokens)
        if room < need:
            raise ValueError(f"prompt ({len(tokens)} tokens) leaves {max(room, 0)} of the model's max length "
                             f"{self.max_model_len} to generate; it needs {need} (min_tokens {params.min_tokens})")

    @staticmethod
    def _collector(i: int, results: list, finished: queue.Queue):
        def listener(item):
            if isinstance(item, BaseException) or item.finished:
                results[i] = item if isinstance(item, BaseException) else item.seq
                finished.put(i)
        return listener

    @staticmethod
    def _wait(results: list, finished: queue.Queue, use_tqdm: bool | Callable) -> None:
        """Until every request finished; the bar counts them (disable=None: only on a terminal)."""
        start, tokens = time.perf_counter(), 0
        with progress_bar(use_tqdm, len(results)) as bar:
            for _ in results:
                seq = results[finished.get()]
                tokens += 0 if isinstance(seq, BaseException) else len(seq.output_token_ids)
                bar.set_postfix_str(f"output: {tokens / max(time.perf_counter() - start, 1e-9):.0f} toks/s", refresh=False)
                bar.update(1)

    @staticmethod
    def _output(request: PromptRequest, samples: list[Sequence]) -> RequestOutput:
        """The finished samples of one prompt; the prompt's fields and the metrics are sample 0's."""
        first = samples[0]
        return RequestOutput.of_samples(request.request_id, request.text, first.prompt_token_ids, first.prompt_logprobs,
                                        [completion(i, seq) for i, seq in enumerate(samples)], first.metrics)

    @staticmethod
    def _delta(u: Update, request_id: str) -> StreamDelta:
        reason, stop_reason = finish_fields(u)
        return StreamDelta(request_id, output_text(u.seq.params, u.text_delta), u.token_delta, u.finished, reason,
                           u.seq.metrics if u.finished else None, u.logprobs_delta, u.prompt_logprobs, stop_reason)


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine ids of a request's n samples: the request's own for one, else "<i>_<request id>" (vLLM's)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The n = 1 settings of each of params.n samples: sample i draws from seed + i (the HTTP server's rule:
    the samples differ, each seeded as a request of its own); only sample 0 scores the prompt (prompt_logprobs
    cost a [P, V] LM head, the same for every sample). n = 1 here: nothing downstream expands them again."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None) for i in range(params.n)]


def enqueuer(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
    """A sample's engine listener: its updates onto the stream's queue, from the engine's thread, as (index, item)."""
    return lambda item: loop.call_soon_threadsafe(queue.put_nowait, (index, item))


def stream_shape(request: PromptRequest, kind: OutputKind):
    """What stream() yields for (sample index, update, every sample finished): n = 1 its StreamDelta (the
    stream's shape before n), n > 1 vLLM's RequestOutput (SampleDeltas, or SamplesAtEnd for FINAL_ONLY)."""
    if len(request.samples) == 1:
        return lambda _, update, __: LLM._delta(update, request.request_id)
    return SampleDeltas(request) if kind is OutputKind.DELTA else SamplesAtEnd(request)


def finish_fields(u: Update) -> tuple[str | None, int | str | None]:
    """(finish_reason, stop_reason) of an update: set on a sample's last one only."""
    if not u.finished:
        return None, None
    return (u.seq.finish_reason.value if u.seq.finish_reason else None), u.seq.stop_reason


@dataclass
class SampleDeltas:
    """stream() with n > 1, DELTA: each update as a RequestOutput of its one sample (vLLM's AsyncLLM)."""
    request: PromptRequest
    prompt_token_ids: list[int] = field(init=False)
    sums: dict[int, float] = field(default_factory=dict)  # each sample's cumulative log p so far

    def __post_init__(self):
        self.prompt_token_ids = list(self.request.samples[0].prompt_token_ids)  # read before the engine has them

    def __call__(self, index: int, u: Update, all_finished: bool) -> RequestOutput:
        reason, stop_reason = finish_fields(u)
        sample = CompletionOutput(index, output_text(u.seq.params, u.text_delta), u.token_delta, self._cumulative(index, u),
                                  u.logprobs_delta, reason, stop_reason)
        return RequestOutput.of_samples(self.request.request_id, self.request.text, self.prompt_token_ids,
                                        u.prompt_logprobs, [sample], u.seq.metrics if u.finished else None,
                                        all_finished)

    def _cumulative(self, index: int, u: Update) -> float | None:
        if u.logprobs_delta is None:
            return None
        self.sums[index] = self.sums.get(index, 0.0) + cumulative_logprob(u.token_delta, u.logprobs_delta)
        return self.sums[index]


@dataclass
class SamplesAtEnd:
    """stream() with n > 1, FINAL_ONLY: one RequestOutput once every sample finished, as generate() builds it."""
    request: PromptRequest
    finished: dict[int, Sequence] = field(default_factory=dict)

    def __call__(self, index: int, u: Update, all_finished: bool) -> RequestOutput | None:
        self.finished[index] = u.seq
        if not all_finished:
            return None
        return LLM._output(self.request, [self.finished[i] for i in range(len(self.request.samples))])


def completion(index: int, seq: Sequence) -> CompletionOutput:
    token_ids = list(seq.output_token_ids)
    logprobs = list(seq.output_logprobs) if seq.params.logprobs is not None else None
    return CompletionOutput(index, output_text(seq.params, seq.text), token_ids, cumulative_logprob(token_ids, logprobs), logprobs,
                            seq.finish_reason.value if seq.finish_reason else None, seq.stop_reason)


def output_text(params: SamplingParams, text: str) -> str:
    """The text an output shows: none with detokenize=False (vLLM's: token ids only)."""
    return text if params.detokenize else ""


def progress_bar(use_tqdm: bool | Callable, total: int):
    """generate's bar: tqdm's (shown only on a terminal), none, or the one vLLM's callable use_tqdm makes."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts", unit="prompt")
    return tqdm(total=total, desc="Processed prompts", unit="prompt", disable=None if use_tqdm else True)


UNSUPPORTED = {"lora_request": "LoRA adapters are not supported",
               "tokenization_kwargs": "prompts are encoded as the model's tokenizer does by default, without overrides",
               "mm_processor_kwargs": "multimodal inputs are not supported"}


def refuse_unsupported(**arguments) -> None:
    """vLLM's arguments this engine cannot honour: refused by name unless empty (None, {} or []), not dropped."""
    for name, value in arguments.items():
        if value is not None and value != {} and value != []:
            raise ValueError(f"{name}: {UNSUPPORTED[name]}; leave it unset (got {value!r})")


CONTENT_FORMATS = ("auto", "string")  # the chat renderer hands templates each message's content as one string


def check_content_format(content_format: str) -> None:
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format {content_format!r} is not supported: message content "
                         f"reaches the chat template as a string ({' or '.join(map(repr, CONTENT_FORMATS))})")


def _conversations(messages) -> list:
    """chat's messages as a list of conversations, each a non-empty list of message dicts: an empty one in a
    list rendered a prompt of no messages (the server refuses one, as `messages: []` is refused here)."""
    if not messages:
        raise ValueError("messages must not be empty")
    conversations = [messages] if isinstance(messages, (list, tuple)) and isinstance(messages[0], dict) else messages
    if not isinstance(conversations, (list, tuple)) or not all(  # a str failed as ChatMessage(**"hi"): a TypeError
            isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) for m in c) for c in conversations):
        raise ValueError("messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} dicts) "
                         "or a list of conversations")
    return conversations


def generation_defaults(config: Config) -> dict:
    """What the model's generation config makes requests' sampling defaults (vLLM's): checked once, here."""
    defaults = load_generation_defaults(config.model, config.generation_config, config.revision)
    try:
        SamplingParams(**defaults)
    except ValueError as err:
        raise ValueError(f"the generation config of {config.model!r} ({config.generation_config}): {err}") from None
    if defaults:
        log.info("requests' sampling defaults come from the model's generation config: %s "
                 "(generation_config='vllm' to ignore it)", defaults)
    return defaults
