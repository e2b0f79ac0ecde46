"""Tool calling on /v1/chat/completions: the pure parts (schemas, the hermes parser, the streamed deltas)
and the real thing — the serving app under uvicorn on loopback in front of the demo pair's SSD engine,
spoken to by the `openai` client and our SDK."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.cli import main
from saguaro_dist.client import Client
from saguaro_dist.demo import demo_pair
from saguaro_dist.sampling_params import StructuredOutputsParams
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.app import build_app, server_options
from saguaro_dist.serve.prompts import encode_chat, render_chat
from saguaro_dist.serve.protocol import ChatCompletionRequest, ChatMessage, Tool
from saguaro_dist.serve.tool_parsers import ToolCallParser, parse_hermes, parse_llama3_json, parse_mistral
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan, ToolStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Tucson", "Phoenix"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "MST"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOL_MODELS = [Tool(**t) for t in TOOLS]
MESSAGES = [{"role": "user", "content": "def forecast(city):"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# ---- pure parts ---------------------------------------------------------------------------------
def _plan(**fields) -> ToolPlan:
    return ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, **fields).tool_plan()


def test_named_and_required_constrain_to_the_functions_schemas():
    named = _plan(tool_choice=NAMED)
    assert named.kind is ToolChoiceKind.NAMED and json.loads(named.structure().json) == WEATHER
    schema = json.loads(_plan(tool_choice="required").structure().json)
    calls = [{"name": "get_time", "parameters": {"zone": "MST"}}, {"name": "get_weather", "parameters": {"city": "Tucson", "days": 2}}]
    jsonschema.validate(calls, schema)
    for bad in ([], [{"name": "get_time", "parameters": {"city": "Tucson", "days": 2}}], [{"name": "rm", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(_plan(tool_choice="required", parallel_tool_calls=False).structure().json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls, one)
    assert _plan().kind is ToolChoiceKind.AUTO and _plan().structure() is None  # OpenAI's default with tools
    assert _plan(tool_choice="none").structure() is None


def test_required_reply_becomes_calls_and_a_cut_reply_stays_text():
    plan = _plan(tool_choice="required")
    content, calls = plan.parse('[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    assert plan.finish_reason("stop", calls) == "tool_calls" and plan.finish_reason("length", calls) == "length"
    assert plan.parse('[{"name": "get_ti') == ('[{"name": "get_ti', [])
    assert _plan(tool_choice=NAMED).finish_reason("stop", calls) == "stop"  # a forced call ends as OpenAI's: stop


def test_a_required_call_opens_when_its_name_is_written_and_its_arguments_stream():
    plan = _plan(tool_choice="required")
    reply = '[{"name": "get_time", "parameters": {"zone": "a \\"}\\" b"}}, {"name": "get_weather", "parameters": {}}]'
    stream, deltas, opened_at = ToolStream(plan), [], {}
    for end in range(0, len(reply), 4):
        for d in stream.step(reply[end:end + 4], end + 4 >= len(reply)).get("tool_calls", []):
            deltas.append(d)
            opened_at.setdefault(d["index"], end + 4)
    assert opened_at[0] < reply.index(' b"}}')  # opened while its arguments were still being written
    args = ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i) for i in (0, 1)]
    _, whole = plan.parse(reply)
    assert args == [c.arguments for c in whole] == ['{"zone": "a \\"}\\" b"}', "{}"]
    assert [c.name for c in stream.calls] == ["get_time", "get_weather"] and len(deltas) > 4
    cut = ToolStream(plan)  # max_tokens before any call opened: the text, as the unstreamed reply gives it
    assert cut.step('[{"name": "get_ti', True) == {"content": '[{"name": "get_ti'} and not cut.calls


H, L, M = parse_hermes, parse_llama3_json, parse_mistral


@pytest.mark.parametrize("parse, text, content, calls", [
    (H, "no calls here", "no calls here", []),
    (H, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', None, [("get_time", {"zone": "UTC"})]),
    (H, 'Let me look. <tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": [1]}}',
     "Let me look. ", [("a", {}), ("b", {"x": [1]})]),  # the last block may lack its close tag (EOS came first)
    (H, '<tool_call>{"name": "a", "argu', '<tool_call>{"name": "a", "argu', []),  # broken JSON stays text
    (H, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (H, '<tool_call>{"name": "w", "arguments": {"s": "a </tool_call> b"}}</tool_call>', None,
     [("w", {"s": "a </tool_call> b"})]),  # the close tag inside the JSON: read as JSON, not cut there
    (H, '<tool_call>{"name": "a", "arguments": {}} trailing</tool_call>', '<tool_call>{"name": "a", "arguments": {}} '
     'trailing</tool_call>', []),  # text after the JSON inside a block: not a call
    (L, '{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
    (L, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}\n', None,
     [("a", {}), ("b", {"x": 1})]),  # Llama writes "parameters"; "arguments" is read too
    (L, 'Sure: {"name": "a", "parameters": {}}', 'Sure: {"name": "a", "parameters": {}}', []),  # calls open the reply
    (L, '{"name": "a", "parameters": {}} and more', '{"name": "a", "parameters": {}} and more', []),
    (L, '{"name": "a", "param', '{"name": "a", "param', []),  # cut short
    (L, '{"city": "Tucson"}', '{"city": "Tucson"}', []),  # JSON that is not a call
    (L, '[1, 2]', '[1, 2]', []),
    (M, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [("get_time", {"zone": "UTC"})]),
    (M, 'Let me check.[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1]}}]',
     "Let me check.", [("a", {}), ("b", {"x": [1]})]),
    (M, '[TOOL_CALLS]{"name": "a", "arguments": {}}', None, [("a", {})]),  # one object, no list
    (M, 'no calls', 'no calls', []),
    (M, '[TOOL_CALLS][{"name": "a", "argu', '[TOOL_CALLS][{"name": "a", "argu', []),
    (M, '[TOOL_CALLS][]', '[TOOL_CALLS][]', []),
])
def test_parsers(parse, text, content, calls):
    got_content, got = parse(text)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls
    if parse is M:
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got)  # Mistral's templates refuse other ids


def test_only_a_parser_whose_marker_is_a_special_token_keeps_special_tokens():
    params = SamplingParams()
    for parser in ToolCallParser:
        plan = ToolPlan(ToolChoiceKind.AUTO, ({"name": "a"},), parser=parser)
        assert plan.adjust(params).skip_special_tokens is (parser not in (ToolCallParser.MISTRAL, ToolCallParser.OPENAI))
    assert ToolPlan(ToolChoiceKind.REQUIRED, ({"name": "a"},), parser=ToolCallParser.MISTRAL).adjust(params) == params


def _streamed(plan: ToolPlan, text: str, piece: int) -> tuple[str, list[dict]]:
    """Feed `text` in pieces; the content and the tool-call deltas that come out."""
    stream, content, calls = ToolStream(plan), "", []
    for start in range(0, len(text), piece):
        delta = stream.step(text[start:start + piece], start + piece >= len(text))
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    return content, calls


@pytest.mark.parametrize("piece", [1, 2, 5, 11, 1000])
@pytest.mark.parametrize("parser, marker, call", [
    (ToolCallParser.HERMES, "<tool_call>", '<tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call>'),
    (ToolCallParser.MISTRAL, "[TOOL_CALLS]", '[TOOL_CALLS][{"name": "a", "arguments": {"k": 1}}]'),
])
def test_auto_streams_content_and_holds_back_what_may_start_a_call(piece, parser, marker, call):
    plan = ToolPlan(ToolChoiceKind.AUTO, ({"name": "a"},), parser=parser)
    lead = f"x < y {marker[:5]} "
    content, calls = _streamed(plan, lead + call, piece)
    assert content == lead and len(calls) == 1 and calls[0]["index"] == 0
    assert calls[0]["function"] == {"name": "a", "arguments": '{"k": 1}'} and calls[0]["type"] == "function"
    assert _streamed(plan, f"ends with {marker[:7]}", piece) == (f"ends with {marker[:7]}", [])  # held, then released
    assert _streamed(plan, f'{marker}{{"nam', piece) == (f'{marker}{{"nam', [])


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_llama3_json_streams_a_reply_that_does_not_open_with_a_call(piece):
    plan = ToolPlan(ToolChoiceKind.AUTO, ({"name": "a"},), parser=ToolCallParser.LLAMA3_JSON)
    content, calls = _streamed(plan, ' \n<|python_tag|>{"name": "a", "parameters": {"k": 1}}', piece)
    assert content == "" and [c["function"] for c in calls] == [{"name": "a", "arguments": '{"k": 1}'}]
    assert _streamed(plan, "Sure: {} is empty", piece) == ("Sure: {} is empty", [])
    assert _streamed(plan, ' {"city": "Tucson"}', piece) == (' {"city": "Tucson"}', [])  # held to the end: not a call
    assert _streamed(plan, "<|python", piece) == ("<|python", [])
    stream = ToolStream(plan)  # text streams as soon as it cannot open a call
    assert stream.step(" Su", False) == {"content": " Su"} and stream.step('{"name"', False) == {"content": '{"name"'}


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_named_streams_the_arguments_as_they_come(piece):
    text = '{"city": "Tucson", "days": 3}'
    content, calls = _streamed(_plan(tool_choice=NAMED), text, piece)
    assert content == "" and calls[0]["function"]["name"] == "get_weather" and "id" in calls[0]
    assert all("id" not in c and c["index"] == 0 for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == text


def test_tools_reach_the_chat_template_and_history_calls_are_mappings():
    target, _ = demo_pair()
    tok = AutoTokenizer.from_pretrained(target)
    history = [ChatMessage(**m) for m in [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tucson", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "hot"}]]
    plain, templated = render_chat(tok, history, TOOL_MODELS)
    assert not templated and plain.splitlines()[0] == f"Tools: {json.dumps(TOOLS)}"
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Tucson", "days": 1}}</tool_call>' in plain
    assert "Tool: hot" in plain and plain.endswith("Assistant:")
    tok.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                         "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                         "call {{ c.function.name }} days={{ c.function.arguments.days }}{% endfor %};{% endfor %}")
    text, templated = render_chat(tok, history, TOOL_MODELS)
    assert templated and text == "[get_weather][get_time]user:weather?;assistant:call get_weather days=1;tool:hot;"


@pytest.mark.parametrize("fields, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "rm"}}}, "not among the tools"),
    ({"tools": None, "tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "distinct"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "pattern"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]},
     "only assistant"),
])
def test_bad_tool_requests_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ChatCompletionRequest(**{"messages": MESSAGES, "tools": TOOLS, **fields})


# ---- over HTTP ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    """One SSD engine behind two apps: one with the hermes parser (tool_choice auto works), one without."""
    target, draft = demo_pair()
    llm = LLM(model=target, draft=draft, mode="ssd", k=4, draft_executor="thread")
    with serve_on_loopback(create_app(llm, ServerOptions("demo", tool_call_parser="hermes"))) as hermes, \
            serve_on_loopback(create_app(llm, ServerOptions("demo"))) as plain:
        yield llm, openai.OpenAI(base_url=hermes, api_key="none", max_retries=0), \
            openai.OpenAI(base_url=plain, api_key="none", max_retries=0), hermes
    llm.shutdown()


def _engine_text(llm, messages, schema: dict) -> str:
    """What the engine itself generates for the rendered chat under the schema: the tool call's source."""
    ids = encode_chat(llm.tokenizer, [ChatMessage(**m) for m in messages], TOOL_MODELS)
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema))
    return llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].text


