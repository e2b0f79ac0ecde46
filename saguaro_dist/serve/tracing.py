"""vLLM's OpenTelemetry request tracing (`--otlp-traces-endpoint`): one "llm_request" span (kind SERVER) per
generation, exported over OTLP, with vLLM's attribute names and our speculation figures under "saguaro.*".

The span starts when the HTTP request reached the replica's app and ends when its generation finished (or was
aborted, or failed: then its status is ERROR). Its parent is the trace the request's W3C `traceparent` /
`tracestate` headers carry; without them it starts a trace of its own. Nothing here imports OpenTelemetry until
tracing is asked for: without the flag a server only looks for those headers, to warn once that they go unused
(vLLM's log_tracing_disabled_warning), and stops looking after that.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import json
import logging
import os
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger(__name__)

SPAN_NAME = "llm_request"  # vLLM's
TRACER_NAME = "saguaro_dist.serve"
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
INSTALL_HINT = "pip install 'saguaro-dist[tracing]'"
DEFAULT_SERVICE_NAME = "saguaro-dist"  # service.name where neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names one
# At the app's shutdown (and the process's exit) the spans still batched go out, or are no longer waited for after
# this: the SDK's force_flush ignores its timeout, and retries each batch against a down collector for up to the
# exporter's timeout (OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, 10 s), while Serve kills a replica 20 s into its shutdown.
FLUSH_TIMEOUT_S = 5.0


class SpanAttributes:
    """vLLM's span attribute names (vllm/tracing/utils.py), then ours (saguaro.*: no OpenTelemetry convention)."""
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # ours: speculative decoding and the prefix cache, per request (the engine's RequestMetrics)
    SAGUARO_ACCEPTANCE_RATE = "saguaro.spec_decode.acceptance_rate"  # accepted / drafted tokens
    SAGUARO_DRAFT_TOKENS = "saguaro.spec_decode.num_draft_tokens"
    SAGUARO_ACCEPTED_TOKENS = "saguaro.spec_decode.num_accepted_tokens"
    SAGUARO_TREE_CACHE_HIT_RATE = "saguaro.spec_decode.tree_cache_hit_rate"  # SSD: speculation-tree lookups hit
    SAGUARO_CACHED_TOKENS = "saguaro.prefix_cache.num_cached_tokens"  # prompt tokens the prefix cache supplied
    # --collect-detailed-traces model: the target's work on the request
    SAGUARO_ROUNDS = "saguaro.spec_decode.num_rounds"  # target forwards after the prompt's (AR: decode steps)
    SAGUARO_MEAN_ACCEPTED_LENGTH = "saguaro.spec_decode.mean_accepted_length"  # tokens per round, the bonus one too
    SAGUARO_ACCEPTED_PER_POSITION = "saguaro.spec_decode.accepted_per_position"  # [i]: rounds accepting draft token i+1
    # --collect-detailed-traces worker: the draft workers' side
    SAGUARO_TREE_CACHE_HITS = "saguaro.spec_decode.tree_cache_hits"
    SAGUARO_TREE_CACHE_MISSES = "saguaro.spec_decode.tree_cache_misses"
    SAGUARO_FALLBACKS = "saguaro.spec_decode.fallbacks"  # JSON {fallback kind: rounds}, where the tree cache missed


class DetailedTraces(Enum):
    """vLLM's --collect-detailed-traces modules (DetailedTraceModules). vLLM's own spans add nothing for them since
    its V1 engine (time_in_model_forward / _execute are V0's); ours add what the engine counts per request:
    model, the target's rounds; worker, the draft workers' cache lookups and fallbacks; all, both."""
    MODEL = "model"
    WORKER = "worker"
    ALL = "all"


def detailed_trace_modules(value, endpoint: str | None) -> frozenset[DetailedTraces]:
    """The modules asked for (all: model and worker), from a list or vLLM's legacy comma-separated text. Refused
    without an endpoint (vLLM's rule: there is no span to add them to) and for a name vLLM does not know."""
    names = value.split(",") if isinstance(value, str) else [n for item in value or () for n in str(item).split(",")]
    names = [name.strip() for name in names if name.strip()]
    if not names:
        return frozenset()
    if not endpoint:
        raise ValueError("collect_detailed_traces requires `--otlp-traces-endpoint` to be set.")
    choices = [m.value for m in DetailedTraces]
    unknown = [name for name in names if name not in choices]
    if unknown:
        raise ValueError(f"collect_detailed_traces: {unknown[0]!r} is not one of {choices}")
    modules = {DetailedTraces(name) for name in names}
    return frozenset({DetailedTraces.MODEL, DetailedTraces.WORKER} if DetailedTraces.ALL in modules else modules)


