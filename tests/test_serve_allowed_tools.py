"""OpenAI's tool_choice {"type": "allowed_tools", ...} (serve/allowed_tools.py): auto or required over a subset
of `tools`, on chat (nested form) and Responses (flat form). The pure plans, then real HTTP on loopback in
front of the demo pair's SSD engine, the constrained reply checked against ar and sd engines token for token."""
from __future__ import annotations

import json
from dataclasses import replace

import httpx
import jsonschema
import openai
import pytest
from test_serve_tools import MESSAGES, SCHEMAS, TOOL_MODELS, TOOLS, _streamed

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import demo_pair
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.openai_responses import ResponsesRequest
from saguaro_dist.serve.prompts import encode_chat
from saguaro_dist.serve.protocol import ChatCompletionRequest, ChatMessage
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.serve.tools import ToolChoiceKind

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # Responses' form of the same tools
CALL_TIME = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'  # hermes, forced


def chat_allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools",
            "allowed_tools": {"mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


def flat_allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "mode": mode, "tools": [{"type": "function", "name": n} for n in names]}


# ---- pure parts ---------------------------------------------------------------------------------
def test_required_over_a_subset_constrains_to_it_in_either_form():
    chat = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice=chat_allowed("required", "get_time")).tool_plan()
    flat = ResponsesRequest(input="x", tools=FLAT_TOOLS, tool_choice=flat_allowed("required", "get_time")).tool_plan()
    assert chat == flat and chat.kind is ToolChoiceKind.REQUIRED and chat.allowed == ("get_time",)
    assert [f["name"] for f in chat.functions] == ["get_weather", "get_time"]  # all still reach the template
    schema = json.loads(chat.structure().json)
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Tucson", "days": 2}}], schema)
    auto = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice=chat_allowed("auto", "get_time"))
    assert auto.tool_plan().kind is ToolChoiceKind.AUTO and auto.tool_plan().structure() is None


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_an_auto_call_outside_the_subset_is_text_streamed_or_not(piece):
    text = 'Checking. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    request = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice=chat_allowed("auto", "get_weather"))
    plan = replace(request.tool_plan(), parser=ToolCallParser.HERMES)
    assert plan.parse(text) == (text, []) and _streamed(plan, text, piece) == (text, [])
    allowed = replace(plan, allowed=("get_time",))
    content, calls = allowed.parse(text)
    assert content == "Checking. " and [c.name for c in calls] == ["get_time"]
    assert _streamed(allowed, text, piece)[0] == "Checking. "


@pytest.mark.parametrize("mode, names, message", [
    ("required", ("get_time", "rm"), "'rm', which is not among the tools"),
    ("auto", (), "at least 1"),
    ("none", ("get_time",), "'auto' or 'required'"),
])
def test_bad_allowed_tools_are_refused(mode, names, message):
    with pytest.raises(ValueError, match=message):
        ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice=chat_allowed(mode, *names))
    with pytest.raises(ValueError, match=message):
        ResponsesRequest(input="x", tools=FLAT_TOOLS, tool_choice=flat_allowed(mode, *names))


# ---- over HTTP ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    target, draft = demo_pair()
    llm = LLM(model=target, draft=draft, mode="ssd", k=4, draft_executor="thread")
    with serve_on_loopback(create_app(llm, ServerOptions("demo", tool_call_parser="hermes"))) as url:
        yield llm, openai.OpenAI(base_url=url, api_key="none", max_retries=0), url
    llm.shutdown()


def test_required_calls_only_the_subset_alike_in_every_mode(served):
    """Chat, whole and streamed: one get_time call whatever the model would rather write; the prompt is the
    full tools' (as plain "required"'s); ar, sd and ssd generate the same tokens under the constraint."""
    llm, client, _ = served
    body = dict(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice=chat_allowed("required", "get_time"),
                parallel_tool_calls=False, max_tokens=64, temperature=0)
    out = client.chat.completions.create(**body)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and out.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])
    chunks = list(client.chat.completions.create(stream=True, **body))
    deltas = [d for chunk in chunks for c in chunk.choices for d in (c.delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.id] == ["get_time"]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(**{**body, "tool_choice": "required"})
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens
    ids = encode_chat(llm.tokenizer, [ChatMessage(**m) for m in MESSAGES], TOOL_MODELS)
    request = ChatCompletionRequest(**{k: v for k, v in body.items() if k != "model"})
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=request.requested_structure())
    ssd = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert request.tool_plan().parse(ssd.text)[1][0].arguments == call.function.arguments
    assert ssd.metrics.drafted_tokens > 0  # the draft spoke, under the same constraint
    target, draft = demo_pair()
    for mode in ("ar", "sd"):
        with LLM(model=target, draft=None if mode == "ar" else draft, mode=mode, k=4, draft_executor="thread") as other:
            assert other.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids == ssd.token_ids, mode


def test_auto_reads_only_calls_to_the_subset_over_http(served):
    """A regex makes the demo model write a hermes get_time call: a call when get_time is allowed, the
    reply's text when only get_weather is, streamed and not alike."""
    _, client, _ = served
    body = dict(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=64, temperature=0,
                extra_body={"structured_outputs": {"regex": CALL_TIME}})
    for names, called in ((("get_time",), True), (("get_weather",), False)):
        out = client.chat.completions.create(tool_choice=chat_allowed("auto", *names), **body)
        chunks = list(client.chat.completions.create(tool_choice=chat_allowed("auto", *names), stream=True, **body))
        message, streamed = out.choices[0].message, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if c.choices]
        if called:
            assert [c.function.name for c in message.tool_calls] == [d.function.name for d in calls] == ["get_time"]
            assert out.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            assert not message.tool_calls and not calls and message.content.startswith("<tool_call>")
            assert out.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
        assert streamed == (message.content or "")


def test_responses_required_over_a_subset(served):
    _, client, url = served
    body = dict(model="demo", input="def forecast(city):", tools=FLAT_TOOLS, max_output_tokens=64, temperature=0,
                parallel_tool_calls=False, tool_choice=flat_allowed("required", "get_time"))
    resp = client.responses.create(**body)
    (call,) = resp.output
    assert (call.type, call.name) == ("function_call", "get_time") and resp.tool_choice.mode == "required"
    events = list(client.responses.create(stream=True, **body))
    assert [(i.name, i.arguments) for i in events[-1].response.output] == [(call.name, call.arguments)]
    bad = httpx.post(f"{url}/responses", json={**body, "tool_choice": flat_allowed("auto", "rm")}, timeout=30)
    assert bad.status_code == 400 and "'rm', which is not among the tools" in bad.json()["error"]["message"]
    bad = httpx.post(f"{url}/chat/completions", json={"model": "demo", "messages": MESSAGES, "tools": TOOLS,
                                                      "tool_choice": chat_allowed("auto", "rm")}, timeout=30)
    assert bad.status_code == 400 and "'rm', which is not among the tools" in bad.json()["error"]["message"]


def test_without_parallel_calls_only_the_first_call_is_checked_against_the_subset():
    """parallel_tool_calls false keeps the first call: a second one outside the subset, cut anyway, turned the
    whole reply into text."""
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    request = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False,
                                    tool_choice=chat_allowed("auto", "get_weather"))
    plan = replace(request.tool_plan(), parser=ToolCallParser.HERMES)
    assert [c.name for c in plan.parse(text)[1]] == ["get_weather"]
    assert [c["function"]["name"] for c in _streamed(plan, text, 4)[1] if "name" in c.get("function", {})] == \
        ["get_weather"]
