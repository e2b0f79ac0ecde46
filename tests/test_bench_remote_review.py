"""`saguaro bench --url` against a real scripted OpenAI-compatible server on loopback (review of session 83): a token
is a chunk with choices even when its text is "" (vLLM's benchmark_serving), a stream without one fails, a run
whose requests failed exits 1 with `errors`, usage without a count is no usage, the serving JSON's cell keys are
the in-process run's, and the errors that name a cap name the right one."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
import time

import pytest
from test_bench_serving import CELL_KEYS

from saguaro_dist.bench import BenchConfig
from saguaro_dist.bench.remote import RemoteConfig, _request, run_remote, server_prompts
from saguaro_dist.bench.report import render
from saguaro_dist.cli import main
from saguaro_dist.client import AsyncClient
from scripted_openai import ScriptedServer, Servers

N = 2            # requests a stream
TOKENS = 4       # chunks with choices a request
GAP_S = 0.02     # between them
USAGE_S = 0.15   # before the usage chunk, after the last token


class _Server(ScriptedServer):
    """Streams TOKENS chunks with choices, the first with text "" (a special token), then the usage chunk late.
    After `good` completions (the warm-up's), `then`: "stream" as before, "400", "no-choices" (the usage chunk alone)
    or "null-usage" (completion_tokens: null)."""
    good, then, completions, lock = 10**9, "stream", 0, threading.Lock()

    def do_POST(self):
        if self.tokenized() is None:
            return
        with self.lock:
            type(self).completions += 1
            late = type(self).completions > self.good
        how = self.then if late else "stream"
        if how == "400":
            return self.json_reply(400, {"error": {"message": "no such thing", "type": "invalid_request_error"}})
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for i in range(TOKENS if how != "no-choices" else 0):
            time.sleep(GAP_S)
            finish = "length" if i == TOKENS - 1 else None
            self.event({"id": "c", "model": "m", "choices": [{"index": 0, "text": f"t{i}" if i else "", "finish_reason": finish}]})
        time.sleep(USAGE_S)
        count = None if how == "null-usage" else TOKENS
        self.event({"id": "c", "model": "m", "choices": [],
                    "usage": {"prompt_tokens": 12, "completion_tokens": count, "total_tokens": 12 + TOKENS}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def serve():
    """serve(good=..., then=...) -> the URL of a fresh server behaving so."""
    servers = Servers()
    yield lambda **how: servers.start(type("Server", (_Server,), {"completions": 0, **how}))
    servers.close()


def run(url: str, tmp_path) -> dict:
    base = BenchConfig(temperatures=(0.0,), max_new_tokens=TOKENS, prompt_len=12, repeats=2, out_dir=str(tmp_path))
    return run_remote(RemoteConfig(url, base, rates=(math.inf,), num_requests=N), progress=False)


def test_an_empty_first_token_is_timed_and_the_usage_chunk_is_not(serve):
    """TTFT was the first non-empty text (t1), so the "" token's wait hid in it and ITL lost a gap; E2E ran on to
    the usage chunk and [DONE]. As benchmark_serving: every chunk with choices is a token, the last one ends E2E."""
    async def one():
        async with AsyncClient(serve(), max_retries=0) as client:
            return await _request(client, "m", [1, 2, 3], 0.0, TOKENS, 0, time.perf_counter())
    served = asyncio.run(one())
    m = served.metrics
    assert len(served.itl_s) == TOKENS - 1 and served.counted and m.num_generated_tokens == TOKENS
    # E2E is the first token's time plus the gaps after it: nothing after the last token (the usage chunk) counts
    assert m.total_time_s == pytest.approx(m.time_to_first_token_s + sum(served.itl_s), abs=1e-9)


def test_a_stream_without_a_token_is_a_failed_request_and_a_failed_run(serve, tmp_path):
    """A stream of the usage chunk alone was served, its TTFT the stream's end: it is a failed request, its cell
    names it (a FAILED line), and the results' `errors` lists the cell."""
    results = run(serve(good=N, then="no-choices"), tmp_path)
    [cell] = results["cells"]
    assert (cell["requests"], cell["failed_requests"], cell["ttft_ms_p50"]) == (0, 2 * N, None)
    assert "without a chunk with choices" in cell["error"]
    assert [(e["system"], e["rate"]) for e in results["errors"]] == [("server", "inf")]
    assert "FAILED remote/server rate=inf" in render(results)


def test_a_run_whose_requests_all_failed_exits_1_with_errors(serve, tmp_path, capsys):
    """Every timed request a 400 after a good warm-up: the CLI exited 0 and the JSON had no `errors`."""
    url = serve(good=N, then="400")
    code = main(["bench", "--url", url, "--request-rates", "inf", "--num-requests", str(N), "--temperatures", "0",
                 "--max-new-tokens", str(TOKENS), "--prompt-len", "8", "--repeats", "1", "--out", str(tmp_path),
                 "--no-progress", "--no-plots"])
    assert code == 1 and "cell(s) failed" in capsys.readouterr().err
    results = json.loads((tmp_path / "serving.json").read_text())
    [error] = results["errors"]
    assert error["system"] == "server" and "no such thing" in error["error"]


def test_usage_without_a_token_count_is_no_usage(serve, tmp_path):
    """completion_tokens: null crashed the whole run (a None token count); it is a stream without usage."""
    [cell] = run(serve(good=N, then="null-usage"), tmp_path)["cells"]
    assert (cell["requests"], cell["requests_without_usage"], cell["output_tokens"]) == (N, 2 * N, 0)
    assert cell["failed_requests"] == 0 and cell["error"] is None


def test_remote_cells_have_the_in_process_keys_and_integer_counts(serve, tmp_path):
    """One `kind: serving` schema: the in-process cells (test_bench_serving's CELL_KEYS) and these; counts are
    ints (two repeats' median made 2.0 of 2 requests)."""
    results = run(serve(), tmp_path)
    [cell] = results["cells"]
    assert set(cell) == CELL_KEYS and results["errors"] == []
    counts = ("requests", "output_tokens", "failed_requests", "requests_without_usage")
    assert [type(cell[k]) for k in counts] == [int] * 4 and (cell["requests"], cell["output_tokens"]) == (N, N * TOKENS)


@pytest.mark.parametrize("text", ["", ",", " ", " , "])
def test_request_rates_that_name_no_rate_are_refused(text, tmp_path, capsys):
    """--request-rates "" read as no rates at all: the whole grid ran instead of a serving run."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--request-rates", text, "--url", "http://127.0.0.1:1", "--out", str(tmp_path), "--no-progress"])
    assert exit_.value.code == 2 and "at least one" in capsys.readouterr().err
    from saguaro_dist.cli.bench import run_kind
    assert run_kind(argparse.Namespace(sweep=False, url=None, request_rates=())) == "serving"  # refused by its config


def test_more_requests_than_demo_prompts_names_the_real_cap(serve):
    """--num-requests 300 against the 256 demo prompts said "lower --prompt-len", which could not help."""
    from saguaro_dist.bench.prompts import len_of_demo_prompts
    total = len_of_demo_prompts()

    async def prompts(n: int):
        async with AsyncClient(serve()) as client:
            return await server_prompts(client, "m", n, 12)
    with pytest.raises(ValueError) as err:
        asyncio.run(prompts(total + 1))
    message = str(err.value)
    assert f"--num-requests {total + 1}" in message and f"at most {total} requests a stream" in message
    assert "--prompt-len" not in message
