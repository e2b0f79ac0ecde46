"""The OpenAI-compatible FastAPI app over one `LLM`; runs under Ray Serve (serve/app.py) or any ASGI server.

Here: the server's options and the app (routes, middleware). The routes are info_routes.py (health, models,
tokenize, ...), generate_routes.py (completions and chat: whole replies in full_replies.py, streamed ones in
sse_stream.py) and responses_route.py; route_support.py holds what they share."""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI

from saguaro_dist.config import SPECULATIVE_MODES
from saguaro_dist.serve import info_routes
from saguaro_dist.serve.chat_request import REPLY_ROLE
from saguaro_dist.serve.errors import UnexpectedErrorMiddleware, install_error_handlers
from saguaro_dist.serve.frontend import FrontendOptions, docs_settings, install_frontend
from saguaro_dist.serve.generate_routes import chat, completions
from saguaro_dist.serve.lora_models import ServedModels
from saguaro_dist.serve.lora_modules import LoRAModule, runtime_updates_allowed
from saguaro_dist.serve.lora_routes import LORA_ROUTES, add_lora_routes
from saguaro_dist.serve.metrics import ServeMetrics
from saguaro_dist.serve.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, RequestCountMiddleware
from saguaro_dist.serve.reasoning import ReasoningParser
from saguaro_dist.serve.responses_route import responses_route
from saguaro_dist.serve.state import ServingState
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.serve.tracing import (TraceContextMiddleware, check_tracing_available, detailed_trace_modules,
                                        request_tracer)

log = logging.getLogger(__name__)
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: far above any prompt a context window can hold as text
# As Ray Serve LLM. Every SSE write costs the replica Serve's per-message work (and a proxy trip), on
# the GIL the engine's round loop needs: with the demo pair at batch 1, a chunk per round made a request
# ~1.5x as slow as in-process through the proxy, 50 ms batches ~1.15x (and ~1.05x direct; docs/serving.md).
DEFAULT_STREAM_INTERVAL_MS = 50.0
# (path, method, handler, route name: the stem of its OpenAPI operationId, kept as it was before the split)
_ROUTE_TABLE = (
    ("/health", "GET", info_routes.health, "_health"),
    ("/v1/models", "GET", info_routes.models, "_models"),
    ("/v1/completions", "POST", completions, "_completions"),
    ("/v1/chat/completions", "POST", chat, "_chat"),
    ("/v1/responses", "POST", responses_route, "_responses"),
    ("/tokenize", "POST", info_routes.tokenize, "_tokenize"),
    ("/detokenize", "POST", info_routes.detokenize, "_detokenize"),
    ("/reset_prefix_cache", "POST", info_routes.reset_prefix_cache, "_reset_prefix_cache"),
    ("/version", "GET", info_routes.version, "_version"),
)
ROUTES = frozenset(path for path, *_ in _ROUTE_TABLE)
# Not counted in saguaro_requests, as vLLM leaves them out: Prometheus's scrapes (serve/app.py adds the route), and
# the probes (a Kubernetes liveness probe every few seconds would outnumber the API's requests)
UNCOUNTED_PATHS = frozenset({"/metrics", "/health", "/version"})


