"""The Serve app's Prometheus metrics, scraped from the session Ray node's real endpoint."""
from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest_plugins = ["test_serve_fixtures"]

PREFIX = "ray_saguaro_"  # Ray prefixes every application metric with ray_


def scrape(url: str) -> dict[str, float]:
    """Every sample of ours summed over its series (each worker reports its own): name -> value."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name.startswith(PREFIX) and "le" not in sample.labels:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def scrape_settled(url: str) -> dict[str, float]:
    """Once what earlier tests did has all been reported: two scrapes a report interval apart agree."""
    deadline, last = time.monotonic() + 30, scrape(url)
    while time.monotonic() < deadline:
        time.sleep(1.5)
        now = scrape(url)
        if now == last:
            break
        last = now
    return last


def scrape_after(url: str, before: dict[str, float], settled) -> dict[str, float]:
    """Scrapes until settled(delta) holds (Ray reports every second here); the last delta otherwise."""
    deadline = time.monotonic() + 30
    while True:
        now = scrape(url)
        delta = {k: now.get(k, 0.0) - before.get(k, 0.0) for k in now}
        if settled(delta) or time.monotonic() > deadline:
            return delta
        time.sleep(0.5)


def metric(delta: dict[str, float], name: str) -> float:
    return delta.get(PREFIX + name, 0.0)


@pytest.fixture(scope="module")
def metrics_url(ray_cluster, server) -> str:
    if ray_cluster is None:
        pytest.skip("Ray was started outside the tests: its metrics port is unknown")
    return ray_cluster


def post(server, body: dict) -> httpx.Response:
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=60)
    r.raise_for_status()
    return r


@pytest.mark.parametrize("stream", [False, True], ids=["in-one-piece", "streamed"])
def test_a_request_is_counted_in_every_metric(server, metrics_url, stream):
    before = scrape_settled(metrics_url)
    body = {"prompt": "the cat sat on", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
    post(server, body)
    delta = scrape_after(metrics_url, before, lambda d: metric(d, "e2e_request_latency_seconds_count") >= 1
                         and metric(d, "requests_total") >= 1)
    assert metric(delta, "requests_total") == 1
    assert metric(delta, "e2e_request_latency_seconds_count") == 1
    assert metric(delta, "request_success_total") == 1  # finished_reason "length" (vLLM's request_success)
    assert metric(delta, "time_to_first_token_seconds_count") == 1
    assert metric(delta, "generation_tokens_total") == 12
    assert metric(delta, "inter_token_latency_seconds_count") == 11  # one per token after the first
    assert metric(delta, "prompt_tokens_total") >= 1
    assert metric(delta, "drafted_tokens_total") >= metric(delta, "accepted_tokens_total")
    lookups = metric(delta, "speculation_cache_hits_total") + metric(delta, "speculation_cache_misses_total")
    assert lookups >= 1  # a tree every round on this server: every round after the first looks one up
    # The engine's clock when no reader saw the first token (a request answered in one piece).
    assert metric(delta, "time_to_first_token_seconds_sum") < metric(delta, "e2e_request_latency_seconds_sum")


def gauges(url: str, model: str) -> dict[str, float]:
    """This app's engine gauges: name -> value (every replica's, summed)."""
    names = {PREFIX + n for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                                  "draft_workers_live", "draft_workers")}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name in names and sample.labels.get("model") == model:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def test_the_engine_gauges_are_exported_and_idle_after_the_work(server, metrics_url):
    """vLLM's scheduler gauges (running, waiting, KV cache usage) from the engine's own load, refreshed by
    the replica every second; once the requests are done they read an idle engine. The round loop's time
    split grows with the work, its parts within the whole."""
    before = scrape_settled(metrics_url)
    post(server, {"prompt": "the cat sat on", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    # Settled: the counters are read live, each one as the engine adds to it, so a report made while a step
    # ran counts that step's verify or draft wait but not yet the step's whole time (seen once in CI).
    now = scrape_settled(metrics_url)
    delta = {k: now.get(k, 0.0) - before.get(k, 0.0) for k in now}
    assert metric(delta, "rounds_total") >= 1 and metric(delta, "verify_seconds_total") > 0
    parts = sum(metric(delta, f"{name}_seconds_total") for name in ("verify", "draft_wait", "prefill"))
    assert metric(delta, "round_seconds_total") >= parts * 0.999  # coordination: the rest of the step
    deadline, found = time.monotonic() + 30, {}
    idle = {PREFIX + "num_requests_running": 0.0, PREFIX + "num_requests_waiting": 0.0, PREFIX + "kv_cache_usage_perc": 0.0,
            PREFIX + "draft_workers_live": 1.0, PREFIX + "draft_workers": 1.0}  # ssd: one draft, alive
    while time.monotonic() < deadline and found != idle:
        time.sleep(0.5)
        found = gauges(metrics_url, server.model)
    assert found == idle
