"""`saguaro run-batch` where its input or output is not a plain file read at leisure, and lines the app reads
otherwise than json's truthiness: a slow line among fast ones, a pipe that trickles, a named pipe, stdin
redirected from the output file, a full disk, a reader that went away, a digit string json refuses, and
`stream: "false"`. Real HTTP to a scripted OpenAI-compatible server on loopback (no model loads here)."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from pydantic import ValidationError
from scripted_openai import ScriptedServer, Servers

from saguaro_dist.cli import main
from saguaro_dist.serve.batch import parse_request
from saguaro_dist.serve.protocol import CompletionRequest

GUARD_S = 30  # how long a test waits for what the fixed code does at once; only the old code ever waits it out


class Counting(ScriptedServer):
    """/v1/completions answered 200 at once, except prompt "slow": held until `hold_until` others are answered.
    Counts the requests running at once (the most of them, in `peak`)."""
    lock = threading.Lock()
    running = peak = answered = 0
    others_answered = threading.Event()
    hold_until = 0
    held_until_others = False  # whether the slow one saw `hold_until` others answered while it ran

    def do_POST(self):
        body = self.tokenized()
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.peak = max(cls.peak, cls.running)
        if body["prompt"] == "slow":
            cls.held_until_others = cls.others_answered.wait(GUARD_S)
        with cls.lock:
            cls.running -= 1
            cls.answered += body["prompt"] != "slow"
            if cls.answered >= cls.hold_until:
                cls.others_answered.set()
        self.json_reply(200, {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}],
                              "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    def handle(self):
        try:
            super().handle()
        except ConnectionError:  # a run that stopped early closed its requests: the server's trace is noise here
            pass


@pytest.fixture(scope="module")
def servers():
    servers = Servers()
    yield servers
    servers.close()


@pytest.fixture
def counting(servers):
    """A fresh Counting server (its counts are its own)."""
    handler = type("Counts", (Counting,), {"lock": threading.Lock(), "others_answered": threading.Event()})
    return handler, servers.start(handler, queue_size=64)


def line(custom_id: str, prompt: str = "x", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, **body}})


def records(path) -> list[dict]:
    return [json.loads(r) for r in path.read_text().splitlines()]


def test_a_slow_line_leaves_the_other_slots_running(counting, tmp_path, capsys):
    """Finished records waiting behind a slow first line counted as in flight: 1 request ran, not 4."""
    handler, url = counting
    handler.hold_until = 8  # more than --max-in-flight - 1 answered while the first line runs
    (tmp_path / "in.jsonl").write_text("\n".join([line("slow", "slow")] + [line(f"f{i}") for i in range(12)]) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--url", url,
                 "--max-in-flight", "4"]) == 0
    assert handler.held_until_others and handler.answered == 12
    assert handler.peak <= 4  # the bound still holds for what runs
    assert [r["custom_id"] for r in records(out)] == ["slow"] + [f"f{i}" for i in range(12)]
    assert "13 requests, 0 failed" in capsys.readouterr().err


def test_lines_trickling_from_a_pipe_are_answered_as_they_come(counting, tmp_path, monkeypatch):
    """stdin was read inside the event loop: a line's request did not start until more lines or the end came."""
    _, url = counting
    read_end, write_end = os.pipe()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(os.fdopen(read_end, "rb")))
    out, seen_before_more = tmp_path / "out.jsonl", threading.Event()

    def feed():
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(line("a").encode() + b"\n")
            pipe.flush()
            for _ in range(GUARD_S * 20):
                if out.exists() and out.read_text().endswith("\n"):
                    seen_before_more.set()
                    break
                threading.Event().wait(0.05)
            pipe.write(line("b").encode() + b"\n")

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    assert main(["run-batch", "-i", "-", "-o", str(out), "--url", url]) == 0
    feeder.join()
    assert seen_before_more.is_set() and [r["custom_id"] for r in records(out)] == ["a", "b"]


def test_a_named_pipe_is_an_input(counting, tmp_path):
    """`-i <(...)` (a pipe, as is /dev/stdin) was refused as "does not exist". Its second line spans many
    reads of the pipe, and has no line break."""
    _, url = counting
    fifo = tmp_path / "requests.fifo"
    os.mkfifo(fifo)
    feeder = threading.Thread(target=lambda: fifo.write_text(line("a") + "\n" + line("b", "y" * 300_000)), daemon=True)
    feeder.start()
    try:
        assert main(["run-batch", "-i", str(fifo), "-o", str(tmp_path / "out.jsonl"), "--url", url]) == 0
    finally:
        if feeder.is_alive():  # refused: open the pipe's other end, so the feeder's open returns
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert [r["custom_id"] for r in records(tmp_path / "out.jsonl")] == ["a", "b"]