@dataclass(frozen=True)
class ServerOptions:
    served_model_name: str
    api_key: str | tuple[str, ...] | None = None  # several: any one authenticates (vLLM's --api-key K1 K2)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS  # 0: one SSE chunk per engine round
    tool_call_parser: str | None = None  # reads tool_choice "auto" replies (tool_parsers.ToolCallParser); None: auto is a 400
    reasoning_parser: str | None = None  # splits a thinking model's reasoning from its content (reasoning.ReasoningParser)
    log_requests: bool = False  # an INFO line as each generation starts and ends (vLLM's --enable-log-requests)
    chat_template: str | None = None  # a Jinja chat template (the text) used instead of the tokenizer's
    model_aliases: tuple[str, ...] = ()  # more names requests may give (vLLM's several --served-model-name)
    frontend: FrontendOptions = FrontendOptions()  # CORS, root_path, docs routes (serve/frontend.py)
    response_role: str = REPLY_ROLE  # a new chat turn's role in replies (vLLM's --response-role)
    lora_modules: tuple[LoRAModule, ...] = ()  # adapters served by name (vLLM's --lora-modules; need enable_lora)
    runtime_lora_updating: bool | None = None  # the load / unload routes (None: VLLM_ALLOW_RUNTIME_LORA_UPDATING here)
    otlp_traces_endpoint: str | None = None  # an OTLP collector for each request's span (serve/tracing.py; vLLM's)
    collect_detailed_traces: tuple | str | None = None  # vLLM's: model / worker / all (tracing.detailed_trace_modules)

    def __post_init__(self):
        if not isinstance(self.response_role, str) or not self.response_role.strip():
            raise ValueError(f"response_role must be a non-empty role name (vLLM's --response-role, default "
                             f"{REPLY_ROLE!r}), got {self.response_role!r}")
        if not 0 <= self.stream_interval_ms <= 10_000:
            raise ValueError(f"stream_interval_ms must be in [0, 10000], got {self.stream_interval_ms!r}")
        for name, kind in (("tool_call_parser", ToolCallParser), ("reasoning_parser", ReasoningParser)):
            choices = [p.value for p in kind]
            if getattr(self, name) is not None and getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.otlp_traces_endpoint is not None:
            if not isinstance(self.otlp_traces_endpoint, str) or not self.otlp_traces_endpoint.strip():
                raise ValueError(f"otlp_traces_endpoint must be a URL such as http://collector:4317, got "
                                 f"{self.otlp_traces_endpoint!r}")
            check_tracing_available()  # at start-up, not at the first request
        object.__setattr__(self, "collect_detailed_traces",  # (a frozenset of modules; refused without an endpoint)
                           detailed_trace_modules(self.collect_detailed_traces, self.otlp_traces_endpoint))


def create_app(engine, options: ServerOptions, metrics: ServeMetrics | None = None,
               models: ServedModels | None = None) -> FastAPI:
    """models: the names and adapters, if the caller made them (a Serve replica does, before its model loads)."""
    app = FastAPI(title="saguaro-dist", lifespan=_lifespan, **docs_settings(options.frontend))
    metrics = metrics or ServeMetrics(options.served_model_name, enabled=False)
    if engine.config.mode in SPECULATIVE_MODES:
        metrics.speculation_positions(engine.config.k)
    # Each --lora-modules adapter is read against the base model here, then where the engine's target reads it
    # (on Ray, rank 0's node): one that cannot run fails start-up.
    models = models or ServedModels((options.served_model_name, *options.model_aliases), engine.config,
                                    options.lora_modules)
    if hasattr(engine, "check_lora_adapter"):
        models.check_on_target(engine.check_lora_adapter, getattr(engine, "add_lora", None))
    app.state.saguaro = ServingState(engine, options.served_model_name, metrics, options.stream_interval_ms / 1e3,
                                     options.tool_call_parser, options.reasoning_parser, options.log_requests,
                                     options.chat_template, options.model_aliases, models,
                                     request_tracer(options.otlp_traces_endpoint, options.served_model_name,
                                                    options.collect_detailed_traces))
    runtime_lora = runtime_updates_allowed(options.runtime_lora_updating)  # at start-up, as vLLM: routes or none
    app.state.response_role = options.response_role  # route_support.response_role
    install_error_handlers(app)
    app.include_router(_router(runtime_lora))
    # Outermost last: count every request, then CORS (a preflight carries no key), then auth, then the size limit,
    # then the catch-all 500 (errors.UnexpectedErrorMiddleware: the connection stays usable).
    app.add_middleware(UnexpectedErrorMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=options.max_request_bytes)
    if options.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    install_frontend(app, options.frontend)
    app.add_middleware(RequestCountMiddleware, metrics=metrics, uncounted_paths=UNCOUNTED_PATHS,
                       known_paths=ROUTES | frozenset(LORA_ROUTES) if runtime_lora else ROUTES)
    # outermost: a request's span starts as it arrives (without tracing: the warning for unused trace headers)
    app.add_middleware(TraceContextMiddleware, enabled=bool(options.otlp_traces_endpoint))
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
        if state.tracer is not None:  # the spans still batched go out before the replica stops (a bounded wait)
            await state.tracer.flush_at_shutdown()


def _router(runtime_lora: bool) -> APIRouter:
    router = APIRouter()
    for path, method, handler, name in _ROUTE_TABLE:
        router.add_api_route(path, handler, methods=[method], name=name)
    if runtime_lora:
        log.warning("LoRA dynamic loading & unloading is enabled in the API server (VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
        add_lora_routes(router)
    return router
