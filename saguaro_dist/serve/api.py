"""The OpenAI-compatible FastAPI app over one `LLM`; runs under Ray Serve (serve/app.py) or any ASGI server."""
from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from saguaro_dist.engine.loop_thread import EngineError
from saguaro_dist.engine.text import encode_text
from saguaro_dist.serve import responses
from saguaro_dist.serve.errors import APIError, install_error_handlers, stream_error
from saguaro_dist.serve.frontend import FrontendOptions, docs_settings, install_frontend
from saguaro_dist.serve.metrics import ServeMetrics
from saguaro_dist.serve.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, RequestCountMiddleware
from saguaro_dist.serve.openai_responses import ResponseEvents, ResponsesRequest, output_items, response_body
from saguaro_dist.serve.openai_responses import usage as responses_usage
from saguaro_dist.serve.prompts import encode_chat
from saguaro_dist.serve.protocol import (REPLY_ROLE, REQUEST_ID_PATTERN, ChatCompletionRequest, CompletionRequest,
                                         DetokenizeRequest, TokenizeRequest)
from saguaro_dist.serve.reasoning import ReasoningParser, ReasoningStream, split_reasoning
from saguaro_dist.serve.state import Finished, Job, ServingState, gather_or_cancel, merge
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.serve.tools import ToolChoiceKind, ToolStream

log = logging.getLogger(__name__)
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: far above any prompt a context window can hold as text
# As Ray Serve LLM. Every SSE write costs the replica Serve's per-message work (and a proxy trip), on
# the GIL the engine's round loop needs: with the demo pair at batch 1, a chunk per round made a request
# ~1.5x as slow as in-process through the proxy, 50 ms batches ~1.15x (and ~1.05x direct; docs/serving.md).
DEFAULT_STREAM_INTERVAL_MS = 50.0
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health", "/tokenize",
                    "/detokenize", "/reset_prefix_cache", "/version"})


@dataclass(frozen=True)
class ServerOptions:
    served_model_name: str
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS  # 0: one SSE chunk per engine round
    tool_call_parser: str | None = None  # reads tool_choice "auto" replies (tool_parsers.ToolCallParser); None: auto is a 400
    reasoning_parser: str | None = None  # splits a thinking model's reasoning from its content (reasoning.ReasoningParser)
    log_requests: bool = False  # an INFO line as each generation starts and ends (vLLM's --enable-log-requests)
    chat_template: str | None = None  # a Jinja chat template (the text) used instead of the tokenizer's
    model_aliases: tuple[str, ...] = ()  # more names requests may give (vLLM's several --served-model-name)
    frontend: FrontendOptions = FrontendOptions()  # CORS, root_path, docs routes (serve/frontend.py)

    def __post_init__(self):
        if not 0 <= self.stream_interval_ms <= 10_000:
            raise ValueError(f"stream_interval_ms must be in [0, 10000], got {self.stream_interval_ms!r}")
        for name, kind in (("tool_call_parser", ToolCallParser), ("reasoning_parser", ReasoningParser)):
            choices = [p.value for p in kind]
            if getattr(self, name) is not None and getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")


def create_app(engine, options: ServerOptions, metrics: ServeMetrics | None = None) -> FastAPI:
    app = FastAPI(title="saguaro-dist", lifespan=_lifespan, **docs_settings(options.frontend))
    metrics = metrics or ServeMetrics(options.served_model_name, enabled=False)
    app.state.saguaro = ServingState(engine, options.served_model_name, metrics, options.stream_interval_ms / 1e3,
                                     options.tool_call_parser, options.reasoning_parser, options.log_requests,
                                     options.chat_template, options.model_aliases)
    install_error_handlers(app)
    app.include_router(_router())
    # Outermost last: count every request, then CORS (a preflight carries no key), then auth, then the size limit.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=options.max_request_bytes)
    if options.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    install_frontend(app, options.frontend)
    app.add_middleware(RequestCountMiddleware, metrics=metrics, known_paths=ROUTES)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """The engine's gauges from start-up, on the server's own loop (an app is built before it runs under plain
    uvicorn): a scrape before any request finds them, as under Ray Serve, which runs this lifespan too."""
    state = app.state.saguaro
    state.start_reporter()
    try:
        yield
    finally:
        await state.stop_reporter()


