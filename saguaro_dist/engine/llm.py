"""The public entry point: `LLM(...).generate(...)`, `LLM.stream(...)` for serving."""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import AsyncIterator

from tqdm import tqdm

from saguaro_dist.config import Config, Mode
from saguaro_dist.engine.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from saguaro_dist.engine.llm_inputs import (PromptRequest, RequestInputs, check_content_format, conversations,
                                            refuse_unsupported, sample_ids)
from saguaro_dist.engine.llm_outputs import request_output, stream_shape
from saguaro_dist.engine.logprob_objects import Logprob, TokenTexts
from saguaro_dist.engine.loop_thread import EngineThread
from saguaro_dist.engine.metrics import EngineLoad
from saguaro_dist.engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from saguaro_dist.engine.sequence import OutputKind, Sequence
from saguaro_dist.engine.structured import GrammarCompiler
from saguaro_dist.lora_request import AdapterIds, LoRARequest
from saguaro_dist.model.loader import load_generation_defaults
from saguaro_dist.sampling_params import SamplingParams
from saguaro_dist.speculative_config import config_fields, with_config_names

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "StreamDelta"]
log = logging.getLogger(__name__)


class LLM(RequestInputs):
    """An SSD / SD / AR engine over a target (and draft) checkpoint.

    >>> llm = LLM(model=TARGET, draft=DRAFT, mode="ssd", k=4, fan_out=12)
    >>> llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=32))[0].text
    """

    def __init__(self, model: str, draft: str | None = None, *, speculative_config: dict | None = None, **kwargs):
        """kwargs: Config's fields (vLLM's max_num_seqs for max_batch_size). speculative_config: vLLM's dict (model,
        method 'draft_model' / 'ngram', num_speculative_tokens, ...), mapped onto those fields (saguaro_dist/speculative_config.py)."""
        given = {"draft": draft, **with_config_names(kwargs)}  # vLLM's max_num_seqs too
        fields = {**given, **config_fields(speculative_config, given)}
        if fields["draft"] is None and "mode" not in fields:
            fields["mode"] = Mode.AR  # a lone target decodes autoregressively (vLLM's LLM(model), `saguaro serve MODEL`)
        self._setup(Config(model=model, **fields))

    @classmethod
    def from_config(cls, config: Config) -> "LLM":
        llm = cls.__new__(cls)
        llm._setup(config)
        return llm

    def _setup(self, config: Config) -> None:
        self.config = config
        self.generation_defaults = generation_defaults(config)  # before any engine starts: a bad file leaks nothing
        self._ids = itertools.count()
        self._lora_ids, self._target_config = AdapterIds(), None  # lora_int_id -> its path; read for adapters' checks
        self._open: dict[str, tuple[str, ...]] = {}  # request id of each open stream -> its samples' engine ids
        if config.cluster is None:
            from saguaro_dist.engine.build import build_local_engine
            engine, self.tokenizer = build_local_engine(config)
            self._thread = EngineThread(engine)
        else:
            from saguaro_dist.distributed.cluster import build_cluster_engine
            self._thread, self.tokenizer = build_cluster_engine(config)
        # shutdown(), or else the LLM's collection or the interpreter's exit, stops the engine once. Dropped unstopped,
        # an engine served nobody for as long as the process lived, holding its threads, draft process, memory and
        # (on Ray) its actors' resources. Left running at exit, its threads ran torch while the interpreter finalized,
        # which aborted the process (SIGABRT). (`llm = LLM(...)` run again builds the new engine before the old one is
        # dropped: shutdown() or `del llm` first, where the two do not fit side by side.)
        self._stop_engine = weakref.finalize(self, stop_unless_forked, self._thread, os.getpid())
        self._stopping = threading.RLock()  # a second shutdown() waits for the first's stop (the finalizer runs once); re-entrant:
        # a shutdown() reached again on the same thread (a serve app's __del__ collected mid-shutdown) returns
        # Every mode fills the whole context, as AR: a speculative round's positions past it run in the target's
        # position slack (engine/build.py position_slack), and their tokens are cut.
        self.max_model_len = self._thread.max_model_len
        self.vocab_size, self.eos_token_ids = self._thread.vocab_size, self._thread.eos_token_ids
        self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._token_texts = TokenTexts(self.tokenizer)  # Logprob.decoded_token, one decode per token id

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
        """What the engine holds now: requests running and waiting, the share of the KV budget they use, and
        their LoRA adapters (vLLM's lora_requests_info: running_lora_adapters, waiting_lora_adapters, max_lora)
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
        samples not yet finished before it propagates. lora_request: vLLM's LoRARequest (needs enable_lora),
        one for every prompt or a list of one per prompt (None: the base model). tokenization_kwargs: vLLM's,
        refused unless empty (prompts are encoded as the model's tokenizer does by default)."""
        refuse_unsupported(tokenization_kwargs=tokenization_kwargs)
        requests = self._requests(prompts, prompt_token_ids, sampling_params, priority, lora_request=lora_request)
        seqs = [seq for request in requests for seq in request.samples]
        finished: queue.Queue[int] = queue.Queue()
        results: list = [None] * len(seqs)
        for seq in seqs:
            seq.output_kind = OutputKind.FINAL_ONLY
        try:
            self._thread.submit_many([(seq, self._adapter_failures(seq, self._collector(i, results, finished)))
                                      for i, seq in enumerate(seqs)])
            self._wait(results, finished, use_tqdm)
        except BaseException:  # Ctrl-C (a notebook's interrupt): the batch must not run on ahead of the next call
            self._abort_unfinished([seq for seq, result in zip(seqs, results) if result is None])
            raise
        for r in results:
            if isinstance(r, BaseException):
                raise r
        done = iter(results)
        return [request_output(request, [next(done) for _ in request.samples], self._token_texts)
                for request in requests]

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search, over generate as vLLM's: prompts (strings or vLLM's {'prompt': ...} /
        {'prompt_token_ids': [...]} dicts), one BeamSearchOutput each, its best beams first (engine/beam_search.py).
        lora_request: one for every prompt or a list of one per prompt, as generate's. use_tqdm: a bar of the
        search's token steps; concurrency_limit: at most that many prompts searched at once (None: all), as vLLM's."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        _, ids, salts = self._prompt_ids(prompts, None)
        return run_beam_search(self, ids, params, salts, self._lora_requests(lora_request, len(ids)), use_tqdm,
                               concurrency_limit)

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
        then generated; outputs in conversation order. Message content reaches the template as a string, or
        as text parts where it loops over them (chat_template_content_format "auto"; "string" or "openai"
        force one, as vLLM's); lora_request as generate's (one, or one per
        conversation); tokenization_kwargs and mm_processor_kwargs are refused unless empty."""
        refuse_unsupported(tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs)
        check_content_format(chat_template_content_format)
        from saguaro_dist.serve.prompts import load_chat_template
        from saguaro_dist.serve.prompts import encode_chat  # the HTTP layer's message model: one rendering
        from saguaro_dist.serve.protocol import ChatMessage, ChatPromptFields, Tool
        end = ChatPromptFields(add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message).prompt_end()
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: chat needs one to render messages")
        chats = conversations(messages)
        tools = [Tool(**t) for t in tools or []]
        template = load_chat_template(chat_template) if chat_template else None
        ids = [encode_chat(self.tokenizer, [ChatMessage(**m) for m in conv], tools, chat_template_kwargs, template,
                           end=end, content_format=chat_template_content_format) for conv in chats]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, priority=priority, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    async def stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                     prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                     output_kind: OutputKind | str = OutputKind.DELTA, stream_interval_s: float = 0.0,
                     priority: int = 0, cache_salt: str | None = None,
                     lora_request: LoRARequest | None = None) -> AsyncIterator[StreamDelta | RequestOutput]:
        """Deltas of one request as rounds finish; closing the iterator early aborts the request (every sample).
        stream_interval_s: once text went out, rounds closer than this share one delta (vLLM's stream_interval).
        output_kind FINAL_ONLY: one item when the request finishes, with everything, as generate() returns it.
        request_id: names the deltas (and abort()'s target); one open stream at a time may hold it.
        cache_salt: vLLM's; the request reuses prefix-cache KV only of requests with the same salt.
        lora_request: vLLM's LoRARequest the target runs the request through (needs enable_lora; None: the base).
        n = 1: StreamDelta items (logprobs the engine's plain {token id: log p}, the server's input). n > 1 (sample
        i seeded seed + i): vLLM's AsyncLLM RequestOutput items; DELTA: one a sample update, its one CompletionOutput's
        index naming the sample (text, token_ids, Logprob objects: the new ones; cumulative_logprob: so far),
        `finished` once every sample has, `metrics` the sample's on its last; FINAL_ONLY: generate()'s, at the end."""
        make = functools.partial(self._stream_request, prompt, prompt_token_ids, sampling_params, output_kind,
                                 stream_interval_s, priority, cache_salt, lora_request)
        claim = await self._claim_adapter(lora_request)
        try:
            request = make()
            request_id = self._open_stream(request, request_id)
            shape = stream_shape(request, request.samples[0].output_kind, self._token_texts)
            queue, submitted, running = self._start_samples(request.samples)
        except BaseException:
            self._settle_when_submitted(claim, None)
            raise
        self._settle_when_submitted(claim, submitted)
        try:
            await asyncio.shield(submitted)  # a cancel here leaves the submit running: the abort must follow it
            while running:
                if (out := await self._next_item(queue, running, shape)) is not None:
                    yield out
        finally:
            self._open.pop(request_id, None)  # the caller's id is free now, whenever the engine takes the abort
            if running:
                self._abort_once_submitted(submitted, list(running.values()))

    def _adapter_failures(self, seq: Sequence, listener):
        """seq's engine listener, which first forgets its lora_int_id here when the engine reports that its adapter
        never loaded (the engine forgot it too): else the id stayed bound to the failed path, and a request naming
        it with a corrected one was refused for good. Before the caller hears of it: a retry finds the id free."""
        if seq.lora_request is None:
            return listener

        def on_update(item):
            if isinstance(item, BaseException):
                self._lora_ids.release_if_not_loaded(seq.lora_request, item)
            listener(item)
        return on_update

    def _stream_request(self, prompt, prompt_token_ids, sampling_params, output_kind, stream_interval_s,
                        priority: int, cache_salt: str | None = None, lora_request=None) -> PromptRequest:
        """stream()'s one request, checked before any work, its samples set to report as asked."""
        kind = OutputKind(output_kind)  # a ValueError names a wrong kind before any work
        if isinstance(stream_interval_s, bool) or not (isinstance(stream_interval_s, (int, float))
                                                       and 0 <= stream_interval_s < float("inf")):
            raise ValueError(f"stream_interval_s must be a finite number >= 0, got {stream_interval_s!r}")
        request = self._requests(None if prompt is None else [prompt],
                                 None if prompt_token_ids is None else [prompt_token_ids], sampling_params, [priority],
                                 cache_salt, lora_request)[0]
        for seq in request.samples:
            seq.output_kind, seq.stream_interval_s = kind, float(stream_interval_s)
        return request

    def _start_samples(self, samples: list[Sequence]) -> tuple[asyncio.Queue, asyncio.Future, dict[int, str]]:
        """Submit the samples (a task); their updates arrive on the queue as (index, item). running: index -> engine
        id of each sample the engine still holds."""
        queue: asyncio.Queue = asyncio.Queue()
        submitted = asyncio.ensure_future(self._submit_samples(samples, queue, asyncio.get_running_loop()))
        return queue, submitted, {i: seq.request_id for i, seq in enumerate(samples)}

    @staticmethod
    async def _next_item(queue: asyncio.Queue, running: dict[int, str], shape):
        """The next update of any sample as the stream's item (None: none to yield for it). A finished or failed
        sample leaves `running` (the engine holds it no more); a failure is raised."""
        index, item = await queue.get()
        if isinstance(item, BaseException) or item.finished:
            running.pop(index)
        if isinstance(item, BaseException):
            raise item
        return shape(index, item, not running)

    async def _submit_samples(self, samples: list[Sequence], queue: asyncio.Queue, loop) -> None:
        """Each sample to the engine in index order, its updates onto `queue` as (index, update); a failed submit
        aborts the samples submitted before it (nobody would read them)."""
        submitted: list[str] = []
        try:
            for index, seq in enumerate(samples):
                await self._thread.submit_async(seq, self._adapter_failures(seq, enqueuer(loop, queue, index)))
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

    def remove_lora(self, lora_int_id: int) -> bool:
        """vLLM's remove_lora: the adapter's slot serves others once its running and queued requests finished (on its
        weights), its id may then name another path (add_lora or a request may name one at once: vLLM's); whether
        the engine held it (on Ray: rank 0's, every rank's slot freed)."""
        removed = self._thread.remove_lora(lora_int_id)
        if (bound := self._lora_ids.current(lora_int_id)) is not None:
            self._lora_ids.release(bound)
        return removed

    def check_lora_adapter(self, lora_path: str) -> None:
        """Read a LoRA adapter where the engine's target loads it at its first request (lazily): a ValueError with
        why it cannot run there. On Ray that is rank 0's node, whose disk may lack a folder this machine holds; on
        one host it is this process, whose reads are the ones a lora_request's check does here (nothing more to
        read). The server asks for each --lora-modules adapter at start-up, as vLLM's workers load static adapters."""
        if self.config.cluster is not None:
            self._thread.check_lora_adapter(lora_path)

    def check_health(self) -> None:
        """Raise EngineError (retriable) when the engine cannot serve: shut down, or on Ray its target actors
        died (LLM.rebuild() makes a fresh one). Serving replicas report it to Ray Serve and on /health."""
        self._thread.check_health()

    def shutdown(self) -> None:
        """Stop the engine and free everything it holds (threads; on Ray: actors, servers, ports). Every caller returns
        once the engine is stopped: one at the same time as another waits for it."""
        with self._stopping:
            self._stop_engine()

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


def stop_unless_forked(engine, pid: int) -> None:
    """An LLM's stop (its finalizer): engine.stop(), unless this is a child forked since the engine started. The
    engine is the parent's: on Ray the child's stop killed the parent's actors, and over a draft process's pipe it
    told the parent's draft to stop (a forked child's exit, or its GC of the copied LLM, runs the finalizer)."""
    if os.getpid() == pid:
        engine.stop()


def enqueuer(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
    """A sample's engine listener: its updates onto the stream's queue, from the engine's thread, as (index, item)."""
    return lambda item: loop.call_soon_threadsafe(queue.put_nowait, (index, item))


def progress_bar(use_tqdm: bool | Callable, total: int):
    """generate's bar: tqdm's (shown only on a terminal), none, or the one vLLM's callable use_tqdm makes."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts", unit="prompt")
    return tqdm(total=total, desc="Processed prompts", unit="prompt", disable=None if use_tqdm else True)


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
