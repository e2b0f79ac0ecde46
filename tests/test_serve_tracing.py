"""vLLM's --otlp-traces-endpoint: each generation's "llm_request" span (kind SERVER) reaches a real OTLP collector
(gRPC by default, http/protobuf when OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says so), a child of the trace the
request's `traceparent` header names (else the root of a new trace), with vLLM's attribute names, the usage the
response reports and our speculation figures; an aborted request's span is an error. The flag without the
exporter packages is a clear error at start-up. Real HTTP (the app under loopback uvicorn), a real engine over
tiny checkpoints written by transformers."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from engine_helpers import wait_for
from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.cli import main
from saguaro_dist.serve import tracing
from saguaro_dist.serve.api import ServerOptions, create_app
from test_serve_fixtures import make_tokenizer, write_llama

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
LONG = 4000  # tokens of generation (ignore_eos): still running when the client hangs up
GRPC_EXPORTER = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"


class Collector:
    """The spans an OTLP collector received (either transport)."""

    def __init__(self):
        self.spans: list = []
        self._lock = threading.Lock()

    def receive(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            self.spans += [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]

    def of(self, request_id: str) -> list:
        """The spans of the generations of the request with this X-Request-Id."""
        with self._lock:
            return [s for s in self.spans if attributes(s)["gen_ai.request.id"].startswith(f"{request_id}-")]


class GrpcCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: Collector):
        self.collector = collector

    def Export(self, request, context):  # noqa: N802 - the service's method name
        self.collector.receive(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def attributes(span) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}


@pytest.fixture(scope="module")
def grpc_collector():
    collector, server = Collector(), grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(GrpcCollector(collector), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """sd over a draft equal to the target (every greedy proposal accepted), context enough for LONG tokens."""
    root, tokenizer = tmp_path_factory.mktemp("tracing"), make_tokenizer()
    target, draft = (write_llama(root / name, tokenizer, hidden=32, layers=1, seed=5, max_positions=LONG + 64)
                     for name in ("target", "draft"))
    with LLM(model=target, draft=draft, mode="sd", k=3, max_model_len=LONG + 64) as engine:
        yield engine


@pytest.fixture(scope="module")
def traced(llm, grpc_collector):
    """(base URL, the app, the collector) of a server tracing to the gRPC collector."""
    collector, endpoint = grpc_collector
    app = create_app(llm, ServerOptions("m", otlp_traces_endpoint=endpoint))
    with serve_on_loopback(app) as url:
        yield url, app, collector


def complete(url: str, request_id: str, headers: dict | None = None, **fields) -> dict:
    body = {"model": "m", "prompt": "the cat sat", "max_tokens": 6, "temperature": 0, "ignore_eos": True, **fields}
    reply = httpx.post(f"{url}/completions", json=body, headers={"X-Request-Id": request_id, **(headers or {})},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def exported(app, collector: Collector, request_id: str, count: int = 1) -> list:
    """The request's spans, once the replica's batch went out (flushed, not waited for)."""
    wait_for(lambda: app.state.saguaro.tracer.flush() and len(collector.of(request_id)) >= count)
    return collector.of(request_id)


def test_span_continues_the_callers_trace(traced):
    url, app, collector = traced
    reply = complete(url, "traced-1", {"traceparent": TRACEPARENT})
    (span,) = exported(app, collector, "traced-1")
    assert span.name == "llm_request" and span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert span.status.code != trace_pb2.Status.STATUS_CODE_ERROR
    got = attributes(span)
    assert got["gen_ai.response.model"] == "m"
    assert got["gen_ai.usage.prompt_tokens"] == reply["usage"]["prompt_tokens"]
    assert got["gen_ai.usage.completion_tokens"] == reply["usage"]["completion_tokens"] == 6
    assert json.loads(got["gen_ai.response.finish_reasons"]) == ["length"]
    assert (got["gen_ai.request.temperature"], got["gen_ai.request.top_p"]) == (0.0, 1.0)
    assert (got["gen_ai.request.max_tokens"], got["gen_ai.request.n"]) == (6, 1)
    assert "gen_ai.request.top_k" not in got  # (no top-k asked for)


def test_latencies_are_ordered_and_span_the_request(traced):
    url, app, collector = traced
    complete(url, "traced-2", {"traceparent": TRACEPARENT}, max_tokens=8)
    (span,) = exported(app, collector, "traced-2")
    got = attributes(span)
    names = ("time_to_first_token", "time_in_model_decode", "e2e")
    first, decode, e2e = (got[f"gen_ai.latency.{name}"] for name in names)
    assert 0 < first <= first + decode <= e2e
    queue, prefill, inference = (got[f"gen_ai.latency.{name}"]
                                 for name in ("time_in_queue", "time_in_model_prefill", "time_in_model_inference"))
    assert queue >= 0 and prefill > 0 and queue + prefill == pytest.approx(first)  # (vLLM's phases)
    assert inference == pytest.approx(prefill + decode)
    assert span.start_time_unix_nano < span.end_time_unix_nano
    assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(e2e * 1e9, abs=1e3)


def test_speculation_attributes(traced):
    url, app, collector = traced
    complete(url, "traced-3", top_k=5, max_tokens=9)
    got = attributes(exported(app, collector, "traced-3")[0])
    assert got["gen_ai.request.top_k"] == 5
    drafted, accepted = got["saguaro.spec_decode.num_draft_tokens"], got["saguaro.spec_decode.num_accepted_tokens"]
    assert drafted > 0 and accepted == drafted and got["saguaro.spec_decode.acceptance_rate"] == 1.0  # the same model
    assert got["saguaro.spec_decode.tree_cache_hit_rate"] == 0.0  # (sd builds no speculation tree)
    assert got["saguaro.prefix_cache.num_cached_tokens"] >= 0


def test_request_without_traceparent_starts_a_new_trace(traced):
    url, app, collector = traced
    complete(url, "untraced-1", n=2, temperature=0.8, seed=3)
    spans = exported(app, collector, "untraced-1", count=2)
    assert len(spans) == 2 and all(not s.parent_span_id for s in spans)  # roots, one per choice
    assert all(s.trace_id.hex() != TRACE_ID and len(s.trace_id) == 16 for s in spans)
    assert [attributes(s)["gen_ai.request.n"] for s in spans] == [2, 2]


def test_aborted_request_ends_its_span_in_error(traced):
    url, app, collector = traced
    body = {"model": "m", "prompt": "the cat sat", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=60,
                      headers={"X-Request-Id": "aborted-1", "traceparent": TRACEPARENT}) as reply:
        next(line for line in reply.iter_lines() if line.startswith("data:"))  # generating: then hang up
    (span,) = exported(app, collector, "aborted-1")
    assert span.status.code == trace_pb2.Status.STATUS_CODE_ERROR and "aborted" in span.status.message
    assert span.trace_id.hex() == TRACE_ID
    assert json.loads(attributes(span)["gen_ai.response.finish_reasons"]) == ["abort"]


# ---- http/protobuf ----------------------------------------------------------------------------------
def http_collector(collector: Collector) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            collector.receive(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass
    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def test_http_protobuf_when_the_environment_says_so(llm, monkeypatch):
    monkeypatch.setenv(tracing.PROTOCOL_ENV, "http/protobuf")
    collector = Collector()
    server = http_collector(collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        app = create_app(llm, ServerOptions("m", otlp_traces_endpoint=endpoint))
        with serve_on_loopback(app) as url:
            complete(url, "over-http-1", {"traceparent": TRACEPARENT})
            (span,) = exported(app, collector, "over-http-1")
        assert span.name == "llm_request" and span.parent_span_id.hex() == PARENT_ID
    finally:
        server.shutdown()


def test_unsupported_protocol_is_refused(monkeypatch):
    monkeypatch.setenv(tracing.PROTOCOL_ENV, "json")
    with pytest.raises(ValueError, match="Unsupported OTLP protocol 'json'"):
        ServerOptions("m", otlp_traces_endpoint="http://127.0.0.1:4317")


# ---- without the exporter ----------------------------------------------------------------------------
def test_missing_exporter_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, GRPC_EXPORTER, None)  # its import fails, as where it is not installed
    with pytest.raises(ValueError, match=r"OpenTelemetry is not available.*saguaro-dist\[tracing\]"):
        ServerOptions("m", otlp_traces_endpoint="http://127.0.0.1:4317")


def test_serve_flag_without_the_exporter_exits_before_ray(llm, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, GRPC_EXPORTER, None)
    model = llm.config.model
    assert main(["serve", model, "--otlp-traces-endpoint", "http://127.0.0.1:4317"]) == 2
    err = capsys.readouterr().err
    assert "OpenTelemetry is not available" in err and "Traceback" not in err and err.count("\n") == 1, err


def test_without_the_flag_trace_headers_warn_once_and_nothing_is_imported(llm, monkeypatch, caplog):
    monkeypatch.setattr(tracing, "_warned_disabled", False)
    with serve_on_loopback(create_app(llm, ServerOptions("m"))) as url, caplog.at_level("WARNING", tracing.__name__):
        for i in range(2):
            complete(url, f"plain-{i}", {"traceparent": TRACEPARENT}, max_tokens=1)
    warned = [r for r in caplog.records if "trace context but tracing is disabled" in r.getMessage()]
    assert len(warned) == 1
    code = ("import sys; from saguaro_dist.serve.api import ServerOptions; ServerOptions('m'); "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.exporter')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


# ---- review fixes: a bounded shutdown flush, the user's service name, span failures ------------------------
class StalledCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """A collector that holds each export until released (as one that is down, or overloaded, for as long)."""

    def __init__(self, collector: Collector):
        self.collector, self.release = collector, threading.Event()

    def Export(self, request, context):  # noqa: N802 - the service's method name
        self.release.wait(60)
        self.collector.receive(request)
        return trace_service_pb2.ExportTraceServiceResponse()


async def one_request_then_shutdown(app) -> None:
    """The app's lifespan (start-up, then shutdown) around one request."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            body = {"model": "m", "prompt": "the cat sat", "max_tokens": 2, "temperature": 0}
            reply = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "stalled-1"})
            assert reply.status_code == 200, reply.text


