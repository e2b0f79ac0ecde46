"""Review fixes on /v1/responses and `saguaro run-batch`, over real HTTP: the serving app under uvicorn with the
demo model, and run-batch sending its lines to it (--url)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.cli import main
from saguaro_dist.demo import demo_pair
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.batch import BatchRequest, answer, parse_request, server_client

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Tucson", "Phoenix"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "forecast", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                 "additionalProperties": False}}]


@pytest.fixture(scope="module")
def url():
    target, _ = demo_pair()
    llm = LLM(model=target, mode="ar")
    with serve_on_loopback(create_app(llm, ServerOptions("demo"))) as base:
        yield base
    llm.shutdown()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "demo", **body}, timeout=120)


def events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/responses", json={"model": "demo", "stream": True, **body}, timeout=120) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


# ---- run-batch ------------------------------------------------------------------------------------------
def batch_line(custom_id, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body})


def test_a_line_nested_too_deeply_is_that_lines_error_and_the_rest_run(url, tmp_path, capsys):
    """Old: json.loads raised RecursionError (only decode errors were caught), which left run_batch: the
    requests in flight were cancelled and not one record was written."""
    deep_body = '{"custom_id": "c", "method": "POST", "url": "/v1/responses", "body": {"input": ' + "[" * 50000 + \
        "]" * 50000 + "}}"
    lines = [batch_line("a", {"input": "hi", "max_output_tokens": 2}), "[" * 100000, deep_body,
             batch_line("d", {"input": "bye", "max_output_tokens": 2})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--url", url]) == 0
    records = [json.loads(r) for r in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["a", None, None, "d"]
    assert [r["response"]["status_code"] for r in (records[0], records[3])] == [200, 200]
    assert [r["error"]["message"] for r in records[1:3]] == ["line 2 is nested too deeply to read",
                                                             "line 3 is nested too deeply to read"]
    assert "4 requests, 2 failed" in capsys.readouterr().err


def test_a_body_too_deep_to_send_is_that_lines_error(url):
    """A line read near the recursion limit is written deeper (in its request's task): json.dumps raised there
    and ended the whole batch. Now that line's record says so."""
    body = []
    for _ in range(5000):
        body = [body]
    request = BatchRequest(7, "deep", "/v1/responses", {"input": body})
    record = asyncio.run(answer(server_client(url, None), request))
    assert record["custom_id"] == "deep" and record["response"] is None
    assert record["error"]["message"] == "line 7 is nested too deeply to send"


def test_a_custom_id_that_is_not_a_string_is_named_in_its_error():
    """OpenAI's and vLLM's custom_id is a string (vLLM's BatchRequestInput refuses 7): the error now says what
    was given, so the line is found."""
    for given, shown in ((7, "7"), (None, "null"), ([1], "an array")):
        request = parse_request(4, batch_line(given, {"input": "hi"}), set())
        assert request.error == f"line 4: custom_id must be a non-empty string, got {shown}"


def test_a_json_error_names_the_column_not_a_line_after_the_line_break():
    """Old: 'line 3 is not JSON: Expecting value: line 2 column 1' for a line of a CRLF (or LF) file: json
    counted the line's own break."""
    for ending in (b"\r\n", b"\n", b""):
        error = parse_request(3, b'{"custom_id": "bad", "url": ' + ending, set()).error
        assert error == "line 3 is not JSON: Expecting value at column 29"


# ---- /v1/responses input ---------------------------------------------------------------------------------
def test_a_function_call_output_may_be_text_parts(url):
    """OpenAI's function_call_output.output is a string or a list of parts; a list was a 400. The texts join
    a line apart, as a message's parts do."""
    call = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"}

    def usage(output):
        items = [{"role": "user", "content": "time?"}, call, {"type": "function_call_output", "call_id": "c1",
                                                              "output": output}]
        reply = post(url, "/responses", {"input": items, "max_output_tokens": 1, "tools": TOOLS,
                                         "tool_choice": "none"})
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["input_tokens"]
    parts = [{"type": "input_text", "text": "12:00"}, {"type": "input_text", "text": "UTC"}]
    assert usage(parts) == usage("12:00\nUTC") != usage("12:00UTC")


def test_an_image_in_a_function_call_output_is_refused_by_name(url):
    item = {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": "x"}]}
    error = post(url, "/responses", {"input": [item], "max_output_tokens": 1}).json()["error"]
    assert error["param"] == "input" and "output part 0 is of type 'input_image'" in error["message"]


@pytest.mark.parametrize("item, message", [
    ({"role": "user"}, "input.0.content: Field required"),
    ("hi", "input.0: must be an input item (an object)"),
    ({"type": "function_call_output", "output": "x"}, "input.0.call_id: Field required"),
    ({"role": "user", "content": [{"type": "input_text"}]}, "input.0.content.0.text: Field required"),
    ({"role": "user", "content": 5}, "input.0.content: must be a string or a list of text parts"),
])
def test_a_bad_item_error_names_its_own_problem(url, item, message):
    """Old: 'input.str: Input should be a valid string' (param input.str) for each: pydantic's first error was
    the string the list failed to be. Items are now told apart by their type (message when absent)."""
    reply = post(url, "/responses", {"input": [item], "max_output_tokens": 1})
    error = reply.json()["error"]
    assert reply.status_code == 400 and (error["message"], error["param"]) == (message, message.split(":")[0])


@pytest.mark.parametrize("fields, message, param", [
    ({"input": ""}, "input: must not be empty", "input"),
    ({"input": []}, "input: must not be empty", "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "t"}}},
     "text.format of type json_schema needs a schema", "text.format"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "web_search_preview"}},  # a built-in tool's choice
     "tool_choice: must be 'none', 'auto', 'required', {\"type\": \"function\", \"name\": ...} or "
     "{\"type\": \"allowed_tools\", \"mode\": ..., \"tools\": [...]}", "tool_choice"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice.tools: List should have at least 1 item after validation, not 0", "tool_choice.tools"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.name: Field required",
     "tool_choice.name"),
])
def test_errors_name_the_field(url, fields, message, param):
    """Old: "" was 'at least 1 item' (it is a string), the schema's error had no param, and tool_choice's param
    was "tool_choice.literal['none','auto','required']"."""
    reply = post(url, "/responses", {"max_output_tokens": 1, **fields})
    error = reply.json()["error"]
    assert reply.status_code == 400 and (error["message"], error["param"]) == (message, param)