def test_named_tool_choice_calls_that_function_with_valid_arguments(served):
    llm, client, _, _ = served
    out = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                         max_tokens=64, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert call.function.arguments == _engine_text(llm, MESSAGES, WEATHER)
    streamed = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                              max_tokens=64, temperature=0, stream=True)
    deltas = [d for chunk in streamed for c in chunk.choices for d in (c.delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_required_tool_choice_calls_given_functions(served):
    """The demo model repeats its call until max_tokens unless held to one (parallel_tool_calls false) or
    penalised for repeating itself (then it calls both functions and closes the list)."""
    llm, client, _, _ = served
    for parallel, penalty in ((False, 0.0), (True, 1.0)):
        out = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=parallel, frequency_penalty=penalty, max_tokens=96,
                                             temperature=0)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        names = [call.function.name for call in choice.message.tool_calls]
        assert len(names) == 1 if not parallel else set(names) == set(SCHEMAS)
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed = list(client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                   frequency_penalty=1.0, max_tokens=96, temperature=0, stream=True))
    deltas = [d for chunk in streamed for c in chunk.choices for d in (c.delta.tool_calls or [])]
    opened = [(d.index, d.function.name) for d in deltas if d.id]  # a call opens with its id and name ...
    arguments = ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i, _ in enumerate(opened)]
    assert opened == [(i, c.function.name) for i, c in enumerate(choice.message.tool_calls)]
    assert arguments == [c.function.arguments for c in choice.message.tool_calls]  # ... its arguments follow
    # Whether a call's arguments arrive in one delta or several depends on how the server batches deltas by
    # time (a loaded machine may see the whole reply at once), so that is tested on ToolStream itself above.
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_auto_needs_a_parser_and_plain_text_stays_content(served):
    _, client, plain, _ = served
    with pytest.raises(openai.BadRequestError, match="tool-call-parser"):
        plain.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=8)
    none = plain.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         max_tokens=8, temperature=0)
    auto = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0)
    streamed = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                              temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed)
    assert "<tool_call>" not in auto.choices[0].message.content  # the demo model knows nothing of tools
    assert auto.choices[0].message.content == none.choices[0].message.content == text
    assert not auto.choices[0].message.tool_calls and auto.choices[0].finish_reason == "length"


