"""`saguaro bench --url` against a real scripted OpenAI-compatible server on loopback that fails some requests, as
vLLM's benchmark_serving meets them: a failed request is counted and left out of the figures, zero successful
requests leave figures of None (not a crash), and a server that fails the whole warm-up refuses the run."""
from __future__ import annotations

import json
import math
import threading
import time

import pytest

from saguaro_dist.bench import BenchConfig
from saguaro_dist.bench.plots import write_plots
from saguaro_dist.bench.remote import RemoteConfig, run_remote
from saguaro_dist.bench.report import render
from saguaro_dist.client import SaguaroError
from scripted_openai import ScriptedServer, Servers

N = 4            # requests a stream
TOKENS = 4       # each streams this many one-token chunks
FIRST_S = 0.2    # before the first chunk
GAP_S = 0.05     # between chunks
GATHER_S = 10.0  # the most a stream waits for the others (see _Server.gather)


class _Server(ScriptedServer):
    """/v1/models, /version, /tokenize, and streamed /v1/completions; `fails(n, seed)` says whether the n-th
    completion (from 1) fails: odd n with a 400, even n with an error event after its first chunk."""
    fails = staticmethod(lambda n, seed: False)
    completions = 0
    streaming = peak = 0  # streams open now, and at most
    gather = 0  # a stream waits (GATHER_S at most) until this many were open at once: on a loaded box the first
    #             streams could end before the last arrive, and the test is of what the client sends, not speed
    lock = threading.Lock()
    opened = threading.Condition(lock)

    def do_POST(self):
        body = self.tokenized()
        if body is None:
            return
        with self.lock:
            type(self).completions += 1
            n = type(self).completions
        if type(self).fails(n, body["seed"]) and n % 2:
            return self.json_reply(400, {"error": {"message": "no such thing", "type": "invalid_request_error"}})
        with self.lock:
            type(self).streaming += 1
            type(self).peak = max(type(self).peak, type(self).streaming)
            self.opened.notify_all()
            self.opened.wait_for(lambda: type(self).peak >= type(self).gather, timeout=GATHER_S)
        try:
            self._stream(fail=type(self).fails(n, body["seed"]))
        finally:
            with self.lock:
                type(self).streaming -= 1

    def _stream(self, fail: bool):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        time.sleep(FIRST_S)
        for i in range(TOKENS):
            self.event({"id": "c", "model": "m", "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})
            if fail:
                return self.event({"error": {"message": "engine died", "code": 503}})
            time.sleep(GAP_S if i < TOKENS - 1 else 0)
        self.event({"id": "c", "model": "m", "choices": [],
                     "usage": {"prompt_tokens": 12, "completion_tokens": TOKENS, "total_tokens": 12 + TOKENS}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def serve():
    """serve(fails) -> the URL of a fresh server failing as `fails(n, seed)` says."""
    servers = Servers()

    def start(fails, gather: int = 0):
        start.handler = type("Server", (_Server,), {"fails": staticmethod(fails), "completions": 0, "streaming": 0,
                                                    "peak": 0, "gather": gather})
        return servers.start(start.handler, queue_size=512)
    yield start
    servers.close()


def run(url: str, tmp_path, n: int = N) -> dict:
    base = BenchConfig(temperatures=(0.0,), max_new_tokens=TOKENS, prompt_len=12, repeats=1, out_dir=str(tmp_path))
    return run_remote(RemoteConfig(url, base, rates=(math.inf,), num_requests=n), progress=False)


def test_failed_requests_are_counted_and_left_out_of_the_figures(serve, tmp_path):
    """Two of four timed requests fail (a 400, an error event mid-stream): the run raised and every cell was lost."""
    url = serve(lambda n, seed: n > N and seed % 2 == 1)  # after the warm-up, the odd seeds
    [cell] = run(url, tmp_path)["cells"]
    assert (cell["requests"], cell["failed_requests"], cell["output_tokens"]) == (2, 2, 2 * TOKENS)
    # The successful requests' own figures, in bounds a stall (which only delays a read) cannot break: every one
    # streamed all its chunks, so none ended before FIRST_S + the gaps; the failed ones (a 400 at once, an error
    # after the first chunk) would pull the mean below that. TPOT is of the same requests: TTFT + TPOT x the
    # tokens after the first is their end-to-end time.
    assert cell["ttft_ms_p50"] >= FIRST_S * 1e3
    assert cell["e2e_ms_mean"] >= (FIRST_S + (TOKENS - 1) * GAP_S) * 1e3
    assert cell["ttft_ms_mean"] + (TOKENS - 1) * cell["tpot_ms_mean"] == pytest.approx(cell["e2e_ms_mean"])
    assert cell["output_tokens_per_s"] == pytest.approx(2 * TOKENS / cell["seconds"])


def test_zero_successful_requests_leave_figures_of_none(serve, tmp_path):
    """Every timed request fails after a good warm-up: the cell says so, with no latencies, and still renders."""
    url = serve(lambda n, seed: n > N)
    results = run(url, tmp_path)
    [cell] = results["cells"]
    assert (cell["requests"], cell["failed_requests"], cell["output_tokens"], cell["output_tokens_per_s"]) == (0, N, 0, 0)
    assert cell["ttft_ms_p50"] is None and cell["tpot_ms_p99"] is None and cell["e2e_ms_mean"] is None
    assert cell["acceptance_rate"] is None
    json.dumps(results, allow_nan=False)
    assert "| remote | server |" in render(results)
    write_plots(results, tmp_path)


def test_a_server_that_fails_the_whole_warm_up_refuses_the_run(serve, tmp_path):
    """As vLLM's initial test request: a run every request of which fails is refused with the server's error."""
    with pytest.raises(SaguaroError, match="no such thing|engine died"):
        run(serve(lambda n, seed: True), tmp_path)


def test_more_than_a_hundred_requests_at_once_reach_the_server_at_once(serve, tmp_path):
    """httpx's default pool of 100 connections held the 101st request in the client: the server never saw more
    than 100 at once, and the wait counted as its TTFT. vLLM's benchmark_serving (and the openai client's pool of
    1000) send them all."""
    url = serve(lambda n, seed: False, gather=120)  # the untimed warm-up's 120 wait for each other
    [cell] = run(url, tmp_path, n=120)["cells"]
    assert serve.handler.peak == 120 and cell["requests"] == 120