def test_shutdown_flush_does_not_wait_on_a_stalled_collector(llm, monkeypatch, caplog):
    """Old: the lifespan awaited force_flush, whose timeout the SDK ignores: each batch retried against a down
    collector (~7 s each) and the replica passed Serve's graceful_shutdown_timeout_s before engine.shutdown().
    Now the wait is bounded (asyncio.wait_for): the shutdown returns while the collector still holds the export,
    and the export, unwaited, still goes out once the collector answers."""
    collector, server = Collector(), grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    stalled = StalledCollector(collector)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(stalled, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setattr(tracing, "FLUSH_TIMEOUT_S", 0.01)
    try:
        app = create_app(llm, ServerOptions("m", otlp_traces_endpoint=f"http://127.0.0.1:{port}"))
        with caplog.at_level("WARNING", tracing.__name__):
            asyncio.run(one_request_then_shutdown(app))
        assert not collector.of("stalled-1")  # nothing could be exported yet: the shutdown did not wait for it
        assert any("not all exported within 0.01 s of the shutdown" in r.getMessage() for r in caplog.records)
        stalled.release.set()
        wait_for(lambda: len(collector.of("stalled-1")) == 1)  # the flush went on in its own thread
    finally:
        stalled.release.set()
        server.stop(grace=None)


@pytest.mark.parametrize("environment, service_name", [
    ({}, "saguaro-dist"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes,team=ml"}, "from-attributes"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes", "OTEL_SERVICE_NAME": "from-name"}, "from-name"),
    ({"OTEL_SERVICE_NAME": "from-name"}, "from-name"),
])
def test_service_name_follows_the_specs_order(environment, service_name, monkeypatch):
    """Old: "saguaro-dist" replaced OTEL_RESOURCE_ATTRIBUTES' service.name. The spec's order: OTEL_SERVICE_NAME,
    then OTEL_RESOURCE_ATTRIBUTES, then our default."""
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tracing, "_providers", {})  # (a provider of its own, made under this environment)
    resource = tracing.tracer_provider("http://127.0.0.1:4317").resource.attributes
    assert resource["service.name"] == service_name
    assert resource["saguaro.process_id"] and resource.get("team", "ml") == "ml"


def test_a_span_whose_attributes_fail_never_fails_the_request(grpc_collector, caplog):
    """Old: finished / aborted / failed built the span's attributes outside the guard, so an error there (a job the
    tracer cannot read) reached the request."""
    tracer = tracing.RequestTracer(grpc_collector[1], "m")
    with caplog.at_level("WARNING", tracing.__name__):
        tracer.finished(None, "r-0", None, 0.0)
        tracer.aborted(None, "r-1", 0.0)
        tracer.failed(None, "r-2", RuntimeError("engine died"), 0.0)
    assert sum("request span not recorded" in r.getMessage() for r in caplog.records) == 3