def test_stdin_redirected_from_the_output_file_is_refused(counting, tmp_path, monkeypatch, capsys):
    """`-i - < F -o F`: F was emptied before stdin was read, and the run said "0 requests" and exit 0."""
    _, url = counting
    same, other = tmp_path / "requests.jsonl", tmp_path / "other.jsonl"
    same.write_text(line("a") + "\n")
    other.write_text(line("b") + "\n")
    with open(same) as stdin:
        monkeypatch.setattr("sys.stdin", stdin)
        assert main(["run-batch", "-i", "-", "-o", str(same), "--url", url]) == 2
    assert "would overwrite the input" in capsys.readouterr().err and same.read_text() == line("a") + "\n"
    with open(other) as stdin:  # stdin from another file: runs
        monkeypatch.setattr("sys.stdin", stdin)
        assert main(["run-batch", "-i", "-", "-o", str(same), "--url", url]) == 0
    assert [r["custom_id"] for r in records(same)] == ["b"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_ends_the_run_with_one_line(counting, tmp_path, capsys):
    """ENOSPC ended the run with a stack trace."""
    _, url = counting
    (tmp_path / "in.jsonl").write_text(line("a") + "\n" + line("b") + "\n")
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", "/dev/full", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "writing the output stopped after 0 records" in err and "No space left" in err
    assert len(err.strip().splitlines()) == 1


def test_a_reader_that_went_away_ends_the_run_quietly(counting, tmp_path, monkeypatch, capsys):
    """`-o - | head -1`: BrokenPipeError ended the run with a stack trace; Unix tools stop without a word."""
    _, url = counting
    (tmp_path / "in.jsonl").write_text("".join(line(f"r{i}") + "\n" for i in range(5)))
    read_end, write_end = os.pipe()
    os.close(read_end)
    stdout = io.TextIOWrapper(os.fdopen(write_end, "wb"))
    monkeypatch.setattr("sys.stdout", stdout)
    try:
        assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", "-", "--url", url]) == 1
    finally:
        monkeypatch.undo()
        stdout.close()  # its fd now writes to /dev/null: what it held goes there, not to an error at exit
    assert capsys.readouterr().err == ""


def test_a_number_too_long_to_read_is_that_lines_error(counting, tmp_path):
    """json's ValueError on a 5000-digit integer escaped: the batch ended (exit 2), with nothing written."""
    _, url = counting
    lines = [line("a"), line("b")[:-2] + ', "seed": ' + "9" * 5000 + "}}", line("c")]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--url", url]) == 0
    got = records(out)
    assert [r["custom_id"] for r in got] == ["a", None, "c"] and got[1]["response"] is None
    assert got[1]["error"]["message"].startswith("line 2 cannot be read") and "4300" in got[1]["error"]["message"]


@pytest.mark.parametrize("stream", [False, "false", "False", 0, "0", "no", "off", "f", 0.0,  # the app: false
                                    True, "true", "TRUE", 1, "1", "yes", "on",  # the app: true
                                    "maybe", None, 2, []])  # the app's 400
def test_stream_is_refused_only_where_the_app_reads_true(stream):
    """"stream": "false" was refused as a stream (truthy); the app reads it as false."""
    try:
        streams = CompletionRequest(prompt="x", stream=stream).stream
    except ValidationError:
        streams = False  # left for the app to refuse, with its own 400
    request = parse_request(1, line("a", stream=stream), set())
    assert (request.error is not None and "stream is not supported" in request.error) == streams


@pytest.mark.slow
def test_ctrl_c_with_stdin_open_ends_the_run(tmp_path):
    """Lines are read on a thread: blocked in a read of stdin's buffered file, it held its lock, and the
    interpreter aborted at exit (Fatal Python error) after Ctrl-C. A process of its own: it is the exit that counts."""
    from saguaro_dist.serve.ingress import free_port
    run = subprocess.Popen([sys.executable, "-m", "saguaro_dist.cli", "run-batch", "-i", "-", "-o", "-", "--url",
                            f"http://127.0.0.1:{free_port()}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    run.stdin.write(line("a").encode() + b"\n")
    run.stdin.flush()
    assert json.loads(run.stdout.readline())["custom_id"] == "a"  # its record is out: the run waits for more
    run.send_signal(signal.SIGINT)
    assert run.wait(GUARD_S) == 130 and b"Fatal" not in run.stderr.read()
    run.stdin.close()
