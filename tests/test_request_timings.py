"""vLLM's request phases, on the engine's clock: arrival -> first scheduled (time_in_queue_s) -> first token
(prefill_time_s) -> last token (decode_time_s; inference_time_s: prefill and decode). In each request's
RequestMetrics (offline and over Ray), and as vLLM's request phase histograms in the served Prometheus metrics.
Real engines over a tiny checkpoint written by transformers; the metrics over real HTTP, scraped from the session
Ray node's real Prometheus endpoint. Ordering facts only: one batch slot makes the second request wait for the
first's whole run. (The span attributes: tests/test_serve_tracing.py.)"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from http_helpers import serve_on_loopback
from test_serve_fixtures import make_tokenizer, write_llama
from test_serving_metrics_review import samples, wait_for

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.engine.metrics import RequestMetrics
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.metrics import ServeMetrics

pytest_plugins = ["test_serve_fixtures"]

PROMPTS = ["the cat sat on the mat", "a dog ran in the park"]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PHASES = ("queue", "prefill", "decode", "inference")
VLLM_PHASE_MAX_S = 7680.0  # vLLM's REQUEST_LATENCY_BUCKETS' largest (vllm/v1/metrics/buckets.py)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_llama(tmp_path_factory.mktemp("timings"), make_tokenizer(), hidden=32, layers=1, seed=5)


@pytest.fixture(scope="module")
def one_slot_llm(checkpoint):
    """An ar engine with one batch slot: of two requests submitted together, the second waits in the queue."""
    with LLM(model=checkpoint, mode="ar", max_model_len=256, max_batch_size=1) as llm:
        yield llm


def check_phases(m: RequestMetrics) -> None:
    """A finished request's phases add up (float rounding aside): queue + prefill is its time to first token."""
    assert m.scheduled and m.first_scheduled_time > 0
    assert m.time_in_queue_s >= 0 and m.prefill_time_s > 0 and m.decode_time_s > 0
    assert m.time_in_queue_s + m.prefill_time_s == pytest.approx(m.time_to_first_token_s)
    assert m.inference_time_s == pytest.approx(m.prefill_time_s + m.decode_time_s)
    assert m.time_in_queue_s + m.inference_time_s == pytest.approx(m.total_time_s)


def check_second_waited_for_the_first(first: RequestMetrics, second: RequestMetrics) -> None:
    """Both arrived before the first was scheduled; the second was scheduled after the first finished."""
    for m in (first, second):
        check_phases(m)
    assert first.time_in_queue_s <= second.time_in_queue_s
    assert second.time_in_queue_s >= first.inference_time_s


def test_a_queued_request_waits_for_the_whole_run_ahead_of_it(one_slot_llm):
    first, second = (out.metrics for out in one_slot_llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    check_second_waited_for_the_first(first, second)
    assert first.to_dict()["inference_time_s"] == first.inference_time_s


def test_only_the_first_scheduling_ends_the_queue():
    """A chunked prompt's later chunks are its prefill (vLLM counts the first SCHEDULED event alone)."""
    m = RequestMetrics()
    assert not m.scheduled and m.decode_time_s == m.inference_time_s == 0.0
    m.record_scheduled(0.5)
    m.record_scheduled(0.9)  # its next chunk
    m.record_first_token(2.0)
    m.total_time_s = 3.5
    assert (m.time_in_queue_s, m.prefill_time_s, m.decode_time_s, m.inference_time_s) == (0.5, 1.5, 1.5, 3.0)


@pytest.mark.slow
def test_the_times_cross_from_rank_0_to_the_driver(ray_cluster, checkpoint):
    """On Ray the engine runs in rank 0's actor: its RequestMetrics reach the driver's RequestOutput whole."""
    with LLM(model=checkpoint, mode="ar", max_model_len=256, max_batch_size=1, cluster="auto") as llm:
        first, second = (out.metrics for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    check_second_waited_for_the_first(first, second)


def phase_samples(url: str, model: str, suffix: str, ready) -> dict[str, list]:
    return {phase: wait_for(url, f"saguaro_request_{phase}_time_seconds_{suffix}", model, ready) for phase in PHASES}


@pytest.mark.slow
def test_the_phase_histograms_count_every_finished_request(metrics_url, one_slot_llm):
    model = "request-timings"
    app = create_app(one_slot_llm, ServerOptions(model), ServeMetrics(model))
    body = {"model": model, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with serve_on_loopback(app) as url, ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda p: httpx.post(f"{url}/completions", json={**body, "prompt": p}, timeout=60),
                                PROMPTS))
    assert [r.status_code for r in replies] == [200, 200]
    total = lambda found: sum(s.value for s in found)  # noqa: E731 - over every series (each process its own)
    counts = phase_samples(metrics_url, model, "count", lambda found: total(found) >= len(PROMPTS))
    assert {phase: total(found) for phase, found in counts.items()} == dict.fromkeys(PHASES, len(PROMPTS))
    assert total(samples(metrics_url, "saguaro_e2e_request_latency_seconds_count", model)) == len(PROMPTS)
    for phase, found in phase_samples(metrics_url, model, "bucket", bool).items():
        finite = {float(s.labels["le"]) for s in found} - {float("inf")}
        assert max(finite) == VLLM_PHASE_MAX_S, (phase, sorted(finite))
