"""Review of the tool-call and reasoning parsers, chat messages and the Responses API against OpenAI's and
vLLM's rules: each fix's test failed before it (a few cases guard what must not change). Real HTTP (the serving app under uvicorn on loopback,
the demo model, the `openai` client or httpx); the parsers' own pieces where no model writes the text."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.demo import demo_pair
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.protocol import ChatCompletionRequest
from saguaro_dist.serve.reasoning import ReasoningParser, ReasoningStream, split_reasoning

MESSAGES = [{"role": "user", "content": "def f(x):"}]
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
POINT = {"type": "object", "properties": {"x": DIGIT, "y": DIGIT},
         "required": ["x", "y"], "additionalProperties": False}
# what pydantic writes for a model with a nested model: the nested one under $defs, reached by "$ref"
PLACE = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"],
         "additionalProperties": False, "$defs": {"Point": POINT}}
MOVE = {"type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"],
        "additionalProperties": False, "$defs": {"Point": POINT}}
DEFS_TOOLS = [{"type": "function", "function": {"name": "place", "parameters": PLACE}},
              {"type": "function", "function": {"name": "move", "parameters": MOVE}}]
TOOLS = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}}]
# makes the demo model (which knows no tools) write some content and two hermes calls
TWO_CALLS = (r'Hi <tool_call>\{"name": "a", "arguments": \{"x": 1\}\}</tool_call>\n'
             r'<tool_call>\{"name": "b", "arguments": \{\}\}</tool_call>')
TURNS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")
ITEMS_TEMPLATE = ("{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}"
                  "{% for k, v in c.function.arguments|items %}{{ k }}={{ v }}{% endfor %}{% endfor %}\n{% endfor %}")


@pytest.fixture(scope="module")
def served():
    """One engine (the demo model, ar) behind a hermes-parser app, a plain app and one with a template that
    walks a history call's arguments as Qwen3-Coder's does."""
    target, _ = demo_pair()
    llm = LLM(model=target, mode="ar")
    with serve_on_loopback(create_app(llm, ServerOptions("demo", tool_call_parser="hermes"))) as hermes, \
            serve_on_loopback(create_app(llm, ServerOptions("demo"))) as plain, \
            serve_on_loopback(create_app(llm, ServerOptions("demo", chat_template=ITEMS_TEMPLATE))) as walking, \
            serve_on_loopback(create_app(llm, ServerOptions("demo", chat_template=TURNS_TEMPLATE))) as turns:
        yield {"hermes": hermes, "plain": plain, "walking": walking, "turns": turns}
    llm.shutdown()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "demo", **body}, timeout=120)


# ---- tool_choice required with tools whose parameters use $defs ---------------------------------------
def test_required_calls_a_tool_whose_parameters_use_defs(served):
    """Old: the functions' parameters were nested in the required array's schema with their "$defs" left
    inside, so "#/$defs/Point" pointed nowhere: a 400 "Pointer '/$defs/Point' does not exist" for any
    pydantic-made tool. vLLM moves the definitions to the root; so does this server now."""
    client = _client(served["plain"])
    body = dict(model="demo", messages=MESSAGES, tools=DEFS_TOOLS, tool_choice="required", max_tokens=48,
                temperature=0, parallel_tool_calls=False)
    out = client.chat.completions.create(**body)
    (call,) = out.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in DEFS_TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert out.choices[0].finish_reason == "tool_calls"
    deltas = [d for chunk in client.chat.completions.create(stream=True, **body) for c in chunk.choices
              for d in c.delta.tool_calls or []]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_required_tools_may_define_one_name_differently(served):
    """Was a 400 (their $defs were merged at the root); each function's parameters now keep their own $defs."""
    other = {**MOVE, "$defs": {"Point": {"type": "string"}}}
    tools = [DEFS_TOOLS[0], {"type": "function", "function": {"name": "move", "parameters": other}}]
    reply = _post(served["plain"], "/chat/completions", {"messages": MESSAGES, "tools": tools,
                                                         "tool_choice": "required", "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    schema = json.loads(ChatCompletionRequest(messages=MESSAGES, tools=tools, tool_choice="required")
                        .tool_plan().structure().json)
    jsonschema.validate([{"name": "move", "parameters": {"to": "b2"}},
                         {"name": "place", "parameters": {"at": {"x": 1, "y": 2}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "place", "parameters": {"at": "b2"}}], schema)


def test_the_required_schema_leaves_the_tools_as_given():
    request = ChatCompletionRequest(messages=MESSAGES, tools=DEFS_TOOLS, tool_choice="required")
    plan = request.tool_plan()
    schema = json.loads(plan.structure().json)
    assert schema["$defs"]["tool_0"]["$defs"] == {"Point": POINT} and plan.structure() == plan.structure()
    assert all("$defs" in f["parameters"] for f in plan.functions)  # not popped from the request's tools
    jsonschema.validate([{"name": "place", "parameters": {"at": {"x": 1, "y": 2}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "place", "parameters": {"at": {"x": "1", "y": 2}}}], schema)


# ---- tool_choice auto with parallel_tool_calls false ----------------------------------------------------
def test_auto_with_parallel_tool_calls_false_returns_one_call(served):
    """Old: a reply with two hermes calls came back with both, whole and streamed, and as two function_call
    items on /v1/responses, although the request said parallel_tool_calls false (vLLM keeps the first)."""
    client = _client(served["hermes"])
    body = dict(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=0,
                extra_body={"structured_outputs": {"regex": TWO_CALLS}})
    both = client.chat.completions.create(**body).choices[0]
    assert [c.function.name for c in both.message.tool_calls] == ["a", "b"]  # parallel_tool_calls true (default)
    one = client.chat.completions.create(parallel_tool_calls=False, **body).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in one.message.tool_calls] == [("a", {"x": 1})]
    assert one.finish_reason == "tool_calls" and one.message.content == "Hi "
    chunks = list(client.chat.completions.create(parallel_tool_calls=False, stream=True, **body))
    streamed = [d for chunk in chunks for c in chunk.choices for d in c.delta.tool_calls or []]
    assert [(d.index, d.function.name) for d in streamed] == [(0, "a")] and streamed[0].id
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    responses = {"input": "def f(x):", "max_output_tokens": 80, "temperature": 0, "parallel_tool_calls": False,
                 "tools": [{"type": "function", "name": "a"}, {"type": "function", "name": "b"}],
                 "structured_outputs": {"regex": TWO_CALLS}}
    output = _post(served["hermes"], "/responses", responses).json()["output"]
    assert [(i["type"], i.get("name")) for i in output] == [("message", None), ("function_call", "a")]


# ---- chat messages ----------------------------------------------------------------------------------
@pytest.mark.parametrize("content, kind", [
    ([{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}], "image_url"),
    ([{"type": "text", "text": "what is this?"}, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
     "input_audio"),
])
def test_a_part_that_is_not_text_is_refused_by_name(served, content, kind):
    """Old: 400 "messages.0.content.str: Input should be a valid string" (param messages.0.content.str),
    which names neither the part nor what is wrong with it."""
    reply = _post(served["plain"], "/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                         "max_tokens": 2})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "messages.0.content"
    assert kind in error["message"] and "text parts only" in error["message"]


def test_a_message_without_content_is_refused_unless_the_assistants(served):
    """Old: {"role": "user"} (or content null) was taken as an empty turn; OpenAI requires content on every
    message but an assistant's (which may carry tool_calls instead)."""
    for message in ({"role": "user"}, {"role": "system", "content": None},
                    {"role": "tool", "tool_call_id": "c1"}):
        reply = _post(served["plain"], "/chat/completions", {"messages": [message], "max_tokens": 2})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"] == f"messages.0: a message with role {message['role']!r} needs content"
    history = MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "a", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": ""}]
    assert _post(served["plain"], "/chat/completions", {"messages": history, "max_tokens": 2}).status_code == 200


def test_text_parts_are_joined_a_line_apart(served):
    """Old: [{"text": "import os"}, {"text": "import sys"}] became "import osimport sys"; vLLM joins a
    message's text parts with newlines. Chat and Responses alike."""
    url = served["plain"].removesuffix("/v1")

    def tokens(content):
        return httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": content}]}).json()["tokens"]
    parts = [{"type": "text", "text": "import os"}, {"type": "text", "text": "import sys"}]
    assert tokens(parts) == tokens("import os\nimport sys") != tokens("import osimport sys")
    items = [{"role": "user", "content": [{"type": "input_text", "text": "import os"},
                                          {"type": "input_text", "text": "import sys"}]}]
    got = _post(served["plain"], "/responses", {"input": items, "max_output_tokens": 1}).json()
    assert got["usage"]["input_tokens"] == len(tokens("import os\nimport sys"))


PREFILLED = MESSAGES + [{"role": "assistant", "content": "    return"}]


def _root(url: str) -> str:
    return url.removesuffix("/v1")  # /tokenize is vLLM's, beside /v1


def _chat_tokens(url: str, messages: list, **fields) -> list[int]:
    reply = _post(_root(url), "/tokenize", {"messages": messages, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def _text_tokens(url: str, text: str, special: bool) -> list[int]:
    return _post(_root(url), "/tokenize", {"prompt": text, "add_special_tokens": special}).json()["tokens"]


def test_how_a_transcript_ends_follows_add_generation_prompt_and_continue_final_message(served):
    """vLLM's add_generation_prompt / continue_final_message (both were dropped, then refused): without a
    template the transcript opens an assistant turn, ends at the last message, or leaves it to be continued."""
    url = served["plain"]
    assert _chat_tokens(url, MESSAGES) == _text_tokens(url, "User: def f(x):\nAssistant:", True)
    assert _chat_tokens(url, MESSAGES, add_generation_prompt=False) == _text_tokens(url, "User: def f(x):", True)
    want = _text_tokens(url, "User: def f(x):\nAssistant:     return", True)
    assert _chat_tokens(url, PREFILLED, add_generation_prompt=False, continue_final_message=True) == want
    reply = _post(url, "/chat/completions", {"messages": PREFILLED, "max_tokens": 2, "add_generation_prompt": False,
                                             "continue_final_message": True})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(want)


def test_a_template_is_told_how_the_prompt_ends(served):
    url = served["turns"]
    assert _chat_tokens(url, MESSAGES) == _text_tokens(url, "<user>def f(x):</user><assistant>", False)
    assert _chat_tokens(url, MESSAGES, add_generation_prompt=False) == _text_tokens(url, "<user>def f(x):</user>", False)
    got = _chat_tokens(url, PREFILLED, add_generation_prompt=False, continue_final_message=True)
    assert got == _text_tokens(url, "<user>def f(x):</user><assistant>    return", False)  # left open


def test_continuing_the_final_message_and_opening_a_turn_at_once_is_refused(served):
    reply = _post(served["plain"], "/chat/completions", {"messages": PREFILLED, "max_tokens": 2,
                                                         "continue_final_message": True})
    assert reply.status_code == 400 and "add_generation_prompt" in reply.json()["error"]["message"]


def test_completions_echo_is_still_a_field(served):
    reply = _post(served["plain"], "/completions", {"prompt": "def f(x):", "max_tokens": 2, "echo": True})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"].startswith("def f(x):")


def test_a_history_calls_arguments_must_be_an_object(served):
    """Old: arguments "[1]" (JSON, not an object) reached the template, whose `arguments|items` raised a
    TypeError: a 500. Function arguments are a JSON object: now a 400 saying so."""
    history = MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "a", "arguments": "[1]"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    reply = _post(served["walking"], "/chat/completions", {"messages": history, "max_tokens": 2})
    assert reply.status_code == 400 and "arguments must be JSON text of an object" in reply.json()["error"]["message"]
    good = [*history[:1], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0],
                                                         "function": {"name": "a", "arguments": '{"k": 1}'}}]}, history[2]]
    assert _post(served["walking"], "/chat/completions", {"messages": good, "max_tokens": 2}).status_code == 200
    items = [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c1", "name": "a", "arguments": "7"},
             {"type": "function_call_output", "call_id": "c1", "output": "done"}]
    reply = _post(served["walking"], "/responses", {"input": items, "max_output_tokens": 2})
    assert reply.status_code == 400 and "JSON text of an object" in reply.json()["error"]["message"]


# ---- the Responses API's input ----------------------------------------------------------------------
@pytest.mark.parametrize("item, names", [
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://example.com/cat.png"}]}, "input_image"),
    ({"role": "tool", "content": "sunny"}, "function_call_output"),
    ({"type": "item_reference", "id": "msg_1"}, "item_reference"),
])
def test_responses_input_items_it_cannot_read_are_refused_by_name(served, item, names):
    """Old: each was a 400 "input.str: Input should be a valid string" (param input.str)."""
    reply = _post(served["plain"], "/responses", {"input": [item], "max_output_tokens": 2})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "input" and names in error["message"], reply.text


# ---- reasoning ----------------------------------------------------------------------------------
@pytest.mark.parametrize("piece", [1, 3, 1000])
@pytest.mark.parametrize("text, reasoning", [("<think>cut short by max_tokens", "cut short by max_tokens"),
                                             ("<think>", None), ("cut </thi", "cut </thi")])
def test_deepseek_r1_cut_before_think_closes_drops_the_open_tag_whole_or_streamed(text, reasoning, piece):
    """Old: a reply cut (max_tokens) before </think> that opened with <think> was reasoning "<think>cut ..."
    unstreamed but "cut ..." streamed in pieces; vLLM drops the tag. Now both drop it."""
    r1 = ReasoningParser.DEEPSEEK_R1
    assert split_reasoning(r1, text) == (reasoning, "")
    stream, streamed = ReasoningStream(r1), ""
    for start in range(0, len(text), piece):
        thought, content = stream.feed(text[start:start + piece], start + piece >= len(text))
        assert content == ""
        streamed += thought
    assert streamed == (reasoning or "")