# ---- the reply ----------------------------------------------------------------------------------------
def test_created_at_is_the_requests_start_in_every_event(url):
    """Old: each response body took int(time.time()) as it was built, so a stream's created_at changed from
    response.created to response.completed and the unstreamed one was the finish time."""
    started = int(time.time())
    stream = events(url, {"input": "x", "max_output_tokens": 480, "ignore_eos": True, "temperature": 0})
    arrived = int(time.time())
    stamps = {e["response"]["created_at"] for e in stream if "response" in e}
    assert len(stamps) == 1 and started <= stamps.pop() <= arrived
    created = [e for e in stream if e["type"] == "response.created"][0]["response"]["created_at"]
    assert stream[-1]["response"]["created_at"] == created


def _strip_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_required_calls_cut_by_max_tokens_match_the_stream_on_responses(url):
    """Old: unstreamed, the cut reply was one message holding the raw JSON array, while the stream had sent
    the function_call items it opened. Now both give those calls."""
    body = {"input": "weather?", "max_output_tokens": 60, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    whole = post(url, "/responses", body).json()
    final = events(url, body)[-1]["response"]
    assert whole["status"] == final["status"] == "incomplete"
    assert [i["type"] for i in whole["output"]] and {i["type"] for i in whole["output"]} == {"function_call"}
    assert _strip_ids(whole["output"]) == _strip_ids(final["output"])


def test_required_calls_cut_by_max_tokens_match_the_stream_on_chat(url):
    body = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 60, "tool_choice": "required",
            "tools": [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS],
            "temperature": 0}
    choice = post(url, "/chat/completions", body).json()["choices"][0]
    calls, content, finish = {}, "", None
    with httpx.stream("POST", f"{url}/chat/completions", json={"model": "demo", "stream": True, **body},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    content += ch["delta"].get("content") or ""
                    for d in ch["delta"].get("tool_calls") or []:
                        name, args = calls.get(d["index"], ("", ""))
                        calls[d["index"]] = (name + (d["function"].get("name") or ""),
                                             args + (d["function"].get("arguments") or ""))
                    finish = ch.get("finish_reason") or finish
    assert choice["finish_reason"] == finish == "length" and choice["message"]["content"] is None and not content
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert whole and whole == [calls[i] for i in sorted(calls)]