class ClosingStreamingResponse(StreamingResponse):
    """Closes the body iterator when streaming stops early (the client went away and the request was
    cancelled), so the engine aborts the generation now, not whenever the generator is garbage collected."""

    async def stream_response(self, send) -> None:
        async with aclosing(self.body_iterator):
            await super().stream_response(send)


def _state(request: Request) -> ServingState:
    return request.app.state.saguaro


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went away (nobody reads it)


def _cancel_on_disconnect(handler):
    """Runs a generating route's handler until its client hangs up, then cancels it: its generations abort.
    Ray Serve cancels a handler whose client went away; a plain ASGI server (uvicorn) only says so through
    `receive`, so without this a non-streamed request, or a stream still waiting for its first delta, went
    on generating for nobody (vLLM's with_cancellation). A stream once answered is StreamingResponse's."""
    @functools.wraps(handler)
    async def watched(*args, **kwargs):
        work = asyncio.ensure_future(handler(*args, **kwargs))
        hung_up = asyncio.ensure_future(_hung_up(kwargs["request"]))
        try:
            await asyncio.wait((work, hung_up), return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and hung_up.result():
                log.debug("%s: the client went away; cancelling its generations", handler.__name__)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return await work
        finally:
            hung_up.cancel()
            if not work.done():  # the client went away, or this handler was cancelled (Ray Serve)
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)  # its aborts are sent before we return
    return watched


