"""`saguaro bench --url` against a real scripted OpenAI-compatible server on loopback: inter-token latency from
the streamed chunks' arrival times (vLLM's ITL), a warning when the streams carry no usage (the tokens would read
0 unremarked), and a cell's failed requests summed over its repeats (their median hid a repeat's)."""
from __future__ import annotations

import json
import logging
import math
import time

import pytest

from saguaro_dist.bench import BenchConfig
from saguaro_dist.bench.remote import RemoteConfig, run_remote
from saguaro_dist.bench.report import render, write_json
from saguaro_dist.bench.serving import Served, summarize
from saguaro_dist.engine.metrics import RequestMetrics
from scripted_openai import ScriptedServer, Servers

N = 4            # requests a stream
TOKENS = 4       # one-token chunks a request
FIRST_S = 0.05   # before the first chunk
GAP_S = 0.04     # between chunks
LONG_FIRST_S = 1.0  # the ITL test's: a TTFT far above any gap a loaded box's stall could stretch


class _Server(ScriptedServer):
    """/v1/models, /version, /tokenize and streamed /v1/completions; `usage`: whether the final chunk carries
    usage; `failing_seeds`: requests answered with a 400."""
    usage = True
    failing_seeds: frozenset = frozenset()
    first_s = FIRST_S

    def do_POST(self):
        body = self.tokenized()
        if body is None:
            return
        if body["seed"] in self.failing_seeds:
            return self.json_reply(400, {"error": {"message": "no", "type": "invalid_request_error"}})
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        time.sleep(self.first_s)
        for i in range(TOKENS):
            self.event({"id": "c", "model": "m", "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})
            time.sleep(GAP_S if i < TOKENS - 1 else 0)
        usage = {"usage": {"prompt_tokens": 12, "completion_tokens": TOKENS, "total_tokens": 12 + TOKENS}}
        self.event({"id": "c", "model": "m", "choices": [], **(usage if self.usage else {})})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def serve():
    """serve(**handler attributes) -> the URL of a fresh server behaving so."""
    servers = Servers()
    yield lambda **how: servers.start(type("Server", (_Server,), how))
    servers.close()


def run(url: str, tmp_path, repeats: int = 1) -> dict:
    base = BenchConfig(temperatures=(0.0,), max_new_tokens=TOKENS, prompt_len=12, repeats=repeats, out_dir=str(tmp_path))
    return run_remote(RemoteConfig(url, base, rates=(math.inf,), num_requests=N), progress=False)


def test_inter_token_latency_comes_from_the_chunks_arrival_times(serve, tmp_path):
    (cell,) = run(serve(first_s=LONG_FIRST_S), tmp_path)["cells"]
    # 3 gaps a request of GAP_S each, on loopback; the TTFT before them is not one: counted, it would be 4 of 16
    # gaps of LONG_FIRST_S, the mean above a quarter of it. No bound on single gaps: a loaded box's stall can read
    # every chunk at once (gaps near 0) or stretch one past LONG_FIRST_S; the mean keeps ~3 s of room for stalls.
    assert 0 <= cell["itl_ms_p50"] <= cell["itl_ms_p99"]
    assert cell["itl_ms_mean"] / 1e3 < LONG_FIRST_S / 4
    assert cell["ttft_ms_p50"] / 1e3 >= LONG_FIRST_S and cell["requests_without_usage"] == 0
    assert "ITL p50 ms" in render({**run_context(cell), "cells": [cell]})


def run_context(cell: dict) -> dict:
    """What render() reads beside the cells (a remote run's)."""
    return {"kind": "serving", "pair": {"target": "m", "draft": "the server's"}, "prompts": "p",
            "host": {"cpu_count": 2, "load_average": [0, 0, 0]}, "settings": {}, "placements": {},
            "serving": {"max_batch_size": None, "url": "u", "num_requests": N}}


def test_in_process_requests_have_no_inter_token_latency():
    """In process a request is one final delta: no chunks to time, so ITL is None, not 0."""
    served = [Served([1, 2], RequestMetrics(num_generated_tokens=2, time_to_first_token_s=0.1, total_time_s=0.3))]
    got = summarize(served, 0.3)
    assert (got["itl_ms_mean"], got["itl_ms_p50"], got["itl_ms_p99"]) == (None, None, None)


def test_streams_without_usage_are_warned_of_and_counted(serve, tmp_path, caplog):
    """A server that ignores stream_options.include_usage: every request's tokens read 0, and the run said nothing."""
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.bench.remote"):
        (cell,) = run(serve(usage=False), tmp_path)["cells"]
    assert cell["output_tokens"] == 0 and cell["requests_without_usage"] == N
    assert any("without usage" in r.getMessage() and "include_usage" in r.getMessage() for r in caplog.records)


def test_failed_requests_of_one_repeat_are_not_hidden_by_the_median(serve, tmp_path):
    """Three repeats, one request failing in the second (request 1 of repeat 1 is seeded 0 + 1 x 4 + 1): the cell's
    failed_requests was the median over repeats, 0, as if every request had been served."""
    results = run(serve(failing_seeds=frozenset({N + 1})), tmp_path, repeats=3)
    (cell,) = results["cells"]
    assert [r["failed_requests"] for r in cell["repeats"]] == [0, 1, 0]
    assert cell["failed_requests"] == 1 and cell["requests"] == N  # the figures stay medians
    json.loads(write_json(results, tmp_path / "serving.json").read_text())


# ---- in process: a system that fails costs its own cells only ----------------------------------------

def tiny_serving(pair, tmp_path):
    from saguaro_dist.bench.serving import ServingConfig
    base = BenchConfig(target=pair[0], draft=pair[1], systems=("ar", "sd"), settings=("paper",), batch_sizes=(2,),
                       temperatures=(0.0,), max_new_tokens=6, prompt_len=5, k=2, fan_out=6, repeats=1,
                       out_dir=str(tmp_path))
    return ServingConfig(base=base, rates=(math.inf, 500.0), num_requests=2)


def check_sd_failed(results: dict, message: str, tmp_path) -> None:
    from saguaro_dist.bench.plots import write_plots
    cells = {(c["system"], c["rate"]): c for c in results["cells"]}
    assert set(cells) == {("ar", "inf"), ("ar", 500.0), ("sd", "inf"), ("sd", 500.0)}
    for rate in ("inf", 500.0):
        ar, sd = cells[("ar", rate)], cells[("sd", rate)]
        assert ar["error"] is None and ar["output_tokens"] == 2 * 6 and ar["speedup_vs_sd"] is None
        assert message in sd["error"] and set(ar) <= set(sd)  # the same fields, figures None
        assert (sd["output_tokens_per_s"], sd["greedy_same_as_ar"], sd["greedy_departures"]) == (None, None, None)
    assert [(e["system"], e["rate"]) for e in results["errors"]] == [("sd", "inf"), ("sd", 500.0)]
    assert "FAILED paper/sd rate=inf T=0.0:" in render(results)
    json.loads(write_json(results, tmp_path / "serving.json").read_text(), parse_constant=pytest.fail)
    (png,) = write_plots(results, tmp_path)
    assert png.stat().st_size > 0


def test_a_system_that_cannot_load_costs_only_its_serving_cells(tiny_llama_pair, tmp_path, monkeypatch):
    """sd's draft is missing: run_serving raised, and ar's streams, served or not yet, were lost with it."""
    from saguaro_dist.bench import serving
    real = serving.make_system
    monkeypatch.setattr(serving, "make_system", lambda name, target, draft, kw:
                        real(name, target, str(tmp_path / "no-draft") if name == "sd" else draft, kw))
    check_sd_failed(serving.run_serving(tiny_serving(tiny_llama_pair, tmp_path), progress=False), "sd T=0.0, loading",
                    tmp_path)


def test_a_system_whose_engine_dies_costs_only_its_serving_cells(tiny_llama_pair, tmp_path, monkeypatch):
    """sd's engine shuts down after its warm-up: every timed stream of it fails (EngineError); ar's are kept."""
    from saguaro_dist.bench import serving
    real = serving.warmed_up

    def warm_then_die(system, *args):
        real(system, *args)
        if system.name == "sd":
            system.llm.shutdown()
    monkeypatch.setattr(serving, "warmed_up", warm_then_die, raising=False)  # (before: no such step to wrap)
    check_sd_failed(serving.run_serving(tiny_serving(tiny_llama_pair, tmp_path), progress=False), "shut down", tmp_path)
