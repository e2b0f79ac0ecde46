"""`saguaro run-batch`: OpenAI's batch file format, every line through the real serving app in-process."""
from __future__ import annotations

import io
import json
import re

import pytest

from engine_helpers import Terminal
from saguaro_dist.cli import main
from saguaro_dist.sampling_params import SamplingParams
from saguaro_dist.serve.batch import BatchSummary, parse_request, result_record
from test_serve_fixtures import ENGINE_ARGS

pytest_plugins = ["test_serve_fixtures"]


def engine_flags(serving_pair) -> list[str]:
    """The shared server's engine settings as flags (so the reference LLM is the same engine)."""
    target, draft = serving_pair
    return [target, "--draft", draft, "--mode", ENGINE_ARGS["mode"], "--k", str(ENGINE_ARGS["k"]),
            "--max-batch-size", "4", "--max-model-len", str(ENGINE_ARGS["max_model_len"]),
            "--fan-out", ",".join(map(str, ENGINE_ARGS["fan_out"])), "--tree-policy", ENGINE_ARGS["tree_policy"],
            "--hit-glue", ENGINE_ARGS["hit_glue"], "--fallback", ENGINE_ARGS["fallback"]]


def line(custom_id, body, url="/v1/completions", **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


PROMPTS = ["the cat sat on", "hello world", "def add ( a , b )", "import os", "a dog ran", "class Stack"]


def test_every_line_gets_one_record_in_input_order(serving_pair, reference_llm, tmp_path, capsys):
    lines = [line(f"p{i}", {"prompt": p, "max_tokens": 8, "temperature": 0}) for i, p in enumerate(PROMPTS)]
    lines += [line("chat", {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 5},
                   url="/v1/chat/completions"),
              line("resp", {"input": "hello world", "max_output_tokens": 5}, url="/v1/responses"),
              "", "{not json", line("p0", {"prompt": "twice", "max_tokens": 2}),  # blank: skipped; bad; duplicate id
              line("stream", {"prompt": "x", "stream": True}), line("url", {"prompt": "x"}, url="/v1/embeddings"),
              line("range", {"prompt": "x", "temperature": -1}), line("model", {"prompt": "x", "model": "other"}),
              line("last", {"prompt": "the mat", "max_tokens": 4, "temperature": 0}),
              line("half", {"prompt": "x \ud800", "max_tokens": 2})]  # JSON's escape of a lone surrogate: the app's 400
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    code = main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--max-in-flight", "3",
                 *engine_flags(serving_pair)])
    records = [json.loads(r) for r in out.read_text().splitlines()]
    assert code == 0 and "16 requests, 7 failed" in capsys.readouterr().err
    assert [r["custom_id"] for r in records] == [f"p{i}" for i in range(6)] + [
        "chat", "resp", None, "p0", "stream", "url", "range", "model", "last", "half"]
    half = records.pop()["response"]
    assert half["status_code"] == 400 and "lone surrogate" in half["body"]["error"]["message"]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    for r, expected in zip(records, reference_llm.generate(PROMPTS, greedy)):  # exact, as served
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert r["response"]["body"]["choices"][0]["text"] == expected.text
        assert r["response"]["body"]["id"] == "cmpl-" + r["response"]["request_id"]
    assert records[6]["response"]["body"]["object"] == "chat.completion"
    assert records[7]["response"]["body"]["object"] == "response" and records[7]["response"]["status_code"] == 200
    records.pop(7)
    assert records[-1]["response"]["body"]["choices"][0]["text"] == reference_llm.generate(
        ["the mat"], SamplingParams(temperature=0, max_tokens=4))[0].text
    for r, message in zip(records[7:11], ["is not JSON", "is not unique", "stream is not supported", "url must be"]):
        assert r["response"] is None and r["error"]["code"] == "invalid_request" and message in r["error"]["message"]
    assert [records[11]["response"]["status_code"], records[12]["response"]["status_code"]] == [400, 404]
    assert records[11]["response"]["body"]["error"]["param"] == "temperature"


def test_stdin_to_stdout(serving_pair, reference_llm, monkeypatch, capsys):
    given = line("a", {"prompt": "hello world", "max_tokens": 6, "temperature": 0}) + "\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(given.encode())))
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["run-batch", "-i", "-", "-o", "-", *engine_flags(serving_pair)]) == 0
    assert "Processed requests" in terminal.getvalue() and "1req" in terminal.getvalue().replace(" ", "")
    (record,) = [json.loads(r) for r in capsys.readouterr().out.splitlines()]
    expected = reference_llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=6))[0].text
    assert record["custom_id"] == "a" and record["response"]["body"]["choices"][0]["text"] == expected


