"""An aborted generation's prompt tokens, counted as vLLM counts them: once its prefill ran, streamed or not (a
non-streamed request's engine stream showed nothing before its end, so its prompt was never counted), and not at
all while it waits in the queue. Real HTTP (the app under loopback uvicorn), a real engine over a tiny checkpoint
written by transformers, scraped from the session Ray node's real Prometheus endpoint."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from http_helpers import serve_on_loopback
from test_serve_fixtures import make_tokenizer, write_llama
from test_serving_metrics_review import samples, wait_for

from saguaro_dist import LLM
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.metrics import ServeMetrics

pytest_plugins = ["test_serve_fixtures"]

LONG = 4000  # tokens of generation (ignore_eos): still running when the client hangs up
PROMPT = list(range(4, 15))  # 11 tokens: a count no other request of these tests has
RAY_REPORT_S = 1.0  # the tests' Ray metrics export period (conftest)


@pytest.fixture(scope="module")
def one_slot_llm(tmp_path_factory):
    """An ar engine with one batch slot (a second request waits in the queue), context enough for LONG tokens."""
    path = write_llama(tmp_path_factory.mktemp("abort_prefill"), make_tokenizer(), hidden=32, layers=1, seed=5,
                       max_positions=LONG + 256)
    with LLM(model=path, mode="ar", max_model_len=LONG + 256, max_batch_size=1) as engine:
        yield engine


def body(stream: bool) -> dict:
    return {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": stream}


def open_request(base: str, payload: dict) -> socket.socket:
    """A completion request sent over a raw socket, left open (closing the socket hangs up)."""
    host, port = base.removeprefix("http://").removesuffix("/v1").split(":")
    data = json.dumps(payload).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head + data)
    return sock


def wait_until(ready, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def prefilled(llm) -> bool:
    """The running request's prompt is in the KV (its prefill ran, with its first token)."""
    return llm.load.num_running == 1 and llm.load.kv_cache_tokens >= len(PROMPT)


def settle(*apps) -> None:
    """Until the apps' generations ended (their aborts recorded)."""
    wait_until(lambda: not any(app.state.saguaro.running for app in apps))


def aborts_and_prompt_tokens(url: str, model: str) -> tuple[float, float]:
    """(aborted requests, prompt tokens) once the abort is exported, and one more export after it."""
    found = wait_for(url, "saguaro_request_success_total", model, bool)
    time.sleep(2 * RAY_REPORT_S)  # the prompt tokens, counted beside it, have been exported too (or never will)
    aborted = sum(s.value for s in found if s.labels["finished_reason"] == "abort")
    return aborted, sum(s.value for s in samples(url, "saguaro_prompt_tokens_total", model))


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_a_request_aborted_after_its_prefill_counts_its_prompt(metrics_url, one_slot_llm, stream):
    """The client hangs up while its request generates: one abort, and its prompt tokens (vLLM counts a request's
    prompt once its prefill ran). A non-streamed request's counted none: nothing told the server its prefill ran."""
    model = f"abort-prefill-after-{'stream' if stream else 'whole'}"
    metrics, first_delta_seen = ServeMetrics(model), threading.Event()
    count_first_token = metrics.first_token

    def first_token(seconds: float) -> None:  # the server's loop took the first delta (the prefill ran)
        count_first_token(seconds)
        first_delta_seen.set()
    metrics.first_token = first_token
    app = create_app(one_slot_llm, ServerOptions(model), metrics)
    with serve_on_loopback(app) as base:
        with open_request(base, body(stream)):
            wait_until(lambda: prefilled(one_slot_llm))
            assert first_delta_seen.wait(30)  # (a loaded box can hold the delta back for seconds)
        settle(app)
    assert aborts_and_prompt_tokens(metrics_url, model) == (1, len(PROMPT))


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_a_request_aborted_in_the_queue_counts_no_prompt(metrics_url, one_slot_llm, stream):
    """The only batch slot is taken: a request waits in the engine's queue, unprefilled, when its client hangs up.
    Its abort counts, its prompt does not; the request that held the slot (then aborted too) counts its own."""
    holder, queued = (f"abort-prefill-{name}-{'stream' if stream else 'whole'}" for name in ("holder", "queued"))
    holder_app, queued_app = (create_app(one_slot_llm, ServerOptions(m), ServeMetrics(m)) for m in (holder, queued))
    with serve_on_loopback(holder_app) as holder_base, serve_on_loopback(queued_app) as queued_base:
        with open_request(holder_base, body(stream)):
            wait_until(lambda: prefilled(one_slot_llm))
            with open_request(queued_base, body(stream)):
                wait_until(lambda: one_slot_llm.load.num_waiting == 1)
            settle(queued_app)
            assert one_slot_llm.load.num_running == 1  # the holder ran throughout: the queued one never prefilled
        settle(holder_app)
    assert aborts_and_prompt_tokens(metrics_url, queued) == (1, 0)
    assert aborts_and_prompt_tokens(metrics_url, holder) == (1, len(PROMPT))