async def _hung_up(request: Request) -> bool:
    """True once the client disconnects (the body is read by now: the next message is the hang-up);
    False when the server cannot say (its receive failed), so the handler just runs on."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - watching is best effort; it must never fail the request
        log.debug("cannot watch this request for a disconnect", exc_info=True)
        return False
    return True


def _router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/health", _health, methods=["GET"])
    router.add_api_route("/v1/models", _models, methods=["GET"])
    router.add_api_route("/v1/completions", _completions, methods=["POST"])
    router.add_api_route("/v1/chat/completions", _chat, methods=["POST"])
    router.add_api_route("/v1/responses", _responses, methods=["POST"])
    router.add_api_route("/tokenize", _tokenize, methods=["POST"])
    router.add_api_route("/detokenize", _detokenize, methods=["POST"])
    router.add_api_route("/reset_prefix_cache", _reset_prefix_cache, methods=["POST"])
    router.add_api_route("/version", _version, methods=["GET"])
    return router


async def _health(request: Request) -> JSONResponse:
    """200 while the engine serves; 503 once it cannot (vLLM's rule), so a load balancer or a Kubernetes probe
    stops sending it traffic while Ray Serve replaces the replica (SaguaroServer.check_health)."""
    try:
        _state(request).engine.check_health()
    except EngineError as err:
        raise APIError(503, f"the engine cannot serve: {err}") from None
    return JSONResponse({"status": "ok"})


async def _reset_prefix_cache(request: Request) -> Response:
    """vLLM's admin route: forget every kept prefix (target and draft); 200 with no body."""
    await asyncio.to_thread(_state(request).engine.reset_prefix_cache)  # waits for the engine's loop thread
    return Response(status_code=200)


async def _version() -> dict:
    from saguaro_dist import __version__
    return {"version": __version__}


async def _models(request: Request) -> dict:
    state = _state(request)
    cards = [{"id": name, "object": "model", "created": 0, "owned_by": "saguaro-dist",
              "root": state.engine.config.model, "max_model_len": state.max_model_len} for name in state.model_names]
    return {"object": "list", "data": cards}


@_cancel_on_disconnect
async def _completions(body: CompletionRequest, request: Request):
    state = _state(request)
    body.reject_unsupported()
    model = state.check_model(body.model)
    jobs = state.jobs([state.encode(p, body.add_special_tokens) for p in body.prompts()], body, "prompt")
    return await _respond(state, body, jobs, model, responses.COMPLETION, _request_id(request, body.request_id))


@_cancel_on_disconnect
async def _chat(body: ChatCompletionRequest, request: Request):
    state = _state(request)
    body.reject_unsupported()
    model = state.check_model(body.model)
    prompt = encode_chat(state.tokenizer, body.messages, body.tools, body.chat_template_kwargs, state.chat_template,
                         end=body.prompt_end(), add_special_tokens=body.add_special_tokens)
    jobs = _chat_jobs(state, body, prompt, "messages")
    return await _respond(state, body, jobs, model, responses.CHAT, _request_id(request, body.request_id))


def _chat_jobs(state: ServingState, body, prompt: list[int], param: str) -> list[Job]:
    """A chat turn's jobs under its tool plan (chat completions and responses alike)."""
    plan = state.tool_plan_for(body)
    if plan.kind is ToolChoiceKind.AUTO and plan.parser is None:
        raise APIError(400, '"auto" tool choice needs a server started with a tool-call parser (--tool-call-parser '
                            f'{" | ".join(p.value for p in ToolCallParser)}); name a function or use "required" instead',
                       param="tool_choice")
    jobs = state.jobs([prompt], body, param)
    if body.include_reasoning:  # vLLM's include_reasoning false: the constraint holds from the first token
        jobs = map(state.reason_first, jobs)
    return [replace(job, params=plan.adjust(job.params)) for job in jobs]


@_cancel_on_disconnect
async def _responses(body: ResponsesRequest, request: Request):
    """OpenAI's Responses API (serve/openai_responses.py): the input runs as a chat turn would."""
    state = _state(request)
    body.reject_unsupported()
    model = state.check_model(body.model)
    prompt = encode_chat(state.tokenizer, body.messages(), body.chat_tools(), body.chat_template_kwargs,
                         state.chat_template, param="input")
    request_id = _request_id(request)
    (job,) = state.named(_chat_jobs(state, body, prompt, "input"), request_id)
    response_id = f"resp_{request_id}"
    if body.stream:
        batches = merge([state.stream(job)], state.stream_interval_s, lambda d: bool(d.text) or d.finished)
        first = await anext(batches, None)  # before answering: a request the engine rejects still gets a 400
        events = ResponseEvents(response_id, model, body, _logprob_items(state, job))
        events = _response_events(state, job, events, batches, first)
        return ClosingStreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    result = await state.collect(job)
    reasoning, text = split_reasoning(state.reasoning_parser_for(job), result.text)
    content, calls = state.tool_plan_for(body).parse(text)
    items = output_items(_shown(body, reasoning), content, calls, _logprob_items(state, job)(result.logprobs or []))
    return response_body(response_id, model, body, items, "completed",
                         result.finish_reason, **_response_extra(state, job, result.token_ids, result.metrics))


def _logprob_items(state: ServingState, job: Job):
    """Engine logprob entries -> Responses' logprobs items, which are chat's `logprobs.content` entries."""
    def items(entries: list) -> list:
        logprobs = _logprobs(state, responses.CHAT, job, entries)
        return logprobs["content"] if logprobs else []
    return items


def _response_extra(state: ServingState, job: Job, token_ids: list[int], metrics) -> dict:
    """A response's usage (reasoning_tokens: 0 without a reasoning parser, as OpenAI's field is always
    there) and our speculation stats."""
    cached = metrics.num_cached_tokens if metrics is not None else 0
    reasoning = state.reasoning_count(job, token_ids) or 0
    return {"usage": responses_usage(len(job.prompt_ids), len(token_ids), cached, reasoning),
            "speculation": responses.speculation([metrics], state.engine.config.mode.value)}


async def _response_events(state: ServingState, job: Job, events: ResponseEvents, batches, first):
    reasoning, tools = ReasoningStream(state.reasoning_parser_for(job)), ToolStream(state.tool_plan_for(events.body))
    token_ids, pending = [], events.opening()
    try:
        async with aclosing(batches):
            batch = first
            while batch is not None:
                for _, text, ids, last, logprobs in _per_choice(batch):
                    token_ids += ids
                    thought, text = reasoning.feed(text, last.finished)
                    thought, delta = _shown(events.body, thought) or "", tools.step(text, last.finished)
                    pending += (events.text(thought, delta.get("content", ""), logprobs)
                                + events.calls(delta.get("tool_calls", [])))
                    if last.finished:
                        pending += events.closing(last.finish_reason, **_response_extra(state, job, token_ids, last.metrics))
                yield pending
                pending = ""
                batch = await anext(batches, None)
    except Exception as err:  # noqa: BLE001 - headers are sent: the error travels as an event
        yield events.error(stream_error(err))


def _request_id(request: Request, from_body: str | None = None) -> str:
    """The request's id, vLLM's way: the X-Request-Id header, else the body's request_id, else a fresh one.
    The response's id is "<cmpl|chatcmpl>-<it>" and the logs name the request's generations by it. Ray Serve
    echoes the header in the response, and, when the client sent none, forwards one of its own, which then
    wins over a body's request_id as any gateway's header does (logged)."""
    given = request.headers.get("x-request-id")
    if given is None:
        return from_body or uuid.uuid4().hex
    if not REQUEST_ID_PATTERN.fullmatch(given):
        raise APIError(400, "X-Request-Id must be 1-128 letters, digits, '.', '_', ':' or '-'", param="X-Request-Id")
    if from_body is not None and from_body != given:
        log.info("request_id %r: the X-Request-Id header names this request %r (the header wins, as in vLLM)",
                 from_body, given)
    return given


async def _tokenize(body: TokenizeRequest, request: Request) -> dict:
    state = _state(request)
    state.check_model(body.model)
    if body.messages is not None:
        tokens = encode_chat(state.tokenizer, body.messages, body.tools, body.chat_template_kwargs, state.chat_template,
                             end=body.prompt_end(), add_special_tokens=body.special_tokens())
    else:
        tokens = encode_text(state.tokenizer, body.prompt, add_special_tokens=body.special_tokens())
    return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}