class OtlpProtocol(Enum):
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL's values that vLLM takes (grpc when unset)."""
    GRPC = "grpc"
    HTTP_PROTOBUF = "http/protobuf"


def otlp_protocol() -> OtlpProtocol:
    value = os.environ.get(PROTOCOL_ENV, OtlpProtocol.GRPC.value)
    try:
        return OtlpProtocol(value)
    except ValueError:
        raise ValueError(f"Unsupported OTLP protocol {value!r} is configured ({PROTOCOL_ENV}: one of "
                         f"{[p.value for p in OtlpProtocol]})") from None


def check_tracing_available() -> None:
    """At start-up, where --otlp-traces-endpoint is given: the SDK and the protocol's exporter import, else a
    ValueError naming what is missing (vLLM's message, and how to install it)."""
    protocol = otlp_protocol()
    try:
        import opentelemetry.sdk.trace  # noqa: F401
        _exporter_class(protocol)
    except ImportError as err:
        raise ValueError(f"OpenTelemetry is not available. Unable to configure --otlp-traces-endpoint. Ensure "
                         f"OpenTelemetry packages are installed ({INSTALL_HINT}). Original error: "
                         f"{type(err).__name__}: {err}") from None


def _exporter_class(protocol: OtlpProtocol):
    if protocol is OtlpProtocol.GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter


_providers: dict[tuple[str, OtlpProtocol], object] = {}  # one per replica process and endpoint


def tracer_provider(endpoint: str):
    """This process's TracerProvider exporting to `endpoint` (made once: every app the process builds shares
    it). Not installed as OpenTelemetry's global one: the server's spans go where its flag says, whatever else
    in the process (Ray) traces."""
    protocol = otlp_protocol()
    key = (endpoint, protocol)
    if key not in _providers:
        from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter_class = _exporter_class(protocol)
        # (vLLM's: gRPC in the clear unless the endpoint is https://; the OTEL_EXPORTER_OTLP_* settings apply)
        grpc_options = {"insecure": True} if protocol is OtlpProtocol.GRPC else {}
        exporter = exporter_class(endpoint=endpoint, **grpc_options)
        resource = Resource.create({"saguaro.process_id": str(os.getpid())})
        if SERVICE_NAME not in OTELResourceDetector().detect().attributes:  # (OTEL_SERVICE_NAME, then the attributes)
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # (the SDK's exit handler waits 30 s)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        atexit.register(_within, provider.shutdown, FLUSH_TIMEOUT_S)
        _providers[key] = provider
        log.info("tracing requests to %s (OTLP %s)", endpoint, protocol.value)
    return _providers[key]


def _in_daemon_thread(work) -> concurrent.futures.Future:
    """`work()` in a thread of its own that never holds up the process's exit; its result as a Future."""
    result = concurrent.futures.Future()

    def run():
        if result.set_running_or_notify_cancel():
            try:
                result.set_result(work())
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                result.set_exception(err)
    threading.Thread(target=run, name="saguaro-tracing-flush", daemon=True).start()
    return result


def _within(work, timeout_s: float) -> None:
    """At the process's exit: `work()`, waited for at most timeout_s."""
    try:
        _in_daemon_thread(work).result(timeout_s)
    except Exception:  # noqa: BLE001 - a collector that cannot be reached must not hold up the exit
        log.warning("tracing: spans still batched at exit are dropped (the OTLP collector did not take them)")


# ---- the incoming request ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrival:
    """When the HTTP request reached the app (the wall clock for the span, the monotonic one for durations),
    and its W3C trace headers."""
    wall_ns: int
    clock: float
    headers: dict[str, str]

    @classmethod
    def since(cls, clock: float, headers: dict[str, str] | None = None) -> Arrival:
        """An arrival at monotonic time `clock` (a generation no HTTP request started: its stream's start)."""
        return cls(time.time_ns() - int((time.monotonic() - clock) * 1e9), clock, headers or {})


