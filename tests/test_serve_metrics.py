"""The Serve app's Prometheus metrics, scraped from the session Ray node's real endpoint."""
from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from saguaro_dist.engine.metrics import EngineMetrics, PositionCounts
from saguaro_dist.serve.metrics import ServeMetrics

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


def replica_idle() -> bool:
    from test_serve_fixtures import app_stats

    stats = app_stats()
    return stats["running"] == 0 and stats["engine"]["num_running"] == 0 and stats["engine"]["num_waiting"] == 0


def scrape_settled(url: str) -> dict[str, float]:
    """Once what earlier tests did has all been reported: the replica idle (no generation left to count), then
    the scrapes unchanged for 2.5 s. A count passes the replica's 1 s reporter, then Ray's 1 s export: two
    scrapes 1.5 s apart could agree with a report still to come (its count then taken for the test's own)."""
    deadline = time.monotonic() + 30
    while not replica_idle() and time.monotonic() < deadline:
        time.sleep(0.1)
    last = scrape(url)
    unchanged_since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - unchanged_since < 2.5:
        time.sleep(0.5)
        now = scrape(url)
        if now != last:
            last, unchanged_since = now, time.monotonic()
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
    # (drafts and tree lookups: engine-wide counters, reported within a second of their growth)
    delta = scrape_after(metrics_url, before, lambda d: metric(d, "e2e_request_latency_seconds_count") >= 1
                         and metric(d, "requests_total") >= 1 and metric(d, "e2e_request_latency_seconds_exact_sum_total")
                         > 0 and metric(d, "speculation_cache_misses_total")
                         + metric(d, "speculation_cache_hits_total") >= 1 and metric(d, "spec_decode_num_drafts_total") >= 1)
    assert metric(delta, "requests_total") == 1
    assert metric(delta, "e2e_request_latency_seconds_count") == 1
    assert metric(delta, "request_success_total") == 1  # finished_reason "length" (vLLM's request_success)
    assert metric(delta, "time_to_first_token_seconds_count") == 1
    assert metric(delta, "generation_tokens_total") == 12
    assert metric(delta, "inter_token_latency_seconds_count") == 11  # one per token after the first
    assert metric(delta, "prompt_tokens_total") >= 1
    assert metric(delta, "spec_decode_num_draft_tokens_total") >= metric(delta, "spec_decode_num_accepted_tokens_total")
    lookups = metric(delta, "speculation_cache_hits_total") + metric(delta, "speculation_cache_misses_total")
    # vLLM's num_drafts (mean acceptance length 1 + accepted / drafts): K = 2 tokens at most per speculation;
    # the per-position counts (summed over positions) are the accepted tokens, each at its one position
    drafts = metric(delta, "spec_decode_num_drafts_total")
    assert drafts <= metric(delta, "spec_decode_num_draft_tokens_total") <= 2 * drafts
    assert metric(delta, "spec_decode_num_accepted_tokens_per_pos_total") == metric(
        delta, "spec_decode_num_accepted_tokens_total")
    assert lookups >= 1  # a tree every round on this server: every round after the first looks one up
    # engine-wide, as the misses (one fallback per miss at most; counted once, not also as the request ends)
    assert metric(delta, "fallbacks_total") <= metric(delta, "speculation_cache_misses_total")
    # The engine's clock when no reader saw the first token (a request answered in one piece).
    # (the exact sums: Ray's `_sum` is rebuilt from bucket midpoints, and both fell in one bucket by chance)
    assert 0 < metric(delta, "time_to_first_token_seconds_exact_sum_total") < metric(
        delta, "e2e_request_latency_seconds_exact_sum_total")


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


