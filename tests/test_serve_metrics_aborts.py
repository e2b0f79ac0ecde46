"""Serving metrics a scrape missed: aborted generations (vLLM's request_success{finished_reason="abort"}), the engine
gauges of a replica that has served nothing yet, and gauges that froze after one failed read. Real HTTP (the app under
loopback uvicorn, or a Ray Serve replica), real engines over tiny checkpoints, scraped from the session Ray node's
real Prometheus endpoint."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from http_helpers import serve_on_loopback
from test_serve_fixtures import make_tokenizer, write_llama
from test_serving_metrics_review import samples, wait_for

from saguaro_dist import LLM
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.metrics import ServeMetrics

pytest_plugins = ["test_serve_fixtures"]

LONG = 4000  # seconds of generation on the CI box (ignore_eos): still running when the client hangs up
PROMPT = [4, 5, 6]
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "draft_workers_live", "draft_workers")


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory) -> str:
    """A one-layer Llama with a context long enough for LONG tokens."""
    return write_llama(tmp_path_factory.mktemp("h11_long"), make_tokenizer(), hidden=32, layers=1, seed=3,
                       max_positions=LONG + 256)


@pytest.fixture(scope="module")
def long_llm(long_checkpoint):
    """An ar engine over long_checkpoint."""
    with LLM(model=long_checkpoint, mode="ar", max_model_len=LONG + 256, max_batch_size=2) as engine:
        yield engine


def total(url: str, name: str, model: str, **labels) -> float:
    return sum(s.value for s in samples(url, name, model) if all(s.labels.get(k) == v for k, v in labels.items()))


def hang_up_after_first_chunk(base: str, body: dict, chunks: int = 1) -> None:
    """A streamed request read until its first delta (or `chunks` of them), then the connection closed."""
    with httpx.Client(timeout=60) as client, client.stream("POST", base + "/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            chunks -= line.startswith("data: {")
            if chunks <= 0:
                return


def hang_up_while_generating(base: str, llm, body: dict) -> None:
    """A non-streamed request sent over a raw socket, closed once the engine generates for it."""
    host, port = base.removeprefix("http://").removesuffix("/v1").split(":")
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + payload)
        deadline = time.monotonic() + 30
        while llm.load.num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "in-one-piece"])
def test_an_aborted_generation_is_counted_as_vllm_counts_it(metrics_url, long_llm, stream):
    """The client goes away part-way: request_success{finished_reason="abort"} (its help text promised it), an
    end-to-end latency sample, and (its prefill ran) its prompt tokens, streamed or not. None were counted."""
    model = f"h11-abort-{'stream' if stream else 'whole'}"
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": stream}
    app = create_app(long_llm, ServerOptions(model), ServeMetrics(model))
    with serve_on_loopback(app) as base:
        if stream:
            hang_up_after_first_chunk(base, body)
        else:
            hang_up_while_generating(base, long_llm, body)
        deadline = time.monotonic() + 30
        while app.state.saguaro.running and time.monotonic() < deadline:
            time.sleep(0.05)
    found = wait_for(metrics_url, "saguaro_request_success_total", model, bool)
    assert {(s.labels["finished_reason"], s.value) for s in found} == {("abort", 1.0)}
    e2e = wait_for(metrics_url, "saguaro_e2e_request_latency_seconds_count", model, bool)
    assert sum(s.value for s in e2e) == 1
    prompt = wait_for(metrics_url, "saguaro_prompt_tokens_total", model, bool, timeout_s=30)
    assert sum(s.value for s in prompt) == len(PROMPT)  # in one piece too: its first delta showed the prefill ran


def test_the_gauges_survive_a_failed_read(metrics_url, serving_pair):
    """A failed read of the engine's load ended the reporter task silently: the gauges never came (or froze).
    Now it is logged and the next report, a second later, sets them."""
    model = "h11-flaky-load"
    llm = LLM(model=serving_pair[0], mode="ar", max_model_len=256)
    try:
        with serve_on_loopback(create_app(LoadFailsOnce(llm), ServerOptions(model), ServeMetrics(model))) as base:
            r = httpx.post(base + "/completions", json={"prompt": "the cat", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200  # (plain uvicorn: the reporter starts with the first request)
            # (a report taken while the request ran exports 1.0: the idle engine's comes a second later)
            found = wait_for(metrics_url, "saguaro_num_requests_running", model,
                             lambda found: [s.value for s in found] == [0.0])
    finally:
        llm.shutdown()
    assert [s.value for s in found] == [0.0]


class LoadFailsOnce:
    """A real engine whose first read of its load fails (fault injection; everything else is the engine's)."""

    def __init__(self, llm):
        self._llm, self._failed = llm, False

    def __getattr__(self, name):
        return getattr(self._llm, name)

    @property
    def load(self):
        if not self._failed:
            self._failed = True
            raise RuntimeError("load unavailable")
        return self._llm.load


@pytest.mark.slow
def test_an_idle_replica_exports_its_engine_gauges(metrics_url, server, serving_pair):
    """A Ray Serve replica that has served nothing yet: its gauges came only with its first request (the
    reporter started there), so a fresh replica read as no data to dashboards and autoscalers."""
    from ray import serve

    from saguaro_dist.serve.app import build_deployment

    model, name = "h11-idle", "h11-idle"  # a second app beside the session's (`server` started Serve)
    args = {"model": serving_pair[0], "mode": "ar", "max_model_len": 256, "max_batch_size": 2, "served_model_name": model}
    # build_app's deployment, its drain check every 0.1 s (Serve's 2 s was waited out by serve.delete, nothing to drain)
    serve.run(build_deployment(args, graceful_shutdown_wait_loop_s=0.1), name=name, route_prefix="/" + name)
    try:
        found = wait_for(metrics_url, "saguaro_draft_workers", model, bool)
        gauges = {g: total(metrics_url, f"saguaro_{g}", model) for g in GAUGES}
    finally:
        serve.delete(name)
    assert found and gauges == dict.fromkeys(GAUGES, 0.0)  # ar: no drafts; nothing running


@pytest.mark.slow
def test_an_aborted_generation_counts_its_drafts_and_prefix_cache_lookups(metrics_url, reference_llm):
    """Drafted and accepted tokens, tree lookups, fallbacks and prefix-cache tokens counted only as a request
    finished: an aborted one's never (vLLM counts them per engine step), so its misses (engine-wide) counted
    but the fallbacks they took did not. They come from the engine's own counters now, prefix_cache_queries
    (vLLM's) among them, and vLLM's num_drafts."""
    model = "fmet-abort-drafts"
    prompt = "the cat sat on the mat"
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}
    app = create_app(reference_llm, ServerOptions(model), ServeMetrics(model))
    fallbacks_before = reference_llm.metrics.fallback_counts
    with serve_on_loopback(app) as base:
        hang_up_after_first_chunk(base, body, chunks=4)
        wait_until_idle(app, reference_llm)
        fallbacks = sum((reference_llm.metrics.fallback_counts - fallbacks_before).values())
        reported = wait_for(metrics_url, "saguaro_fallbacks_total", model,
                            lambda found: sum(s.value for s in found) >= fallbacks)
        drafted = wait_for(metrics_url, "saguaro_spec_decode_num_draft_tokens_total", model, bool)
        drafts = wait_for(metrics_url, "saguaro_spec_decode_num_drafts_total", model, bool)
        queries = wait_for(metrics_url, "saguaro_prefix_cache_queries_total", model, bool)
        ended = wait_for(metrics_url, "saguaro_request_success_total", model, bool)
    assert {s.labels["finished_reason"] for s in ended} == {"abort"}  # (it did not run to its end)
    assert sum(s.value for s in drafted) >= sum(s.value for s in drafts) > 0
    prompt_tokens = wait_for(metrics_url, "saguaro_prompt_tokens_total", model, bool)
    assert sum(s.value for s in queries) == sum(s.value for s in prompt_tokens) > 0  # (no prefix cache here)
    assert sum(s.value for s in reported) == fallbacks > 0  # fallback "neural": its tiny draft's trees miss