_arrival: ContextVar[Arrival | None] = ContextVar("saguaro_request_arrival", default=None)


def trace_headers(scope_headers) -> dict[str, str]:
    """The W3C trace headers among an ASGI scope's (vLLM's extract_trace_headers)."""
    wanted = {name.encode(): name for name in TRACE_HEADERS}
    return {wanted[k.lower()]: v.decode("latin-1") for k, v in scope_headers if k.lower() in wanted}


_warned_disabled = False


def log_tracing_disabled_warning() -> None:
    """vLLM's: once per process."""
    global _warned_disabled
    if not _warned_disabled:
        _warned_disabled = True
        log.warning("Received a request with trace context but tracing is disabled")


class TraceContextMiddleware:
    """Pure ASGI (the route's tasks inherit the context var it sets): each HTTP request's Arrival while
    tracing; without tracing, the one warning for trace headers that go unused, then nothing at all."""

    def __init__(self, app, enabled: bool):
        self.app, self.enabled = app, enabled

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (not self.enabled and _warned_disabled):
            return await self.app(scope, receive, send)
        headers = trace_headers(scope["headers"])
        if not self.enabled:
            if headers:
                log_tracing_disabled_warning()
            return await self.app(scope, receive, send)
        token = _arrival.set(Arrival(time.time_ns(), time.monotonic(), headers))
        try:
            await self.app(scope, receive, send)
        finally:
            _arrival.reset(token)


# ---- the spans ----------------------------------------------------------------------------------------
def _never_fails(report):
    """A span report that fails (its attributes or the span itself) is logged: tracing never fails a request."""
    @functools.wraps(report)
    def guarded(*args, **kwargs) -> None:
        try:
            report(*args, **kwargs)
        except Exception:  # noqa: BLE001
            log.warning("request span not recorded", exc_info=True)
    return guarded


