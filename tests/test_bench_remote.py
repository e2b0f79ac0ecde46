"""`saguaro bench --url`: serving streams sent to a running server over real HTTP on loopback (the serving
app as each Serve replica builds it, on the demo pair, under uvicorn)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
from http_helpers import serve_on_loopback

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.bench import BenchConfig
from saguaro_dist.bench.plots import write_plots
from saguaro_dist.bench.remote import RemoteConfig, run_remote
from saguaro_dist.bench.report import render
from saguaro_dist.cli import main
from saguaro_dist.demo import demo_pair
from saguaro_dist.serve.api import ServerOptions, create_app

KEY = "bench-key"


@pytest.fixture(scope="module")
def server():
    """(the server's /v1 URL, the in-process LLM behind it): ssd on the demo pair, behind an API key."""
    target, draft = demo_pair()
    with LLM(model=target, draft=draft, mode="ssd", k=2, fan_out=6, max_batch_size=4) as llm, \
            serve_on_loopback(create_app(llm, ServerOptions("demo", api_key=KEY))) as url:
        yield url, llm


def remote(url: str, tmp_path, **kw) -> RemoteConfig:
    """Four requests at once and at 100 a second, greedy and sampled, two repeats, 8 tokens each."""
    base = BenchConfig(temperatures=(0.0, 0.7), max_new_tokens=8, prompt_len=12, repeats=2, out_dir=str(tmp_path))
    return RemoteConfig(url, base, rates=(math.inf, 100.0), num_requests=4, api_key=KEY, **kw)


def test_every_stream_is_served_and_timed_from_the_client(server, tmp_path):
    url, llm = server
    results = run_remote(remote(url, tmp_path), progress=False)
    cells = results["cells"]
    assert [(c["temperature"], c["rate"]) for c in cells] == [(0.0, "inf"), (0.0, 100.0), (0.7, "inf"), (0.7, 100.0)]
    for c in cells:
        assert (c["system"], c["setting"], c["requests"], c["output_tokens"]) == ("server", "remote", 4, 4 * 8)
        assert 0 < c["ttft_ms_p50"] <= c["e2e_ms_p50"] and c["tpot_ms_p50"] > 0 and len(c["repeats"]) == 2
        assert 0 <= c["acceptance_rate"] <= 1 and c["cache_hit_rate"] is not None  # the final chunk's speculation stats
        assert c["speedup_vs_sd"] is None and c["greedy_same_as_ar"] is None and "demo" in c["placement"]["where"]
    json.dumps(results, allow_nan=False)
    table = render(results)
    assert "batched by the server at" in table and "served at" in table
    assert [p.name for p in write_plots(results, tmp_path)] == ["serving_vs_rate.png"]


def test_the_server_tokenizes_the_prompts_and_greedy_text_is_the_engines(server):
    """The prompts are the server's own token ids (/tokenize), and what a request streams is what the engine
    generates from them in process."""
    import asyncio

    from saguaro_dist.bench.remote import server_prompts
    from saguaro_dist.client import AsyncClient, Client
    url, llm = server

    async def prompts():
        async with AsyncClient(url, KEY) as client:
            return await server_prompts(client, "demo", 2, 12)
    ids = asyncio.run(prompts())
    assert all(len(p) == 12 for p in ids)
    with Client(url, api_key=KEY) as client:
        text = "".join(client.complete(ids[0], max_tokens=8, temperature=0, stream=True, ignore_eos=True))
        assert client.tokenize("def f(x):\n    return x") == llm.tokenizer.encode("def f(x):\n    return x")
    assert text == llm.generate(prompt_token_ids=[ids[0]], sampling_params=SamplingParams(temperature=0, max_tokens=8,
                                                                                          ignore_eos=True))[0].text


def test_cli_against_a_server_writes_serving_json(server, tmp_path, capsys):
    url, _ = server
    code = main(["bench", "--url", url, "--api-key", KEY, "--request-rates", "inf", "--num-requests", "2",
                 "--temperatures", "0", "--max-new-tokens", "4", "--prompt-len", "8", "--repeats", "1",
                 "--out", str(tmp_path), "--no-progress", "--no-plots"])
    assert code == 0
    cells = json.loads((tmp_path / "serving.json").read_text())["cells"]
    assert [(c["system"], c["output_tokens"]) for c in cells] == [("server", 8)]
    assert "batched by the server" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--url", "http://127.0.0.1:1"], "give --request-rates too"),
    (["--url", "ftp://example.com", "--request-rates", "inf"], "http:// or https://"),
    (["--url", "http://127.0.0.1:1", "--request-rates", "inf", "--systems", "sd", "--batch", "2"], "--systems, --batch"),
    (["--url", "http://127.0.0.1:1", "--request-rates", "inf", "--sweep"], "two different runs"),
])
def test_bad_remote_runs_are_refused_before_any_request(argv, message, tmp_path, capsys):
    assert main(["bench", *argv, "--out", str(tmp_path), "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_a_wrong_key_or_no_server_is_a_clear_error(server, tmp_path, capsys):
    from saguaro_dist.client import AuthenticationError
    url, _ = server
    with pytest.raises(AuthenticationError):
        run_remote(dataclasses.replace(remote(url, tmp_path), api_key="wrong"), progress=False)
    argv = ["bench", "--request-rates", "inf", "--out", str(tmp_path), "--no-progress"]
    assert main([*argv, "--url", url, "--api-key", "wrong"]) == 2
    assert f"the server at {url}" in capsys.readouterr().err
    assert main([*argv, "--url", "http://127.0.0.1:1"]) == 2  # nothing listens on port 1
    assert "cannot reach" in capsys.readouterr().err


def test_a_server_without_version_reads_unknown():
    """An OpenAI-compatible server with no /version (not ours, not vLLM) still runs: its version reads "unknown"."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from saguaro_dist.bench.remote import server_version
    from saguaro_dist.client import AsyncClient

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "no such route"}}')

        def log_message(self, *args):
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), NotFound) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()

        async def version():
            async with AsyncClient(f"http://127.0.0.1:{httpd.server_address[1]}") as client:
                return await server_version(client)
        assert asyncio.run(version()) == "unknown"
        httpd.shutdown()
