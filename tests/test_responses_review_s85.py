"""Review fixes on /v1/responses (session 85), over real HTTP: a gpt-oss reply's messages as items in order,
whole and streamed alike (vLLM's harmony path); tool_choice "auto" without tools; an empty call_id; the item a
max_output_tokens cut ends is incomplete (OpenAI's); a bad constraint's 400 naming text.format or tools."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import httpx
import pytest
from http_helpers import serve_on_loopback
from test_serve_harmony import _forced, save_harmony_model
from test_serve_responses import TOOLS, served  # noqa: F401 - the demo model's module fixture

from saguaro_dist import LLM
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.openai_responses import ResponseEvents, ResponsesRequest
from saguaro_dist.serve.openai_responses_output import HarmonyReply
from saguaro_dist.serve.tool_parsers import ToolCallParser

NEXT = "<|end|><|start|>assistant"
INTERLEAVED = ("<|channel|>analysis<|message|>think1" + NEXT + "<|channel|>commentary<|message|>preamble" + NEXT
               + "<|channel|>analysis<|message|>think2" + NEXT + '<|channel|>commentary to=functions.f <|constrain|>json'
               '<|message|>{"a": 1}<|call|>')
# vLLM's harmony path: each message its own item, in the reply's order, no "\n" joining them
IN_ORDER = [("reasoning", "think1"), ("message", "preamble"), ("reasoning", "think2"), ("function_call", '{"a": 1}')]
F_TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]


def _shape(items: list[dict]) -> list[tuple[str, str]]:
    return [(i["type"], i["arguments"] if i["type"] == "function_call" else i["content"][0]["text"]) for i in items]


def _events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/responses", json={**body, "stream": True}, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        return [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/responses", json={"model": "demo", **body}, timeout=120)


# ---- 1. a gpt-oss reply's messages -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def harmony_url(tmp_path_factory):
    llm = LLM(model=save_harmony_model(tmp_path_factory.mktemp("harmony_model")), mode="ar")
    app = create_app(llm, ServerOptions("gpt", reasoning_parser="openai_gptoss", tool_call_parser="openai"))
    with serve_on_loopback(app) as url:
        yield url
    llm.shutdown()


def test_harmony_messages_are_items_in_order_whole_and_streamed(harmony_url):
    """Old: whole [reasoning 'think1\\nthink2', message, call], streamed [reasoning 'think1', message,
    reasoning '\\nthink2', call]."""
    body = {"model": "gpt", "input": "x", "tools": F_TOOLS, "max_output_tokens": 600, "temperature": 0,
            "structured_outputs": {"grammar": _forced(INTERLEAVED)}}
    whole = httpx.post(f"{harmony_url}/responses", json=body, timeout=120).json()
    events = _events(harmony_url, body)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert _shape(whole["output"]) == _shape(events[-1]["response"]["output"]) == _shape(done) == IN_ORDER
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == [t for t, _ in IN_ORDER]


def test_each_message_of_a_whole_reply_carries_its_own_tokens_logprobs(harmony_url):
    """Unstreamed, the reply is fed as a per-token stream is: a message's item carries the logprob entries of
    the tokens up to its text (its channel's markers, reasoning before it), never a later message's tokens. Old: the
    reply fed whole put all 73 entries on 'preamble' and none on 'answer'."""
    text = ("<|channel|>analysis<|message|>think1" + NEXT + "<|channel|>commentary<|message|>preamble" + NEXT
            + "<|channel|>final<|message|>answer<|return|>")
    body = {"model": "gpt", "input": "x", "max_output_tokens": 600, "temperature": 0,
            "include": ["message.output_text.logprobs"], "structured_outputs": {"grammar": _forced(text)}}
    whole = httpx.post(f"{harmony_url}/responses", json=body, timeout=120).json()
    messages = [i["content"][0] for i in whole["output"] if i["type"] == "message"]
    assert [m["text"] for m in messages] == ["preamble", "answer"]
    spelled = ["".join(e["token"] for e in m["logprobs"]) for m in messages]
    assert spelled[0].endswith("preamble") and "answer" not in spelled[0], spelled
    assert "answer" in spelled[1] and "preamble" not in spelled[1], spelled


def _run(body: dict, pieces: list[str], finish: str = "stop") -> tuple[list[dict], list[dict]]:
    """A reply's items unstreamed and streamed in `pieces` (the route's HarmonyReply, an openai parser server's)."""
    request = ResponsesRequest.model_validate({"model": "m", **body})
    plan = replace(request.tool_plan(), parser=ToolCallParser.OPENAI, harmony=True)
    whole_reply = HarmonyReply.of(ResponseEvents("r", "m", request, 0), plan)
    whole_reply.feed("".join(pieces), True)
    whole_reply.events.finish(finish)
    whole = whole_reply.events.items
    events = ResponseEvents("r", "m", request, 0)
    reply, out = HarmonyReply.of(events, plan), events.opening()
    for i, piece in enumerate(pieces):
        out += reply.feed(piece, i == len(pieces) - 1)
    out += events.closing(finish)
    return whole, [json.loads(line[6:]) for line in out.splitlines() if line.startswith("data: ")][-1]["response"]["output"]


@pytest.mark.parametrize("body, text, want", [
    ({"input": "x", "tools": F_TOOLS}, INTERLEAVED, IN_ORDER),
    ({"input": "x"}, INTERLEAVED, IN_ORDER[:3]),  # no tools: the call left out
    ({"input": "x", "tools": F_TOOLS, "include_reasoning": False}, INTERLEAVED, IN_ORDER[1::2]),
    ({"input": "x"}, "<|channel|>analysis<|message|>a" + NEXT + "<|channel|>analysis<|message|>b" + NEXT
     + "<|channel|>commentary<|message|>c" + NEXT + "<|channel|>final<|message|>d<|return|>",
     [("reasoning", "a"), ("reasoning", "b"), ("message", "c"), ("message", "d")]),
])
def test_any_cut_of_a_harmony_reply_gives_its_whole_items(body, text, want):
    rng = random.Random(0)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        whole, streamed = _run(body, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
        assert _shape(whole) == _shape(streamed) == want


def test_a_harmony_reply_cut_short_ends_with_an_incomplete_item():
    whole, streamed = _run({"input": "x", "tools": F_TOOLS}, [INTERLEAVED[:60], INTERLEAVED[60:100]], "length")
    assert [i["status"] for i in whole] == [i["status"] for i in streamed] == ["completed", "incomplete"]


# ---- 2-5 on the demo model ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [{"tool_choice": "auto"}, {"tool_choice": "auto", "tools": []}, {}])
def test_auto_without_tools_is_a_reply_without_calls(served, extra):  # noqa: F811
    """Old: 400 "tool_choice needs tools" (vLLM's ResponsesRequest defaults to auto with no tools)."""
    url = served[3]
    body = {"input": "def add(a, b):", "max_output_tokens": 4, "temperature": 0, **extra}
    reply = _post(url, body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["tool_choice"] == "auto" and [i["type"] for i in reply.json()["output"]] == ["message"]
    assert _events(url, {"model": "demo", **body})[-1]["response"]["tool_choice"] == "auto"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_a_choice_that_calls_still_needs_tools(served, choice):  # noqa: F811
    reply = _post(served[3], {"input": "hi", "tool_choice": choice})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize("item", [{"type": "function_call_output", "call_id": "", "output": "x"},
                                  {"type": "function_call", "call_id": "", "name": "get_time", "arguments": "{}"}])
def test_an_empty_call_id_is_named(served, item):  # noqa: F811
    """Old: the output's 400 was a pydantic dump of ChatMessage.tool_call_id, param null; the call's was a 200."""
    reply = _post(served[3], {"input": [{"role": "user", "content": "a"}, item], "tools": TOOLS})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input.1.call_id"


def test_the_item_a_cut_ends_is_incomplete_whole_and_streamed(served):  # noqa: F811
    """Old: the message said completed in an incomplete response."""
    url = served[3]
    body = {"model": "demo", "input": "class Stack:", "max_output_tokens": 3, "temperature": 0}
    whole = _post(url, body).json()
    events = _events(url, body)
    done = [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"]
    assert whole["status"] == events[-1]["response"]["status"] == "incomplete"
    assert [i["status"] for i in whole["output"]] == [i["status"] for i in events[-1]["response"]["output"]] == done \
        == ["incomplete"]
    finished = _post(url, {**body, "max_output_tokens": 20, "structured_outputs": {"regex": "ok"}}).json()  # ends
    assert finished["status"] == "completed" and [i["status"] for i in finished["output"]] == ["completed"]


BAD = {"type": "object", "properties": {"a": {"type": "bogus"}}}


@pytest.mark.parametrize("extra, param", [
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD}}}, "text.format"),
    ({"tools": [{"type": "function", "name": "f", "parameters": BAD}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": BAD}], "tool_choice": {"type": "function", "name": "f"}},
     "tools"),
    ({"structured_outputs": {"json": BAD}}, "structured_outputs"),  # named as given
])
def test_a_bad_constraint_names_the_field_that_asked_for_it(served, extra, param):  # noqa: F811
    """Old: param structured_outputs for all of them."""
    for stream in (False, True):
        reply = _post(served[3], {"input": "a", "max_output_tokens": 2, "stream": stream, **extra})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
        assert reply.json()["error"]["message"].startswith(f"{param} is not valid")


@pytest.mark.parametrize("guided", [{"guided_regex": "a+"}, {"guided_choice": ["x", "y"]}])
def test_a_format_and_a_guided_field_are_refused_together(served, guided):  # noqa: F811
    """Old: a 200 whose text followed text.format and silently dropped the guided_* constraint (chat refuses
    response_format beside guided_* with the same 400)."""
    reply = _post(served[3], {"input": "a", "max_output_tokens": 2, "text": {"format": {"type": "json_object"}}, **guided})
    assert reply.status_code == 400 and "asked for once" in reply.json()["error"]["message"], reply.text


def test_a_response_validates_as_the_openai_sdks_response(served):  # noqa: F811
    """Old: openai's ResponseUsage requires input_tokens_details.cache_write_tokens (openai >= 3.6x); strict
    validation of our Response failed there (the SDK itself builds without validating, so clients did not see it)."""
    from openai.types.responses import Response
    whole = _post(served[3], {"model": "demo", "input": "class Stack:", "max_output_tokens": 3}).json()
    assert Response.model_validate(whole).usage.input_tokens_details.cache_write_tokens == 0
