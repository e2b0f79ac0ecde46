"""`saguaro generate` and `saguaro run-batch` at their edges (review, session 89): a --url that names no port a
socket takes, a --fan-out that is no number, a closed stdout, a reader that went away, and a batch line larger
than serve's request cap. The real CLI (in-process `main`, or a subprocess where real file descriptors matter),
a scripted OpenAI-compatible server on loopback, and the shipped demo checkpoints."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from scripted_openai import ScriptedServer, Servers

from saguaro_dist.cli import main

BATCH_LINE = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})


class Completing(ScriptedServer):
    """/v1/completions answered 200 at once."""

    def do_POST(self):
        if self.tokenized() is not None:
            self.json_reply(200, {"object": "text_completion", "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})


@pytest.fixture(scope="module")
def url():
    servers = Servers()
    yield servers.start(Completing)
    servers.close()


def saguaro(*argv: str, close_stdout: bool = False, **kwargs) -> subprocess.Popen:
    """The real command in a child process (stdout closed before it starts, with close_stdout: `>&-`)."""
    preexec = (lambda: os.close(1)) if close_stdout else None
    return subprocess.Popen([sys.executable, "-P", "-m", "saguaro_dist.cli", *argv], stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec, **kwargs)


@pytest.mark.parametrize("bad", ["http://127.0.0.1:99999", "http://[::1", "http://", "http://host:0"])
@pytest.mark.parametrize("command", ["generate", "run-batch"])
def test_a_url_without_a_usable_host_and_port_is_a_clear_error(command, bad, tmp_path, capsys):
    """A port past 65535 (OverflowError) and an unclosed IPv6 bracket (httpx.InvalidURL) ended both commands in a
    stack trace; run-batch had loaded its input and opened its output first."""
    (tmp_path / "in.jsonl").write_text(BATCH_LINE + "\n")
    argv = ["--prompt", "x"] if command == "generate" else ["-i", str(tmp_path / "in.jsonl"), "-o",
                                                            str(tmp_path / "out.jsonl")]
    assert main([command, *argv, "--url", bad]) == 2
    assert f"--url must be a server's address, http://host:port or https://..., got {bad!r}" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("value", ["4,,3", "a", ""])
def test_a_fan_out_that_is_no_number_says_what_it_takes(value, capsys):
    """argparse named the parsing function: "argument --fan-out: invalid fan_out_arg value: '4,,3'"."""
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "x", "--fan-out", value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "fan_out_arg" not in err
    assert f"argument --fan-out: expected a branch budget (say 12) or comma-separated counts (say 4,3,2), got {value!r}" in err


@pytest.mark.parametrize("command", ["generate", pytest.param("run-batch", marks=pytest.mark.slow)])  # (imports: ~10 s)
def test_a_closed_stdout_is_a_clear_error_before_any_work(command, url, tmp_path):
    """`>&-`: generate ran its model only to fail printing, run-batch failed each record's write, both with an
    AttributeError's stack trace."""
    (tmp_path / "in.jsonl").write_text(BATCH_LINE + "\n")
    argv = ["--prompt", "x", "--url", url] if command == "generate" else ["-i", str(tmp_path / "in.jsonl"), "-o", "-",
                                                                          "--url", url]
    child = saguaro(command, *argv, close_stdout=True)
    _, err = child.communicate(timeout=120)
    message = "stdout is closed: there is nowhere" if command == "generate" else "output file '-' is stdout, which is closed"
    assert child.returncode == 2 and message in err and "Traceback" not in err, err


def test_generate_stops_quietly_when_its_reader_went_away(url):
    """`saguaro generate ... | head -0`: a BrokenPipeError's stack trace (run-batch already stopped quietly)."""
    child = saguaro("generate", "--prompt", "x", "--prompt", "y", "--url", url, stdout=subprocess.PIPE)
    child.stdout.close()  # the reader is gone before anything is printed
    _, err = child.communicate(timeout=120)
    assert child.returncode == 1 and err == "", err


def test_a_batch_line_larger_than_serves_request_cap_reaches_the_model(tmp_path):
    """serve's 1 MiB body cap held in the in-process app, with no run-batch flag to lift it: a long non-ASCII
    prompt (sent escaped, 6 bytes a character) was a 413 "request body larger than 1048576 bytes"."""
    prompt = "仙" * 180_000  # 540 kB in the file, 1.08 MB as the JSON body
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": p, "max_tokens": 2}}, ensure_ascii=False) for cid, p in
             (("long", prompt), ("short", "hi"))]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--mode", "ar"]) == 0
    long, short = [json.loads(r) for r in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert long["response"]["status_code"] == 400, long  # the model's own answer: the prompt outgrows its context
    assert "maximum context length" in long["response"]["body"]["error"]["message"]
    assert short["response"]["status_code"] == 200


def test_an_input_url_says_it_is_not_fetched(tmp_path, capsys):
    """vLLM's run_batch fetches `-i https://...`; here it read "does not exist", as if the server lacked the file."""
    assert main(["run-batch", "-i", "https://example.com/b.jsonl", "-o", str(tmp_path / "out.jsonl")]) == 2
    assert "input file 'https://example.com/b.jsonl' does not exist (a URL is not fetched here: download it first, " \
           "or pipe it in: curl -sSf URL | saguaro run-batch -i - ...)" in capsys.readouterr().err


@pytest.mark.parametrize("form", [lambda u: u, lambda u: u + "/", lambda u: u + "/v1", lambda u: u + "/v1/",
                                  lambda u: u.replace("http://", "HTTP://"), lambda u: u.replace("http://", "Http://")])
def test_the_urls_users_pass_reach_the_server(url, form, capsys):
    """A scheme is case-insensitive (RFC 3986; httpx lowercases it): `--url HTTP://host:8000` was refused as no
    server's address."""
    assert main(["generate", "--prompt", "x", "--url", form(url)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == "ok\n"