class RequestTracer:
    """A replica's spans: ServingState.stream reports each generation's end here (finished, aborted or
    failed). A span that cannot be made is logged, never the request's failure."""

    def __init__(self, endpoint: str, model_name: str, detailed: frozenset[DetailedTraces] = frozenset()):
        self.provider = tracer_provider(endpoint)
        self.tracer = self.provider.get_tracer(TRACER_NAME)
        self.model_name = model_name  # gen_ai.response.model, unless the job runs a LoRA adapter (its name)
        self.detailed = detailed  # --collect-detailed-traces (detailed_trace_modules)

    @_never_fails
    def finished(self, job, request_id: str, delta, started: float) -> None:
        """A generation that ended (`delta`: its last, with the engine's RequestMetrics); started: the
        monotonic time its stream began (the span's start where no HTTP request carried it)."""
        attributes = {**self._request_attributes(job, request_id), **_metrics_attributes(job, delta.metrics),
                      **_detailed_attributes(delta.metrics, self.detailed)}
        self._end(attributes, [delta.finish_reason], started)

    @_never_fails
    def aborted(self, job, request_id: str, started: float) -> None:
        """One whose client went away (vLLM's "abort" finish reason): an ERROR span."""
        self._end(self._request_attributes(job, request_id), ["abort"], started,
                  error="request aborted (the client went away)")

    @_never_fails
    def failed(self, job, request_id: str, err: BaseException, started: float) -> None:
        """One the engine failed (answered as an error): an ERROR span with the exception."""
        self._end(self._request_attributes(job, request_id), ["error"], started,
                  error=f"{type(err).__name__}: {err}", exception=err)

    def flush(self) -> bool:
        """Export what is batched now (tests: unbounded where the collector is down, see flush_at_shutdown)."""
        return self.provider.force_flush()

    async def flush_at_shutdown(self) -> bool:
        """The app's shutdown: export what is batched, waited for at most FLUSH_TIMEOUT_S (a down collector must
        not delay the engine's shutdown that follows). Past that the export goes on in its own thread, unwaited."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(_in_daemon_thread(self.provider.force_flush)),
                                          FLUSH_TIMEOUT_S)
        except TimeoutError:
            log.warning("tracing: the batched spans were not all exported within %s s of the shutdown (is the OTLP "
                        "collector down?); the rest are not waited for", FLUSH_TIMEOUT_S)
            return False

    def _request_attributes(self, job, request_id: str) -> dict:
        p, a = job.params, SpanAttributes
        lora = getattr(job.lora_request, "lora_name", None)
        attributes = {a.GEN_AI_REQUEST_ID: request_id, a.GEN_AI_RESPONSE_MODEL: lora or self.model_name,
                      a.GEN_AI_REQUEST_TEMPERATURE: float(p.temperature), a.GEN_AI_REQUEST_TOP_P: float(p.top_p),
                      a.GEN_AI_REQUEST_N: job.n, a.GEN_AI_USAGE_PROMPT_TOKENS: len(job.prompt_ids)}
        if p.top_k > 0:  # (0: no top-k)
            attributes[a.GEN_AI_REQUEST_TOP_K] = p.top_k
        if p.max_tokens is not None and not job.scores_only:  # (a max_tokens 0 request runs one token, unshown)
            attributes[a.GEN_AI_REQUEST_MAX_TOKENS] = p.max_tokens
        return attributes

    def _end(self, attributes: dict, finish_reasons: list, started: float, error: str | None = None,
             exception: BaseException | None = None) -> None:
        from opentelemetry import trace
        from opentelemetry.context import Context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        arrival = _arrival.get() or Arrival.since(started)
        elapsed = time.monotonic() - arrival.clock
        attributes = {**attributes, SpanAttributes.GEN_AI_LATENCY_E2E: elapsed,
                      SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS: json.dumps(finish_reasons)}
        # the caller's trace, else a new one (an empty Context: never whatever span this thread has current)
        parent = TraceContextTextMapPropagator().extract(arrival.headers) if arrival.headers else Context()
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes,
                                      start_time=arrival.wall_ns)
        if exception is not None:
            span.record_exception(exception)
        if error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        span.end(end_time=arrival.wall_ns + int(elapsed * 1e9))


def _metrics_attributes(job, m) -> dict:
    """What the engine measured of a finished generation (its RequestMetrics), with vLLM's phases: arrival ->
    first scheduled (time_in_queue) -> first token (time_in_model_prefill) -> last (time_in_model_decode);
    time_in_model_inference: prefill and decode. A phase the request never reached is left out."""
    if m is None:
        return {}
    a = SpanAttributes
    attributes = {a.GEN_AI_USAGE_COMPLETION_TOKENS: 0 if job.scores_only else m.num_generated_tokens,
                  a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: m.time_to_first_token_s,
                  a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: m.decode_time_s,
                  a.SAGUARO_ACCEPTANCE_RATE: m.acceptance_rate, a.SAGUARO_DRAFT_TOKENS: m.drafted_tokens,
                  a.SAGUARO_ACCEPTED_TOKENS: m.accepted_tokens, a.SAGUARO_TREE_CACHE_HIT_RATE: m.cache_hit_rate,
                  a.SAGUARO_CACHED_TOKENS: m.num_cached_tokens}
    if m.scheduled:
        attributes[a.GEN_AI_LATENCY_TIME_IN_QUEUE] = m.time_in_queue_s
    if m.scheduled and m.first_token_time:
        attributes.update({a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: m.prefill_time_s,
                           a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: m.inference_time_s})
    return attributes


def _detailed_attributes(m, detailed: frozenset[DetailedTraces]) -> dict:
    """--collect-detailed-traces' attributes: counts the engine keeps per request anyway (no extra timing)."""
    if m is None or not detailed:
        return {}
    a, attributes = SpanAttributes, {}
    if DetailedTraces.MODEL in detailed:
        attributes.update({a.SAGUARO_ROUNDS: m.rounds, a.SAGUARO_MEAN_ACCEPTED_LENGTH: m.mean_accepted_length,
                           a.SAGUARO_ACCEPTED_PER_POSITION: list(m.accepted_per_position)})
    if DetailedTraces.WORKER in detailed:
        attributes.update({a.SAGUARO_TREE_CACHE_HITS: m.cache_hits, a.SAGUARO_TREE_CACHE_MISSES: m.cache_misses,
                           a.SAGUARO_FALLBACKS: json.dumps(dict(m.fallbacks), sort_keys=True)})
    return attributes


def request_tracer(endpoint: str | None, model_name: str,
                   detailed: frozenset[DetailedTraces] = frozenset()) -> RequestTracer | None:
    """The app's tracer where --otlp-traces-endpoint is given; None (no spans, no OpenTelemetry) otherwise."""
    return RequestTracer(endpoint, model_name, detailed) if endpoint else None
