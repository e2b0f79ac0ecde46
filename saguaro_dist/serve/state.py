"""What every route needs: the engine, its tokenizer, the served name, and generation with metrics."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from saguaro_dist.engine.engine import check_prompt_ids
from saguaro_dist.engine.llm_inputs import sample_seed
from saguaro_dist.engine.sequence import OutputKind
from saguaro_dist.engine.text import encode_text
from saguaro_dist.sampling_params import SamplingParams
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.fan_in import cancelled_by_sibling
from saguaro_dist.serve.lora_models import ServedModels
from saguaro_dist.serve.metrics import ENGINE_REPORTED_FIELDS, ServeMetrics
from saguaro_dist.serve.protocol import MAX_GENERATIONS, SamplingRequest
from saguaro_dist.serve.reasoning import ReasoningParser, ReasoningTokens, prompt_closed_reasoning, reasoning_first
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.serve.tools import ToolPlan


log = logging.getLogger(__name__)
ENGINE_REPORT_S = 1.0  # how often the engine's gauges and round counters are reported
PROMPT_TAIL_TOKENS = 64  # where a chat template closes or opens the reply's reasoning (reasoning_first)
# A non-streamed generation reads its first delta, which shows that its prefill ran (an abort then counts its
# prompt, as vLLM's), then the rest at its end: deltas after the first text come at most this often.
COLLECT_INTERVAL_S = 24 * 3600.0


@dataclass
class Job:
    """One prompt to generate for (one choice of the response)."""
    prompt_ids: list[int]
    params: SamplingParams
    scores_only: bool = False  # max_tokens 0 with echo: the prompt's figures only (one token runs, unshown)
    priority: int = 0          # with scheduling_policy "priority": lower is admitted first
    reasoned: bool = False     # its constraint lets the model reason first (reasoning.reasoning_first)
    continues: bool = False    # its prompt continues the final message (chat's PromptEnd.CONTINUE): an assistant prefill
    request_id: str = ""       # the engine's id for it: the response's id and the choice index ("" = a fresh one)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: its logprobs name tokens "token_id:<id>"
    cache_salt: str | None = None  # vLLM's: prefix-cache KV is shared only with requests of the same salt
    lora_request: object = None  # the LoRARequest of the adapter the request's model names (None: the base model)
    n: int = 1                   # the request's samples per prompt (traced as gen_ai.request.n)


@dataclass
class Finished:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the generated ids (reasoning_tokens counts in them)
    finish_reason: str | None = None
    metrics: object = None  # the engine's RequestMetrics
    logprobs: list | None = None  # one engine entry per token, when the request asked for them
    prompt_logprobs: list | None = None  # one per prompt token (None first), when the request asked for them
    stop_reason: int | str | None = None  # the stop_token_id or stop string that ended it (vLLM's)


class ServingState:
    def __init__(self, engine, model_name: str, metrics: ServeMetrics, stream_interval_s: float = 0.0,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None, log_requests: bool = False,
                 chat_template: str | None = None, model_aliases: tuple[str, ...] = (),
                 models: ServedModels | None = None, tracer=None):
        self.engine = engine
        self.chat_template = chat_template  # the server's --chat-template (None: the tokenizer's)
        self.log_requests = log_requests  # an INFO line as each generation starts and ends (vLLM's --enable-log-requests)
        self.tool_call_parser = ToolCallParser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser = ReasoningParser(reasoning_parser) if reasoning_parser else None
        self.reasoning_tokens = ReasoningTokens.of(engine.tokenizer) if reasoning_parser else None
        self.stream_interval_s = stream_interval_s  # streamed deltas closer than this share one SSE write
        self.tokenizer = engine.tokenizer
        self.model_name = model_name  # what replies name; requests may give an alias too
        self.model_names = (model_name, *model_aliases)
        self.models = models or ServedModels(self.model_names, engine.config)  # the names and the LoRA adapters
        self.max_model_len = int(engine.max_model_len)
        self.defaults = dict(getattr(engine, "generation_defaults", {}))  # the model's generation config (vLLM's)
        self.metrics = metrics
        self._engine_reporter: asyncio.Task | None = None
        self.running = 0   # generations in flight on this replica (the engine's own split: engine.load)
        self.cancelled = 0  # generations whose client went away before the end (their engine slot is freed)
        self.tracer = tracer  # serve/tracing.py's RequestTracer (--otlp-traces-endpoint); None: no spans

    @property
    def harmony(self) -> bool:
        """A gpt-oss server (either harmony parser): every chat reply keeps special tokens and is read as
        harmony, whatever the request's tools (vLLM's HarmonyParser)."""
        return (self.reasoning_parser is not None and self.reasoning_parser.harmony) or \
            self.tool_call_parser is ToolCallParser.OPENAI

    def tool_plan_for(self, request) -> ToolPlan:
        """The chat request's tool plan, read by this server's tool-call parser."""
        return replace(request.tool_plan(), parser=self.tool_call_parser, harmony=self.harmony)

    def reasoning_parser_for(self, job: Job) -> ReasoningParser | None:
        """The server's reasoning parser, unless the job's whole reply is constrained or its prompt closed the
        think block (Qwen3's enable_thinking=False; vLLM's prompt_is_reasoning_end): no reasoning in it. Harmony's
        always: its replies say where their reasoning is, constrained or not. A reply constrained after its
        reasoning is split where its grammar ends the reasoning (as_grammar_reads)."""
        if self.reasoning_parser is None or self.reasoning_parser.harmony:
            return self.reasoning_parser
        if job.params.structured_outputs is not None and not job.reasoned:
            return None
        if self._prompt_closed(job):
            return None
        return self.reasoning_parser.as_grammar_reads() if job.reasoned else self.reasoning_parser

    def reasoning_count(self, job: Job, token_ids: list[int]) -> int | None:
        """How many of the job's generated tokens are reasoning (usage's reasoning_tokens); None on a server
        without a reasoning parser, whose usage leaves the figure out."""
        if self.reasoning_tokens is None:
            return None
        return self.reasoning_tokens.count(self.reasoning_parser_for(job), token_ids)

    def reason_first(self, job: Job) -> Job:
        """With a reasoning parser, a constrained chat reply may reason before what it is held to."""
        spec = job.params.structured_outputs
        if self.reasoning_parser is None or spec is None:  # (harmony: an analysis message, then the final channel)
            return job
        closed = None if self.reasoning_parser.harmony else self._prompt_closed(job)
        wrapped = reasoning_first(spec, self._prompt_tail(job), self.reasoning_parser, self.reasoning_tokens, closed)
        if wrapped is None:
            return job
        return replace(job, params=replace(job.params, structured_outputs=wrapped), reasoned=True)

    def _prompt_closed(self, job: Job) -> bool:
        """Whether the job's prompt closed the think block: a new turn's by how the prompt ends; a continued
        message's by its last think tag (by id where a tag is one token: text in a message may spell one)."""
        if job.continues and self.reasoning_tokens is not None:
            by_ids = self.reasoning_tokens.prompt_closed(job.prompt_ids)
            if by_ids is not None:
                return by_ids
        return prompt_closed_reasoning(self._prompt_tail(job), job.continues)

    def _prompt_tail(self, job: Job) -> str:
        return self.tokenizer.decode(job.prompt_ids[-PROMPT_TAIL_TOKENS:])

    def check_model(self, requested: str | None) -> str:
        """The name replies give (an adapter's, else the first base name); an unknown model is vLLM's 404."""
        return self.models.resolve(requested)[0]

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids (with the tokenizer's BOS etc. unless add_special_tokens is false); ids as given."""
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    @staticmethod
    def named(jobs: list[Job], request_id: str) -> list[Job]:
        """The jobs of one response, named after it for the logs: "<request id>-<choice index>-<random>" (the
        random part keeps two requests sent with one X-Request-Id apart: LLM.stream lets one open stream at a
        time hold an id)."""
        return [replace(job, request_id=f"{request_id}-{i}-{uuid.uuid4().hex[:8]}") for i, job in enumerate(jobs)]

    def jobs(self, prompts: list[list[int]], request: SamplingRequest, param: str) -> list[Job]:
        """request.n jobs per prompt, prompt-major (OpenAI's choice order). Sample i of a seeded request
        draws from seed + i (wrapped into int64: llm_inputs.sample_seed): the n samples differ and the response
        is reproducible."""
        if len(prompts) * request.n > MAX_GENERATIONS:
            raise APIError(400, f"{len(prompts)} prompts x n = {request.n} asks for more than {MAX_GENERATIONS} "
                                f"generations in one request", param="n")
        jobs = []
        for prompt_ids in prompts:
            job = self.job(prompt_ids, request, param)
            seeds = [sample_seed(job.params.seed, i) for i in range(request.n)]
            jobs += [replace(job, n=request.n, params=replace(job.params, seed=seed)) for seed in seeds]
        return jobs

    def _check_ids(self, prompt_ids: list[int], param: str) -> None:
        """The engine's own check of a prompt's ids (not empty, inside the vocabulary), made here as a 400."""
        try:
            check_prompt_ids(prompt_ids, self.engine.vocab_size)
        except ValueError as err:
            raise APIError(400, str(err), param=param) from err

    def job(self, prompt_ids: list[int], request: SamplingRequest, param: str) -> Job:
        """Sampling settings for one prompt; max_tokens defaults to the route's (completions 16, chat the rest of
        the context), or the generation config's max_new_tokens if that is less (vLLM)."""
        prompt_ids = request.kept_prompt(prompt_ids, self.max_model_len)  # truncate_prompt_tokens, either side
        self._check_ids(prompt_ids, param)  # here, as every job is built before any starts: no choice runs for a 400
        room = self.max_model_len - len(prompt_ids)
        wanted = request.requested_max_tokens()
        asked = wanted if wanted is not None else request.default_max_tokens()  # (vLLM checks the route's 16 too)
        if room < 1 or (asked is not None and asked > room):
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"you requested {len(prompt_ids) + (asked or 1)} tokens ({len(prompt_ids)} in the "
                                f"{param}, {asked or 1} in the completion). Please reduce the length of the "
                                f"{param} or completion.", param=param, code="context_length_exceeded")
        as_ids = bool(request.return_tokens_as_token_ids)
        lora = self.models.resolve(getattr(request, "model", None))[1]
        if wanted == 0:  # the engine always decides one token; the response leaves it out
            return Job(prompt_ids, request.sampling_params(1, self.defaults), scores_only=True, priority=request.priority,
                       tokens_as_ids=as_ids, cache_salt=request.cache_salt, lora_request=lora)
        default = request.default_max_tokens() or room  # (completions: 16; chat: the rest of the context)
        max_tokens = wanted or min(room, self.defaults.get("max_tokens", room), default)
        return Job(prompt_ids, request.sampling_params(max_tokens, self.defaults), priority=request.priority,
                   tokens_as_ids=as_ids, cache_salt=request.cache_salt, lora_request=lora)

    # ---- generation -------------------------------------------------------------------------
    async def stream(self, job: Job, interval_s: float | None = None) -> AsyncIterator:
        """The engine's deltas for one job (once some text went out, at most one per interval_s: the server's
        stream interval by default), with serving metrics; closing it aborts the generation."""
        start = last = time.monotonic()
        request_id = job.request_id or uuid.uuid4().hex
        self._enter()
        if self.log_requests:
            log.info("request %s: %d prompt tokens, priority %d, %s", request_id, len(job.prompt_ids), job.priority, job.params)
        engine_stream = self.engine.stream(prompt_token_ids=job.prompt_ids, sampling_params=job.params,
                                           request_id=request_id, output_kind=OutputKind.DELTA,
                                           stream_interval_s=self.stream_interval_s if interval_s is None else interval_s,
                                           priority=job.priority, cache_salt=job.cache_salt,
                                           lora_request=job.lora_request)
        finished = aborted = False
        try:
            async with aclosing(engine_stream) as deltas:  # closing the engine's stream aborts the request
                async for delta in deltas:
                    now = time.monotonic()
                    self._record(delta, start, last, now)
                    last, finished = now, delta.finished
                    if finished:
                        self._report_finished(job, request_id, delta, start, now)
                    yield delta
        except (GeneratorExit, asyncio.CancelledError) as err:  # closed early or cancelled: the client went away,
            aborted = not cancelled_by_sibling(err)  # unless another choice failed (the request's answer: that error)
            raise  # (an engine's failure is no abort either: it is answered, and counted, as a 503)
        except Exception as err:  # the engine failed it: an ERROR span
            if self.tracer is not None:
                self.tracer.failed(job, request_id, err, start)
            raise
        finally:
            self._exit(cancelled=aborted and not finished)  # (a refusal or an engine failure is no hang-up)
            if aborted and not finished:
                self._record_abort(job, request_id, time.monotonic() - start, prefilled=last > start)

    async def collect(self, job: Job) -> Finished:
        """The whole result at once: the first delta (the prefill ran), then the rest at the end, no per-round
        deltas to the event loop, whose work would share the replica's GIL with the engine's round loop. (A
        final-only stream shows nothing before its end: an abort could not tell whether its prefill ran.)"""
        out = Finished()
        parts = []
        async with aclosing(self.stream(job, COLLECT_INTERVAL_S)) as deltas:
            async for delta in deltas:
                parts.append(delta.text)
                out.token_ids += delta.token_ids
                if delta.logprobs is not None:
                    out.logprobs = (out.logprobs or []) + delta.logprobs
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = delta.prompt_logprobs
                if delta.finished:
                    out.finish_reason, out.metrics, out.stop_reason = delta.finish_reason, delta.metrics, delta.stop_reason
        out.text = "".join(parts)
        return out

    def _record(self, delta, start: float, last: float, now: float) -> None:
        first = last == start
        if first and delta.finished and delta.metrics is not None and delta.token_ids:  # one delta for the whole request
            self._record_whole(delta)
        elif first and delta.token_ids:
            self.metrics.first_token(now - start)
            self.metrics.tokens(len(delta.token_ids), None)
        else:
            self.metrics.tokens(len(delta.token_ids), now - last)
        if delta.finished:
            self.metrics.finished(delta.metrics, now - start, delta.finish_reason)

    def _report_finished(self, job: Job, request_id: str, delta, start: float, now: float) -> None:  # log, span
        if self.log_requests:
            _log_finished(request_id, delta, now - start)
        if self.tracer is not None:
            self.tracer.finished(job, request_id, delta, start)

    def _record_whole(self, delta) -> None:
        """The engine's own clock for what no reader saw: its first token, and the tokens after it."""
        m = delta.metrics
        self.metrics.first_token(m.time_to_first_token_s)
        self.metrics.tokens(1, None)
        self.metrics.tokens(len(delta.token_ids) - 1, m.total_time_s - m.time_to_first_token_s)

    def _record_abort(self, job: Job, request_id: str, seconds: float, prefilled: bool) -> None:
        """An unfinished generation, counted as vLLM counts an aborted request. Its prompt counts once a delta
        showed that its prefill ran (the first comes with the first token, streamed or collected; a generation
        aborted in the queue, or while its prompt is prefilled, shows none)."""
        self.metrics.aborted(seconds, len(job.prompt_ids) if prefilled else 0)
        if self.tracer is not None:
            self.tracer.aborted(job, request_id, time.monotonic() - seconds)  # (since the stream's start)
        if self.log_requests:
            log.info("request %s: aborted (the client went away) after %.3f s", request_id, seconds)

    def start_reporter(self) -> None:
        """The engine reporter, on the running event loop (the one serving the requests): from the app's start-up
        (its lifespan, which Ray Serve replicas and uvicorn both run), so an idle server exports its gauges too;
        else from the first request (a server that runs no lifespan). Once."""
        if self._engine_reporter is None and self.metrics.enabled:
            self._engine_reporter = asyncio.get_running_loop().create_task(self._report_engine())

    async def stop_reporter(self) -> None:
        """At the app's shutdown: the reporter ends with it (not destroyed, pending, with the server's loop)."""
        reporter, self._engine_reporter = self._engine_reporter, None
        if reporter is not None:
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)

    def _enter(self) -> None:
        self.running += 1
        self.start_reporter()

    def _exit(self, cancelled: bool) -> None:
        self.running -= 1
        self.cancelled += int(cancelled)

    async def _report_engine(self) -> None:
        """Every ENGINE_REPORT_S: the engine's gauges (a snapshot read: it costs the engine nothing) and its
        round counters' growth (on Ray a call to rank 0, made off the event loop). A failed report is logged and
        the next one tried: an exception here once ended the task, and the gauges froze."""
        last, failing = None, False
        while True:
            failing = self._report_load(failing)
            last = await self._report_times(last)
            await asyncio.sleep(ENGINE_REPORT_S)

    def _report_load(self, failing: bool) -> bool:
        """The engine's gauges; True if they could not be reported (a warning the first time, then debug lines)."""
        try:
            self.metrics.load(self.engine.load)
        except Exception:  # noqa: BLE001 - the reporter must outlive it
            log.log(logging.DEBUG if failing else logging.WARNING, "engine gauges not reported", exc_info=True)
            return True
        return False

    async def _report_times(self, last: dict | None) -> dict | None:
        """The round counters' growth since `last` reported; the counters now (`last` if unavailable)."""
        try:
            now = await asyncio.to_thread(self._engine_times)
            if last is not None:
                self.metrics.engine_times({k: now[k] - last[k] for k in now})
        except Exception:  # noqa: BLE001 - a gone engine fails its requests and health check, not this
            log.debug("engine metrics unavailable", exc_info=True)
            return last
        return now

    def _engine_times(self) -> dict[str, float]:
        """The engine-wide counters, field by field (the engine thread updates them as we read: no dict copies)."""
        m = self.engine.metrics
        return {field: getattr(m, field) for field in ENGINE_REPORTED_FIELDS}


def _log_finished(request_id: str, delta, seconds: float) -> None:
    m = delta.metrics
    log.info("request %s: finished (%s) in %.3f s, %d tokens, first after %.3f s, %d prompt tokens cached, "
             "acceptance %.2f, tree hit rate %.2f", request_id, delta.finish_reason, seconds, m.num_generated_tokens,
             m.time_to_first_token_s, m.num_cached_tokens, m.acceptance_rate, m.cache_hit_rate)