FORCED_CALLS = {  # a regex that makes the demo model write one call in each family's syntax
    "hermes": r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>',
    "llama3_json": r'\{"name": "get_time", "parameters": \{"zone": "UTC"\}\}',
    "mistral": r'Checking\.\[TOOL_CALLS\]\[\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\]',
}


@pytest.mark.parametrize("parser", sorted(FORCED_CALLS))
def test_each_parser_reads_its_familys_calls_over_http(served, parser):
    """tool_choice auto with a regex that writes the family's syntax (a model that knows no tools has to be
    told what to say): the server's parser turns the reply into a call, whole and streamed."""
    llm = served[0]
    with serve_on_loopback(create_app(llm, ServerOptions("demo", tool_call_parser=parser))) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        body = dict(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=64, temperature=0,
                    extra_body={"structured_outputs": {"regex": FORCED_CALLS[parser]}})
        out = client.chat.completions.create(**body)
        chunks = list(client.chat.completions.create(stream=True, **body))
    (call,) = out.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"zone": "UTC"})
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.content == ("Checking." if parser == "mistral" else None)
    streamed = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []] if chunks else []
    assert [(c.function.name, c.function.arguments) for c in streamed] == [("get_time", call.function.arguments)]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == (out.choices[0].message.content or "")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_tool_results_goes_on(served):
    _, client, _, _ = served
    history = MESSAGES + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Tucson", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert out.choices[0].message.content is not None and out.usage.completion_tokens == 4


