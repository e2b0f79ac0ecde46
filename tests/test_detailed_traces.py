"""vLLM's --collect-detailed-traces (model / worker / all, or its legacy comma-separated text): each span gains
the per-request counts its modules name (model: the target's rounds and acceptance per draft position; worker: the
draft workers' tree-cache lookups and fallbacks), at a real OTLP collector over gRPC; left out, the span is as
before; without --otlp-traces-endpoint, or with a module vLLM does not know, it is refused at start-up. Real HTTP,
a real engine over tiny checkpoints (the fixtures of test_serve_tracing)."""
from __future__ import annotations

import json

import pytest

from http_helpers import serve_on_loopback
from saguaro_dist.cli import main
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.app import server_options
from saguaro_dist.serve.tracing import DetailedTraces
from test_serve_tracing import complete, exported, grpc_collector, llm  # noqa: F401 - fixtures

MODEL_KEYS = {"saguaro.spec_decode.num_rounds", "saguaro.spec_decode.mean_accepted_length",
              "saguaro.spec_decode.accepted_per_position"}
WORKER_KEYS = {"saguaro.spec_decode.tree_cache_hits", "saguaro.spec_decode.tree_cache_misses",
               "saguaro.spec_decode.fallbacks"}


def span_attributes(span) -> dict:
    """The span's attributes; an array's as a list."""
    out = {}
    for kv in span.attributes:
        value = getattr(kv.value, kv.value.WhichOneof("value"))
        out[kv.key] = [v.int_value for v in value.values] if kv.value.HasField("array_value") else value
    return out


def traced_span(llm, grpc_collector, request_id: str, **options) -> dict:  # noqa: F811
    collector, endpoint = grpc_collector
    app = create_app(llm, ServerOptions("m", otlp_traces_endpoint=endpoint, **options))
    with serve_on_loopback(app) as url:
        complete(url, request_id, max_tokens=8)
        (span,) = exported(app, collector, request_id)
    return span_attributes(span)


@pytest.mark.parametrize("name, modules, keys", [
    ("model", ["model"], MODEL_KEYS), ("worker", ["worker"], WORKER_KEYS), ("all", ["all"], MODEL_KEYS | WORKER_KEYS),
    ("legacy", "model,worker", MODEL_KEYS | WORKER_KEYS), ("none", None, set()),
])
def test_the_modules_asked_for_add_their_attributes(llm, grpc_collector, name, modules, keys):  # noqa: F811
    got = traced_span(llm, grpc_collector, f"detailed-{name}", collect_detailed_traces=modules)
    assert (MODEL_KEYS | WORKER_KEYS) & set(got) == keys
    assert got["gen_ai.usage.completion_tokens"] == 8  # the usual attributes are all still there


def test_the_detailed_counts_agree_with_the_span(llm, grpc_collector):  # noqa: F811
    got = traced_span(llm, grpc_collector, "detailed-counts", collect_detailed_traces=["all"])
    rounds, accepted = got["saguaro.spec_decode.num_rounds"], got["saguaro.spec_decode.num_accepted_tokens"]
    assert rounds > 0
    assert got["saguaro.spec_decode.mean_accepted_length"] == pytest.approx((accepted + rounds) / rounds)
    per_position = got["saguaro.spec_decode.accepted_per_position"]
    assert 0 < len(per_position) <= 3 and sum(per_position) == accepted  # k = 3; each accepted token at a position
    hits, misses = got["saguaro.spec_decode.tree_cache_hits"], got["saguaro.spec_decode.tree_cache_misses"]
    assert (hits, misses) == (0, 0) and got["saguaro.spec_decode.tree_cache_hit_rate"] == 0.0  # sd: no trees
    assert json.loads(got["saguaro.spec_decode.fallbacks"]) == {}


def test_app_args_take_vllms_comma_separated_text():
    options = server_options({"collect_detailed_traces": "model, worker",
                              "otlp_traces_endpoint": "http://127.0.0.1:4317"}, "m")
    assert options.collect_detailed_traces == {DetailedTraces.MODEL, DetailedTraces.WORKER}
    assert server_options({}, "m").collect_detailed_traces == frozenset()


@pytest.mark.parametrize("modules", [["all"], "model", ["worker", "model"]])
def test_refused_without_an_endpoint_as_in_vllm(modules):
    with pytest.raises(ValueError, match=r"collect_detailed_traces requires `--otlp-traces-endpoint` to be set"):
        ServerOptions("m", collect_detailed_traces=modules)


def test_an_unknown_module_is_refused():
    with pytest.raises(ValueError, match=r"'scheduler' is not one of \['model', 'worker', 'all'\]"):
        ServerOptions("m", otlp_traces_endpoint="http://127.0.0.1:4317", collect_detailed_traces=["scheduler"])


def test_serve_flag_without_an_endpoint_exits_before_ray(llm, capsys):  # noqa: F811
    assert main(["serve", llm.config.model, "--collect-detailed-traces", "all"]) == 2
    err = capsys.readouterr().err
    assert "requires `--otlp-traces-endpoint`" in err and "Traceback" not in err, err