def series(url: str, name: str, model: str, keys=("position",)) -> dict[tuple, float]:
    """One metric's samples for this model: its labels among `keys` -> value, each process's summed."""
    found: dict[tuple, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            if s.name == PREFIX + name and s.labels.get("model") == model:
                key = tuple(sorted((k, v) for k, v in s.labels.items() if k in keys))
                found[key] = found.get(key, 0.0) + s.value
    return found


def scrape_until(url: str, name: str, model: str, ready) -> dict[tuple, float]:
    deadline = time.monotonic() + 30
    while not ready(found := series(url, name, model)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def test_histogram_means_are_exact_and_positions_count_from_zero(metrics_url):
    """Ray rebuilds a histogram's _sum from bucket midpoints (+Inf as twice the last boundary): 0.26 s and
    9000 s of end-to-end latency read 15360 s. The exact_sum counter beside it holds what was observed. Draft
    positions are labelled from 0, as vLLM's spec_decode_num_accepted_tokens_per_pos."""
    from saguaro_dist.engine.metrics import RequestMetrics

    model = "fmet-exact-sums"
    metrics = ServeMetrics(model)  # in this process: a Ray driver, exported by the session node
    metrics.finished(RequestMetrics(num_prompt_tokens=4, accepted_per_position=[3, 1]), 0.25, "stop")
    metrics.engine_times({"accepted_per_position": PositionCounts((5, 2))})  # (the engine's; not finished's)
    metrics.finished(None, 9000.0, "stop")
    metrics.first_token(0.5)
    exact = scrape_until(metrics_url, "e2e_request_latency_seconds_exact_sum_total", model, bool)
    assert sum(exact.values()) == pytest.approx(9000.25)
    assert sum(series(metrics_url, "time_to_first_token_seconds_exact_sum_total", model).values()) == 0.5
    positions = scrape_until(metrics_url, "spec_decode_num_accepted_tokens_per_pos_total", model, bool)
    assert positions == {(("position", "0"),): 5.0, (("position", "1"),): 2.0}


def test_prometheus_metrics_are_served_on_the_api_port(server):
    """vLLM serves GET /metrics beside its API; Ray's export port was random and logged nowhere (404 here).
    The replica answers with its node's Ray export: this app's series among them, without the API key."""
    deadline, text = time.monotonic() + 30, ""
    while time.monotonic() < deadline and f'model="{server.model}"' not in text:
        r = httpx.get(server.url + "/metrics", timeout=30)  # no API key: open to scrapers, as vLLM's
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
        time.sleep(0.5)
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples
             if s.labels.get("model") == server.model}
    assert {PREFIX + "num_requests_running", PREFIX + "draft_workers"} <= names


def test_scrapes_and_probes_are_not_counted_as_requests(server, metrics_url):
    """Prometheus's scrapes of GET /metrics were counted in requests_total (route "other"), and the probes of
    /health and /version too; vLLM leaves them out. A counted request after them: once it is reported, so would
    they be (Ray reports every counter at once)."""
    before = scrape_settled(metrics_url)
    for path in ("/metrics", "/metrics", "/health", "/version"):
        assert httpx.get(server.url + path, headers=server.headers, timeout=30).status_code == 200
    httpx.get(server.url + "/v1/models", headers=server.headers, timeout=30).raise_for_status()
    scrape_after(metrics_url, before, lambda d: metric(d, "requests_total") >= 1)
    now = scrape_settled(metrics_url)
    assert now.get(PREFIX + "requests_total", 0.0) - before.get(PREFIX + "requests_total", 0.0) == 1


def replica_log_lines(app_name: str) -> str:
    """Every log file of the app's replicas (Serve's logs/serve/replica_<app>_*.log on this node)."""
    import glob
    import os

    import ray

    folder = os.path.join(ray._private.worker._global_node.get_logs_dir_path(), "serve")
    return "".join(open(p, errors="replace").read() for p in glob.glob(os.path.join(folder, f"replica_{app_name}_*")))


@pytest.mark.slow
def test_the_engines_info_lines_reach_the_replica_log(server):
    """A Ray worker's loggers sit at WARNING with no handler: the replica's INFO lines (its model loading, the
    engine's periodic stats line every log_stats_interval_s, 10 s here) were dropped. Requests until one
    comes: the first already does once the replica has run 10 s."""
    from test_serve_fixtures import APP_NAME

    assert f"loading {server.target} (mode ssd)" in replica_log_lines(APP_NAME)
    deadline = time.monotonic() + 40
    while "Avg prompt throughput" not in replica_log_lines(APP_NAME) and time.monotonic() < deadline:
        post(server, {"prompt": "the cat sat on", "max_tokens": 8, "temperature": 0})
    assert "Avg prompt throughput" in replica_log_lines(APP_NAME)


def test_the_engine_counts_drafts_and_accepted_positions_per_row():
    """vLLM's spec_decode_num_drafts and num_accepted_tokens_per_pos, counted where the engine verifies (aborted
    requests' rounds too); a row with nothing drafted is no draft. The reporter's delta is per position."""
    m = EngineMetrics()
    for drafted, accepted in ((3, 0), (3, 2), (0, 0), (3, 3), (2, 2)):
        m.record_draft(drafted, accepted)
    assert (m.drafts, m.drafted_tokens, m.accepted_tokens) == (4, 11, 7)
    earlier = m.accepted_per_position
    assert earlier == (3, 3, 1) and sum(earlier) == m.accepted_tokens
    m.record_draft(4, 4)
    assert m.accepted_per_position - earlier == (1, 1, 1, 1)
    assert earlier == (3, 3, 1)  # a snapshot, not the live counts


def test_the_engines_fallbacks_are_reported_by_their_growth_per_kind():
    """saguaro_fallbacks came from finished requests alone (an aborted one's never, though its misses counted):
    the reporter reads the engine-wide counts now, as a snapshot whose difference is the growth by kind."""
    m = EngineMetrics()
    m.fallbacks["neural"] += 2
    earlier = m.fallback_counts
    m.fallbacks["neural"] += 3
    m.fallbacks["fast"] += 1
    assert m.fallback_counts - earlier == {"neural": 3, "fast": 1}
    assert earlier == {"neural": 2}  # a snapshot, not the live counts