def test_against_a_running_server(server, reference_llm, tmp_path, capsys):
    """--url: the lines go to the Ray Serve deployment (the API key from the flag), not to an engine here."""
    (tmp_path / "in.jsonl").write_text("\n".join(
        line(f"p{i}", {"prompt": p, "max_tokens": 6, "temperature": 0}) for i, p in enumerate(PROMPTS[:3])) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--url", server.url + "/v1"]
    assert main([*argv, "--api-key", server.api_key]) == 0
    texts = [json.loads(r)["response"]["body"]["choices"][0]["text"] for r in out.read_text().splitlines()]
    assert texts == [o.text for o in reference_llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=6))]
    assert main(argv) == 0  # no key: each line carries the server's 401
    assert {json.loads(r)["response"]["status_code"] for r in out.read_text().splitlines()} == {401}
    assert "3 requests, 3 failed" in capsys.readouterr().err


def test_a_server_that_cannot_be_reached_fails_each_line_not_the_batch(tmp_path, capsys):
    from saguaro_dist.serve.ingress import free_port
    (tmp_path / "in.jsonl").write_text(line("a", {"prompt": "x"}) + "\n" + line("b", {"prompt": "y"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--url",
                 f"http://127.0.0.1:{free_port()}"]) == 0
    records = [json.loads(r) for r in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["a", "b"] and all(r["response"] is None for r in records)
    assert {r["error"]["code"] for r in records} == {"request_failed"} and "did not complete" in records[0]["error"]["message"]


@pytest.mark.parametrize("flags, message", [
    (["-i", "/no/such.jsonl", "-o", "-"], "does not exist"),
    (["-i", "-", "-o", "-", "--max-in-flight", "0"], "--max-in-flight must be >= 1"),
    (["-i", "SAME", "-o", "SAME"], "would overwrite the input"),
    (["-i", "SAME", "-o", "/no/such/folder/out.jsonl"], "folder that does not exist"),
])
def test_bad_files_fail_before_any_model_loads(flags, message, tmp_path, capsys):
    same = tmp_path / "requests.jsonl"
    same.write_text(line("a", {"prompt": "x"}) + "\n")
    flags = [str(same) if f == "SAME" else f for f in flags]
    assert main(["run-batch", *flags, "--model", "/no/model/here"]) == 2  # the model would fail differently
    assert message in capsys.readouterr().err
    assert same.read_text() == line("a", {"prompt": "x"}) + "\n"  # nothing lost


@pytest.mark.parametrize("text, error", [
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}', None),  # method defaults to POST
    ('[1, 2]', "must be a JSON object"),
    ('{"url": "/v1/completions", "body": {}}', "custom_id must be a non-empty string"),
    ('{"custom_id": "", "url": "/v1/completions", "body": {}}', "custom_id must be a non-empty string"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "method must be POST"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": "x"}', "body must be a JSON object"),
])
def test_parse_request(text, error):
    request = parse_request(3, text, set())
    assert request.error is None if error is None else error in request.error and "line 3" in request.error


def test_a_line_that_is_not_utf8_is_that_lines_error():
    assert parse_request(4, b'{"custom_id": "a", "url": "/v1/completions", "body": {}}', set()).error is None
    bad = parse_request(5, b'{"custom_id": "\xff"}', set())
    assert bad.custom_id is None and "line 5 is not UTF-8" in bad.error


def test_records_follow_openai_batch_output():
    ok = parse_request(1, line("a", {"prompt": "x"}), set())
    record = result_record(ok, 200, {"usage": {"completion_tokens": 4}}, "batch-1")
    assert set(record) == {"id", "custom_id", "response", "error"} and record["id"].startswith("batch_req_")
    assert record["response"] == {"status_code": 200, "request_id": "batch-1", "body": {"usage": {"completion_tokens": 4}}}
    summary = BatchSummary()
    summary.add(record)
    summary.add(result_record(parse_request(2, "{", set()), None, None, "batch-2"))
    summary.add(result_record(ok, 200, {"usage": {"output_tokens": 3}}, "batch-3"))  # a /v1/responses reply
    assert (summary.requests, summary.failed, summary.completion_tokens) == (3, 1, 7)


@pytest.mark.parametrize("which, message", [("output", "output file .* is a folder"), ("input", "input file .* is a folder"),
                                            ("url", "--url must be a server's address")])
def test_bad_files_and_urls_are_refused_before_any_model_loads(tmp_path, capsys, which, message):
    """An output folder raised IsADirectoryError (a stack trace) once the model had loaded; a --url without
    http:// made every line's record an error, and the run exit 0."""
    (tmp_path / "in.jsonl").write_text(line("a", {"prompt": "x", "max_tokens": 2}) + "\n")
    files = {"input": str(tmp_path / "in.jsonl"), "output": str(tmp_path / "out.jsonl")}
    extra = ["--url", "localhost:8000"] if which == "url" else []
    if which != "url":
        files[which] = str(tmp_path)
    code = main(["run-batch", "-i", files["input"], "-o", files["output"], "--model", "/nonexistent", *extra])
    assert code == 2 and re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out.jsonl").exists()