def wait_until_idle(app, llm) -> None:
    """Until the aborted generation has left the app and the engine (its rounds all counted)."""
    deadline = time.monotonic() + 30
    while (app.state.saguaro.running or llm.load.num_running) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_every_draft_positions_series_is_there_from_the_start(metrics_url, reference_llm):
    """vLLM makes its accepted-tokens-per-position series for positions 0..k-1 at start-up: here they came
    with the first acceptance at each, so a position nothing was accepted at read no data, not a rate of 0."""
    model = "fmet-positions-at-zero"
    create_app(reference_llm, ServerOptions(model), ServeMetrics(model))  # k = 2; nothing served
    found = wait_for(metrics_url, "saguaro_spec_decode_num_accepted_tokens_per_pos_total", model,
                     lambda found: len(found) >= 2)
    assert sorted((s.labels["position"], s.value) for s in found) == [("0", 0.0), ("1", 0.0)]


@pytest.mark.slow
def test_an_aborted_generations_accepted_positions_are_counted(metrics_url, long_checkpoint):
    """Accepted tokens per draft position came only from finished requests: an aborted one's never (vLLM counts
    them per engine step). Prompt lookup (ngram) accepts from the first round on a prompt of the greedy run's
    own output, which repeats itself; the positions, from 0 as vLLM's, sum to the accepted tokens."""
    from saguaro_dist import SamplingParams

    model = "fmet-abort-positions"
    with LLM(model=long_checkpoint, mode="ngram", k=2, max_model_len=LONG + 256, max_batch_size=2) as llm:
        greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        prompt = PROMPT + list(llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy)[0].outputs[0].token_ids)
        body = {"prompt": prompt, "max_tokens": LONG, "ignore_eos": True, "stream": True, "temperature": 0}
        app = create_app(llm, ServerOptions(model), ServeMetrics(model))
        with serve_on_loopback(app) as base:
            hang_up_after_first_chunk(base, body, chunks=3)
            ended = wait_for(metrics_url, "saguaro_request_success_total", model, bool)
            accepted = wait_for(metrics_url, "saguaro_spec_decode_num_accepted_tokens_total", model, bool)
            positions = wait_for(metrics_url, "saguaro_spec_decode_num_accepted_tokens_per_pos_total", model,
                                 lambda found: sum(s.value for s in found) >= sum(s.value for s in accepted) > 0)
            drafts = wait_for(metrics_url, "saguaro_spec_decode_num_drafts_total", model, bool)
    assert {s.labels["finished_reason"] for s in ended} == {"abort"}
    assert sum(s.value for s in positions) == sum(s.value for s in accepted) > 0
    assert "0" in {s.labels["position"] for s in positions}
    assert sum(s.value for s in drafts) >= sum(s.value for s in positions if s.labels["position"] == "0")