@pytest.mark.parametrize("extra, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "rm"}}}, "not among the tools"),
    ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{zone"}}]}]}, "JSON text"),
])
def test_bad_tool_requests_get_a_400(served, extra, message):
    _, client, _, _ = served
    body = {"model": "demo", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(**body)
    assert client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2).choices[0].message.content is not None


def test_sdk_returns_tool_calls(served):
    _, _, _, base_url = served
    with Client(base_url) as sdk:
        done = sdk.chat(MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64, temperature=0)
        assert done.tool_calls[0]["function"]["name"] == "get_weather"
        stream = sdk.chat(MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64, temperature=0, stream=True)
        assert "".join(stream) == ""  # no content: the call is all there is
        assert [c["function"] for c in stream.tool_calls] == [c["function"] for c in done.tool_calls]


def test_tokenize_renders_the_tools_as_chat_does(served):
    llm, _, _, base_url = served
    body = {"messages": MESSAGES, "tools": TOOLS}
    got = httpx.post(base_url.removesuffix("/v1") + "/tokenize", json=body, timeout=30).json()
    assert got["tokens"] == encode_chat(llm.tokenizer, [ChatMessage(**m) for m in MESSAGES], TOOL_MODELS)
    assert got["tokens"] != encode_chat(llm.tokenizer, [ChatMessage(**m) for m in MESSAGES])


def test_the_parser_option_is_checked_where_it_is_given(capsys):
    assert server_options({"tool_call_parser": "hermes"}, "m").tool_call_parser == "hermes"
    assert server_options({}, "m").tool_call_parser is None
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        build_app({"model": "m", "draft": "d", "tool_call_parser": "xml"})  # at deploy time, not in a replica
    with pytest.raises(SystemExit):
        main(["serve", "--tool-call-parser", "xml"])
    assert "invalid choice" in capsys.readouterr().err


def test_llm_chat_renders_as_the_server_does(served):
    """LLM.chat (vLLM's offline API) gives the text the chat endpoint gives for the same conversation."""
    llm, client, _, _ = served
    params = SamplingParams(temperature=0, max_tokens=8)
    over_http = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                               max_tokens=8, temperature=0)
    one, two = llm.chat([MESSAGES, MESSAGES + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]],
                        params, tools=TOOLS)
    assert one.text == over_http.choices[0].message.content and two.text is not None
    assert llm.chat(MESSAGES, params, tools=TOOLS)[0].text == one.text
    with pytest.raises(ValueError, match="tool_call_id"):
        llm.chat([{"role": "tool", "content": "x"}], params)
    with pytest.raises(ValueError, match="not be empty"):
        llm.chat([], params)
