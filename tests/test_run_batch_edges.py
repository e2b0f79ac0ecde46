"""`saguaro run-batch` against what the files and servers of the field do: an input that opens with a UTF-8 byte order
mark (Windows PowerShell 5.1 writes one), and a `--url` server whose 200s carry "usage": null. Real HTTP to a scripted
OpenAI-compatible server on loopback (no model loads here)."""
from __future__ import annotations

import json

import pytest
from scripted_openai import ScriptedServer, Servers

from saguaro_dist.cli import main

BOM = b"\xef\xbb\xbf"


class Answers(ScriptedServer):
    """/v1/completions answered 200, with the usage the prompt names ("null", "missing", or a token count)."""

    def do_POST(self):
        body = self.tokenized()
        if body is None:
            return
        odd = {"null": None, "missing": ..., "odd": {"completion_tokens": None}}
        usage = odd[body["prompt"]] if body["prompt"] in odd else {"prompt_tokens": 1,
                                                                    "completion_tokens": int(body["prompt"])}
        reply = {"object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
        self.json_reply(200, reply if usage is ... else {**reply, "usage": usage})


@pytest.fixture(scope="module")
def url():
    servers = Servers()
    yield servers.start(Answers)
    servers.close()


def line(custom_id: str, prompt: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt}}).encode()


def run(url: str, tmp_path, data: bytes, capsys) -> tuple[list[dict], str]:
    (tmp_path / "in.jsonl").write_bytes(data)
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--url", url]) == 0
    return [json.loads(r) for r in out.read_text().splitlines()], capsys.readouterr().err


def test_a_byte_order_mark_on_the_first_line_is_no_error(url, tmp_path, capsys):
    """The first line was 'not JSON' (json refuses the BOM): PowerShell's files lost their first request."""
    records, err = run(url, tmp_path, BOM + line("a", "2") + b"\r\n" + line("b", "3") + b"\r\n", capsys)
    assert [(r["custom_id"], r["error"], r["response"]["status_code"]) for r in records] == [("a", None, 200),
                                                                                              ("b", None, 200)]
    assert "2 requests, 0 failed, 5 tokens generated" in err


def test_a_file_that_is_only_a_byte_order_mark_has_no_requests(url, tmp_path, capsys):
    """An empty file PowerShell wrote (its BOM and a line break) is a blank line, not a bad one."""
    records, err = run(url, tmp_path, BOM + b"\r\n" + line("a", "1") + b"\n", capsys)
    assert [r["custom_id"] for r in records] == ["a"] and "1 requests, 0 failed" in err


@pytest.mark.parametrize("usage", ["null", "missing", "odd"])
def test_a_server_answering_without_usage_gets_its_records_written(url, tmp_path, capsys, usage):
    """"usage": null crashed the summary (None.get) before that line's record was written, and ended the batch."""
    records, err = run(url, tmp_path, line("a", usage) + b"\n" + line("b", "4") + b"\n", capsys)
    assert [(r["custom_id"], r["response"]["status_code"]) for r in records] == [("a", 200), ("b", 200)]
    assert "2 requests, 0 failed, 4 tokens generated" in err
