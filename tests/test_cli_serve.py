"""`saguaro serve` and `saguaro generate`: help, errors, a real server in a subprocess stopped by SIGINT."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from saguaro_dist import SamplingParams
from saguaro_dist.cli import main
from saguaro_dist.serve.app import APP_IMPORT_PATH
from saguaro_dist.serve.config_file import load_serve_config
from test_serve_fixtures import free_port, ipv6_loopback

pytest_plugins = ["test_serve_fixtures"]


@pytest.mark.parametrize("command", ["serve", "generate", "run-batch"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0 and "--model" in capsys.readouterr().out


def test_the_command_line_loads_without_the_serving_stack():
    """`saguaro bench` / `generate` / `--help` run where only the engine's packages are installed (a GPU
    image without pydantic, FastAPI or Ray): the serving stack is imported by the commands that serve."""
    code = ("import sys; from saguaro_dist.cli import build_parser; build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'fastapi', 'ray', 'starlette'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bad_flags_exit_2_without_trace(capsys, serving_pair):
    assert main(["serve", serving_pair[0], "--k", "0"]) == 2
    err = capsys.readouterr().err
    assert "k must be an integer >= 1" in err and "Traceback" not in err


def test_a_pair_that_cannot_speculate_exits_2_before_ray_starts(capsys, serving_pair, tiny_checkpoint):
    """The serving pair has a tokenizer; a bare checkpoint of another vocabulary size cannot show that its
    rows differ only by padding (tests/test_vocab_padding.py)."""
    assert main(["serve", serving_pair[0], "--draft", str(tiny_checkpoint("draft")), "--mode", "sd"]) == 2
    err = capsys.readouterr().err
    assert "without both tokenizers" in err and "Traceback" not in err


def test_serve_config_file_parsing(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": 8123},
        "applications": [{"name": "saguaro", "route_prefix": "/", "import_path": APP_IMPORT_PATH,
                          "args": {"model": "/m", "k": 3},
                          "deployments": [{"name": "SaguaroServer", "num_replicas": 2}]}]}))
    loaded = load_serve_config(str(path))
    assert (loaded.args, loaded.host, loaded.port) == ({"model": "/m", "k": 3}, "127.0.0.1", 8123)
    assert loaded.deployment_options == {"num_replicas": 2}
    path.write_text("applications: [{import_path: 7}]")
    with pytest.raises(ValueError, match="not a valid Serve config"):
        load_serve_config(str(path))


def test_generate_in_process_matches_llm(serving_pair, reference_llm, capsys):
    target, draft = serving_pair
    code = main(["generate", target, "--draft", draft, "--mode", "sd", "--k", "2", "--max-model-len", "256",
                 "--prompt", "the cat sat", "--max-tokens", "12", "--json"])
    result = json.loads(capsys.readouterr().out)
    expected = reference_llm.generate(["the cat sat"], SamplingParams(temperature=0, max_tokens=12))[0].text
    assert code == 0 and result["text"] == expected and result["metrics"]["rounds"] >= 1


def test_generate_against_a_server(server, reference_llm, capsys):
    banned = reference_llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    allowed = [t for t in range(len(reference_llm.tokenizer)) if t != banned + 1]
    code = main(["generate", "--url", server.url, "--api-key", server.api_key, "--prompt", "hello world",
                 "--max-tokens", "10", "--repetition-penalty", "1.5", "--presence-penalty", "0.5",
                 "--temperature", "1.0", "--min-p", "1.0",  # only the likeliest token left: the greedy reply
                 "--logit-bias", f"{banned}=-100", "--allowed-token-ids", ",".join(map(str, allowed))])
    expected = reference_llm.generate(["hello world"], SamplingParams(
        temperature=0, max_tokens=10, repetition_penalty=1.5, presence_penalty=0.5, logit_bias={banned: -100},
        allowed_token_ids=allowed))[0]
    assert code == 0 and capsys.readouterr().out == expected.text + "\n" and banned not in expected.token_ids
    assert main(["generate", "--url", server.url, "--prompt", "hi"]) == 2  # no key: the server's 401, cleanly
    for bad in (["--logit-bias", "5"], ["--logit-bias", "x=1"], ["--allowed-token-ids", "1,a"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--url", server.url, "--prompt", "hi", *bad])
        assert exit_info.value.code == 2 and "expected" in capsys.readouterr().err


# The direct run serves on IPv6 where the machine has it (Serve binds "::1" over IPv6, the URL logged brackets
# it): one server start for what was a server of its own (~45 s).
DIRECT_HOST = "::1" if ipv6_loopback() else "127.0.0.1"


@pytest.mark.slow
# Both ingresses under a prefix (the root prefix is what every other serve test runs): a third run cost ~40 s.
@pytest.mark.parametrize("ingress, answers, prefix, host", [("proxy", "proxy", "/my/prefix", "127.0.0.1"),
                                                            ("auto", "direct", "/myprefix", DIRECT_HOST)])
def test_serve_subprocess_answers_then_stops_on_sigint(serving_pair, tmp_path, ingress, answers, prefix, host):
    """The config's route_prefix is applied (it was refused): the routes, /health too, live under it, Serve's own
    /-/healthz stays at the root, as under `serve run`."""
    target, draft = serving_pair
    port = free_port(host)
    root = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    base = root + prefix.rstrip("/")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": [{
        "name": "saguaro", "route_prefix": prefix, "import_path": APP_IMPORT_PATH,
        "args": {"model": target, "draft": draft, "mode": "ssd", "k": 2, "max_model_len": 256}}]}))
    cmd = [sys.executable, "-c", "import sys; from saguaro_dist.cli import main; sys.exit(main())", "serve", "--config", str(config),
           "--host", host, "--port", str(port), "--num-cpus", "2", "--api-key", "cli-key", "--served-model-name", "tiny",
           "--ingress", ingress]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_ADDRESS": ""})
    try:
        _wait_healthy(base, proc)
        r = httpx.post(f"{base}/v1/completions", timeout=60, headers={"Authorization": "Bearer cli-key"},
                       json={"model": "tiny", "prompt": "the cat", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(f"{root}/-/healthz", timeout=10).status_code == 200
        # the CLIs' --url names the server (its prefix included), not the client's API root (/v1 is added)
        assert main(["generate", "--url", base, "--api-key", "cli-key", "--prompt", "the cat", "--max-tokens", "2"]) == 0
        if prefix != "/":  # nothing of the app's outside its prefix
            assert httpx.get(f"{root}/v1/models", timeout=10,
                             headers={"Authorization": "Bearer cli-key"}).status_code == 404
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=90)[0]
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert f"({answers} ingress;" in output, output[-3000:]  # who answered on --port
    # the URL logged shows the prefix (and an IPv6 host in brackets); not "serving ...": on direct ingress the
    # replica answers before serve.run returns, so a SIGINT on a loaded box can come before that line
    assert f"starting 'tiny' at {base}/v1 (" in output, output[-3000:]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"saguaro serve exited early:\n{proc.communicate()[0][-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError("saguaro serve did not become healthy in time")


def test_draft_device_chunk_budget_and_eager_flags_reach_the_config():
    import argparse

    from saguaro_dist.cli.serve import add_engine_args, engine_args
    from saguaro_dist.config import Config
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args(parser.parse_args(["--draft-device", "cpu", "--max-num-batched-tokens", "512", "--enforce-eager",
                                          "--gpu-memory-utilization", "0.5"]))
    config = Config(**args)
    assert (config.draft_device, config.max_num_batched_tokens, config.enforce_eager) == ("cpu", 512, True)
    assert config.gpu_memory_utilization == 0.5
    defaults = Config(**engine_args(parser.parse_args([])))  # flags left out keep the defaults
    assert (defaults.enforce_eager, defaults.gpu_memory_utilization) == (False, 0.9)
    pinned = Config(**engine_args(parser.parse_args(["--revision", "v1.0", "--draft-revision", "abc123"])))
    assert (pinned.revision, pinned.draft_revision) == ("v1.0", "abc123")


def test_generate_with_ngram_needs_no_draft_and_matches_ar(serving_pair, capsys):
    target, _ = serving_pair
    texts = {}
    for mode in ("ar", "ngram"):
        code = main(["generate", target, "--mode", mode, "--k", "3", "--max-model-len", "256",
                     "--prompt", "the cat sat", "--max-tokens", "12", "--json"])
        assert code == 0
        texts[mode] = json.loads(capsys.readouterr().out)["text"]
    assert texts["ngram"] == texts["ar"]
