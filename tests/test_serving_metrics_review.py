"""The serving app's Prometheus metrics as a scrape sees them, over real HTTP: the app under loopback uvicorn
in this process (a Ray driver once the session's cluster is up, so its Ray metrics reach the node's real
Prometheus endpoint), a real engine over the tiny serving checkpoint."""
from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.metrics import ServeMetrics

pytest_plugins = ["test_serve_fixtures"]

# vLLM's largest finite buckets (vllm/v1/metrics/loggers.py): a request slower than a histogram's largest
# bucket lands in +Inf only, and histogram_quantile then reports that bucket, whatever the request took.
VLLM_E2E_MAX_S, VLLM_TTFT_MAX_S = 7680.0, 2560.0


def samples(url: str, name: str, model: str) -> list:
    """Every sample of `name` (Ray's ray_ prefix added) for this model."""
    found = []
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        found += [s for s in family.samples if s.name == "ray_" + name and s.labels.get("model") == model]
    return found


def wait_for(url: str, name: str, model: str, ready, timeout_s: float = 30) -> list:
    """The samples once ready(samples) holds (Ray reports every second in the tests)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = samples(url, name, model)
        if ready(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def by_status(found: list) -> dict[str, float]:
    """requests_total per status, over every series (each process reports its own)."""
    totals: dict[str, float] = {}
    for s in found:
        totals[s.labels["status"]] = totals.get(s.labels["status"], 0.0) + s.value
    return totals


def test_an_engine_failure_is_counted_under_the_status_the_client_got(metrics_url, serving_pair):
    """A request the dead engine fails is answered 503 (retriable); requests_total counted it as a 500,
    because the catch-all handler answers outside the counting middleware."""
    model = "h8-dead-engine"
    llm = LLM(model=serving_pair[0], mode="ar", max_model_len=256)
    with serve_on_loopback(create_app(llm, ServerOptions(model), ServeMetrics(model))) as url:
        llm.shutdown()
        r = httpx.post(url + "/completions", json={"prompt": "the cat", "max_tokens": 2}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    found = wait_for(metrics_url, "saguaro_requests_total", model, lambda f: bool(by_status(f)))
    assert by_status(found) == {"503": 1.0}


def test_latency_histograms_reach_as_far_as_vllms(metrics_url, reference_llm):
    """A generation of minutes (long outputs, a CPU engine, a queue) still lands in a finite bucket of the
    e2e and time-to-first-token histograms: their buckets went no further than 40 s."""
    model = "h8-buckets"
    with serve_on_loopback(create_app(reference_llm, ServerOptions(model), ServeMetrics(model))) as url:
        r = httpx.post(url + "/completions", json={"prompt": "the cat", "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200
    for name, reach in (("e2e_request_latency_seconds", VLLM_E2E_MAX_S),
                        ("time_to_first_token_seconds", VLLM_TTFT_MAX_S)):
        found = wait_for(metrics_url, f"saguaro_{name}_bucket", model, bool)
        finite = {float(s.labels["le"]) for s in found} - {float("inf")}
        assert max(finite) >= reach, (name, sorted(finite))
        count = wait_for(metrics_url, f"saguaro_{name}_count", model, bool)
        assert sum(s.value for s in count) == 1