async def _detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = _state(request)
    state.check_model(body.model)
    if any(t < 0 or t >= len(state.tokenizer) for t in body.tokens):
        raise ValueError(f"tokens must be ids in [0, {len(state.tokenizer)})")
    return {"prompt": state.tokenizer.decode(body.tokens)}


# ---- generation responses -------------------------------------------------------------------
def _logprobs(state: ServingState, fmt: responses.Format, job: Job, entries: list | None, offset: int = 0):
    """A choice's `logprobs` object for generated tokens, or None when its request asked for none."""
    if job.params.logprobs is None or entries is None:
        return None
    return fmt.logprobs(state.tokenizer, [next(iter(e)) for e in entries], entries, job.params.logprobs, offset,
                        as_ids=job.tokens_as_ids)


def _prompt_logprobs(state: ServingState, job: Job, result) -> list | None:
    """vLLM's prompt_logprobs of a choice, or None when its request asked for none."""
    if job.params.prompt_logprobs is None:
        return None
    return responses.prompt_logprobs(state.tokenizer, result.prompt_logprobs, job.params.prompt_logprobs)


def _choice(state: ServingState, fmt: responses.Format, body, index: int, job: Job, result) -> dict:
    """One finished choice; with `echo` (completions) the prompt's text and log-probabilities lead."""
    if fmt.chat:
        plan = state.tool_plan_for(body)
        reasoning, text = split_reasoning(state.reasoning_parser_for(job), result.text)
        content, calls = plan.parse(text)
        return fmt.choice(index, _echoed(body, content if content or reasoning is None else None),
                          plan.finish_reason(result.finish_reason, calls), _logprobs(state, fmt, job, result.logprobs),
                          calls, _shown(body, reasoning), result.stop_reason)
    scored = _prompt_logprobs(state, job, result)  # vLLM's: echo's too (also in logprobs, before the completion's)
    if not body.echo:  # completions' echo: the prompt leads
        return fmt.choice(index, result.text, result.finish_reason, _logprobs(state, fmt, job, result.logprobs),
                          stop_reason=result.stop_reason, prompt_logprobs=scored)
    given = body.prompts()[index // body.n]  # the text as sent; a token-id prompt is decoded
    prompt = given if isinstance(given, str) else state.tokenizer.decode(job.prompt_ids)
    logprobs = None
    if job.params.logprobs is not None:
        ids = job.prompt_ids + [next(iter(e)) for e in result.logprobs or []]
        entries = (result.prompt_logprobs or [None] * len(job.prompt_ids)) + (result.logprobs or [])
        logprobs = fmt.logprobs(state.tokenizer, ids, entries, job.params.logprobs, as_ids=job.tokens_as_ids)
    return fmt.choice(index, prompt + result.text, result.finish_reason, logprobs, stop_reason=result.stop_reason,
                      prompt_logprobs=scored)


def _shown(body, reasoning: str | None) -> str | None:
    """The reasoning as the reply carries it: none when the request says include_reasoning false (vLLM's)."""
    return reasoning if body.include_reasoning else None


def _echoed(body, content: str | None) -> str | None:
    """A chat reply's content after what its `echo` repeats (the last message, when it is the reply's role)."""
    echoed = body.echoed()
    return echoed + (content or "") if echoed else content


async def _respond(state: ServingState, body, jobs: list[Job], model: str, fmt: responses.Format, request_id: str):
    jobs = state.named(jobs, request_id)
    if body.stream:
        return await _stream_response(state, body, jobs, model, fmt, request_id)
    # Cancelling this handler (client gone) cancels the generations, which abort in the engine; a choice
    # that fails (the engine refused it) ends the others too.
    results = await gather_or_cancel([state.collect(job) for job in jobs])
    results = [Finished(prompt_logprobs=r.prompt_logprobs, logprobs=[], finish_reason="length", metrics=r.metrics)
               if job.scores_only else r for job, r in zip(jobs, results)]
    choices = [_choice(state, fmt, body, i, job, r) for i, (job, r) in enumerate(zip(jobs, results))]
    extra = _final_extra(state, body, fmt, jobs, [r.token_ids for r in results], [r.metrics for r in results])
    if fmt.chat:  # vLLM's: the one prompt's, beside the choices
        extra["prompt_logprobs"] = _prompt_logprobs(state, jobs[0], results[0])
    return fmt.body(fmt.id_of(request_id), model, choices, **extra)


async def _stream_response(state: ServingState, body, jobs: list[Job], model: str, fmt,
                           request_id: str) -> ClosingStreamingResponse:
    batches = merge([state.stream(job) for job in jobs], state.stream_interval_s, lambda d: bool(d.text) or d.finished)
    # Wait for the first delta before answering, so a request the engine rejects still gets a 400.
    first = await anext(batches, None)
    chunks = _sse_chunks(_SseEvents(state, body, jobs, model, fmt, fmt.id_of(request_id)), batches, first)
    return ClosingStreamingResponse(chunks, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse_chunks(events, batches, first):
    pending = events.opening()  # the chat role chunk leaves with the first text: one write fewer
    try:
        async with aclosing(batches):
            batch = first
            while batch is not None:
                pending += events.of(batch)
                if events.done:  # the last text, usage and [DONE] in one write
                    pending += events.closing()
                if pending:
                    yield pending
                    pending = ""
                batch = await anext(batches, None)
    except Exception as err:  # noqa: BLE001 - headers are sent: the error travels as an event, like vLLM's
        yield responses.sse(stream_error(err)) + responses.sse("[DONE]")
        return
    if not events.done:  # the streams ended without every choice finishing (cannot happen unless aborted)
        yield pending + events.closing()


class _SseEvents:
    """The SSE text of one streamed response: one write per batch of deltas, each write one trip
    through Serve's streaming path (~1.4 ms of replica CPU on the engine's GIL, docs/serving.md)."""

    def __init__(self, state: ServingState, body, jobs: list[Job], model: str, fmt: responses.Format, response_id: str):
        self.state, self.body, self.jobs, self.model, self.fmt = state, body, jobs, model, fmt
        self.request_id = response_id
        self.token_ids: list[list[int]] = [[] for _ in jobs]  # generated per choice: usage counts them
        self.metrics, self.finished = [None] * len(jobs), 0
        # Log-probabilities of tokens whose text is held back (a possible stop string) wait for its chunk.
        self.pending_logprobs: list[list] = [[] for _ in jobs]
        self.text_sent = [0] * len(jobs)  # characters streamed per choice: the legacy text_offset
        self.tool_streams = [ToolStream(state.tool_plan_for(body)) for _ in jobs]  # chat: content and tool-call deltas
        self.reasoning_streams = [ReasoningStream(state.reasoning_parser_for(job)) for job in jobs]  # chat

    @property
    def done(self) -> bool:
        return self.finished == len(self.jobs)

    def opening(self) -> str:
        if not self.fmt.chat:
            return ""
        deltas = [{"role": REPLY_ROLE, "content": ""}]
        if self.body.echoed():  # vLLM's echo: the repeated last message is the first content delta
            deltas.append({"content": self.body.echoed()})
        return "".join(responses.sse(self.fmt.chunk(self.request_id, self.model, [self.fmt.chat_delta(i, delta, None)],
                                                    **self._running_usage(i)))
                       for delta in deltas for i in range(len(self.jobs)))

    def _running_usage(self, index: int) -> dict:
        """vLLM's continuous_usage_stats (with include_usage): every chunk carries its choice's usage so far."""
        options = self.body.stream_options
        if not (options and options.include_usage and options.continuous_usage_stats):
            return {}
        return {"usage": responses.running_usage(len(self.jobs[index].prompt_ids), len(self.token_ids[index]))}

    def of(self, batch) -> str:
        events = []
        for index, text, ids, last, logprobs in _per_choice(batch):
            self.token_ids[index] += ids
            self.pending_logprobs[index] += logprobs
            extra = {}
            if last.finished:
                self.metrics[index], self.finished = last.metrics, self.finished + 1
                if self.done:  # the final chunk carries usage and the speculation stats
                    extra = _final_extra(self.state, self.body, self.fmt, self.jobs, self.token_ids, self.metrics)
            choice = self._choice(index, text, last)
            if choice is not None:
                extra = {**extra, **self._running_usage(index)}  # the request's usage follows in its own chunk
                events.append(responses.sse(self.fmt.chunk(self.request_id, self.model, [choice], **extra)))
        return "".join(events)

    def _choice(self, index: int, text: str, last) -> dict | None:
        """This batch's choice for one index, or None when it has nothing to send yet."""
        reason = last.finish_reason if last.finished else None
        stop_reason = last.stop_reason if last.finished else None
        if not self.fmt.chat:
            if not (text or last.finished):
                return None
            return self.fmt.delta_choice(index, text, reason, self._take_logprobs(index, text), stop_reason)
        tools = self.tool_streams[index]
        reasoning, text = self.reasoning_streams[index].feed(text, last.finished)
        delta = {**({"reasoning": reasoning} if _shown(self.body, reasoning) else {}), **tools.step(text, last.finished)}
        if not (delta or last.finished):
            return None  # text held back (a tool call may be starting): its log-probabilities wait too
        reason = tools.plan.finish_reason(reason, tools.calls) if last.finished else None
        return self.fmt.chat_delta(index, delta, reason, self._take_logprobs(index, text), stop_reason)

    def _take_logprobs(self, index: int, text: str) -> dict | None:
        entries, self.pending_logprobs[index] = self.pending_logprobs[index], []
        offset, self.text_sent[index] = self.text_sent[index], self.text_sent[index] + len(text)
        return _logprobs(self.state, self.fmt, self.jobs[index], entries, offset)

    def closing(self) -> str:
        events = ""
        if self.body.include_usage_chunk:  # OpenAI's stream_options.include_usage: one more chunk, no choices
            usage = _final_extra(self.state, self.body, self.fmt, self.jobs, self.token_ids, self.metrics)["usage"]
            events += responses.sse(self.fmt.chunk(self.request_id, self.model, [], usage=usage))
        return events + responses.sse("[DONE]")


def _per_choice(batch: list[tuple[int, object]]) -> list[tuple[int, str, list[int], object, list]]:
    """A batch's deltas joined per choice: (index, text, token ids, the last delta, logprob entries)."""
    grouped: dict[int, list] = {}
    for index, delta in batch:
        grouped.setdefault(index, []).append(delta)
    return [(i, "".join(d.text for d in ds), [t for d in ds for t in d.token_ids], ds[-1],
             [e for d in ds for e in (d.logprobs or [])]) for i, ds in grouped.items()]


def _prompt_tokens(jobs: list[Job], n: int) -> int:
    """Each prompt once, however many samples (n) it has, as OpenAI counts usage."""
    return sum(len(job.prompt_ids) for job in jobs[::n])


def _cached_tokens(metrics: list, n: int) -> int:
    """Counted as the prompts are: once per prompt (its first sample's)."""
    return sum(m.num_cached_tokens for m in metrics[::n] if m is not None)


def _reasoning_tokens(state: ServingState, fmt: responses.Format, jobs: list[Job], token_ids: list[list[int]]) -> int | None:
    """Chat's completion tokens that were reasoning, over every choice; None where usage leaves the figure
    out (completions, or a server without a reasoning parser)."""
    if not fmt.chat or state.reasoning_tokens is None:
        return None
    return sum(state.reasoning_count(job, ids) for job, ids in zip(jobs, token_ids))


def _final_extra(state: ServingState, body, fmt: responses.Format, jobs: list[Job], token_ids: list[list[int]],
                 metrics: list) -> dict:
    usage = responses.usage(_prompt_tokens(jobs, body.n), sum(map(len, token_ids)), _cached_tokens(metrics, body.n),
                            _reasoning_tokens(state, fmt, jobs, token_ids))
    return {"usage": usage,
            "speculation": responses.speculation(metrics, state.engine.config.mode.value)}
