"""The qwen3_coder and pythonic tool-call parsers (vLLM's Qwen3CoderToolParser and PythonicToolParser): the
pure parsers, their streams, and the real thing — the serving app under uvicorn on loopback in front of the
demo pair's SSD engine, spoken to by the `openai` client, whole and streamed."""
from __future__ import annotations

import json

import openai
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.demo import demo_pair
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.app import server_options
from saguaro_dist.serve.protocol import ChatCompletionRequest
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.serve.tool_parsers_extra import parse_pythonic, parse_qwen3_coder, qwen_typed_value
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan, ToolStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"]}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "MST"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
FUNCTIONS = tuple(t["function"] for t in TOOLS)
MESSAGES = [{"role": "user", "content": "def forecast(city):"}]
QWEN_WEATHER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def _pairs(parsed) -> tuple[str | None, list]:
    content, calls = parsed
    return content, [(name, arguments) for name, arguments in calls]


# ---- qwen3_coder --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, content, calls", [
    (QWEN_WEATHER, None, [("get_weather", {"city": "Paris", "days": 3})]),  # days typed by the schema
    ("Let me check.\n" + QWEN_WEATHER + "\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
     "</function>\n</tool_call>", "Let me check.\n", [("get_weather", {"city": "Paris", "days": 3}),
                                                     ("get_time", {"zone": "UTC"})]),
    ("<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC", None, [("get_time", {"zone": "UTC"})]),  # EOS came first
    ("x <function=get_time>\n<parameter=zone>\nMST\n</parameter>\n</function>", "x ", [("get_time", {"zone": "MST"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan\nJose\n</parameter>\n</function>\n</tool_call>",
     None, [("get_weather", {"city": "San\nJose"})]),  # one newline around a value is the template's, not its
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>", None, [("get_time", {})]),
    ("no calls here", "no calls here", []),
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',  # hermes' JSON: not this family's
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', []),
    ("Hi <tool_call>\n<function=get_weather\n<parameter", "Hi <tool_call>\n<function=get_weather\n<parameter", []),
    ("<tool_call>\n<function=>\n</function></tool_call>", "<tool_call>\n<function=>\n</function></tool_call>", []),
])
def test_qwen3_coder_reads_calls_and_leaves_the_rest_content(text, content, calls):
    assert _pairs(parse_qwen3_coder(text, FUNCTIONS)) == (content, calls)


@pytest.mark.parametrize("value, schema, typed", [
    ("42", {"type": "string"}, "42"), ("42", {"type": "integer"}, 42), ("three", {"type": "integer"}, "three"),
    ("2.5", {"type": "number"}, 2.5), ("3.0", {"type": "number"}, 3), ("inf", {"type": "number"}, "inf"),
    ("True", {"type": "boolean"}, True), ("yes", {"type": "boolean"}, False),  # not true / false: false (vLLM's)
    ('{"a": [1, null]}', {"type": "object"}, {"a": [1, None]}), ("['a', 'b']", {"type": "array"}, ["a", "b"]),
    ("[1, 2", {"type": "array"}, "[1, 2"), ("null", {"type": "integer"}, None),
    ("null", {"type": "string"}, "null"), ("NULL", None, "NULL"),  # vLLM's newest: a string's "null" is text
    ("42", None, "42"),  # a parameter the function does not declare stays text
    ("42", {"description": "no type"}, "42"), ("5", {"type": ["integer", "null"]}, 5),  # other types: a literal
    ("{1, 2}", {"type": "set"}, "{1, 2}"),  # a literal with no JSON stays text
])
def test_qwen3_coder_types_each_value_by_its_schema(value, schema, typed):
    got = qwen_typed_value(value, schema)
    assert got == typed and type(got) is type(typed)


def test_qwen3_coder_types_by_the_named_functions_schema_only():
    text = "<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>"
    assert _pairs(parse_qwen3_coder(text, FUNCTIONS))[1] == [("get_weather", {"days": 3, "extra": "7"})]
    assert _pairs(parse_qwen3_coder(text))[1] == [("get_weather", {"days": "3", "extra": "7"})]  # no tools: text
    plan = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS).tool_plan()
    content, calls = ToolPlan(plan.kind, plan.functions, parser=ToolCallParser.QWEN3_CODER).parse(QWEN_WEATHER)
    assert content is None and json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}  # the request's tools
    assert calls[0].id.startswith("chatcmpl-tool-")


# ---- pythonic -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, calls", [
    ('[get_weather(city="Paris", days=3)]', [("get_weather", {"city": "Paris", "days": 3})]),
    ("[get_time(zone='UTC'), get_weather(city=\"Paris\", days=2), noop()]\n",
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Paris", "days": 2}), ("noop", {})]),
    ('[f(opts={"a": [1, {"b": "c"}], "n": None, "j": [true, false, null]}, x=-2.5, y=+1, z=[])]',
     [("f", {"opts": {"a": [1, {"b": "c"}], "n": None, "j": [True, False, None]}, "x": -2.5, "y": 1, "z": []})]),
    ("\n [f(a=1)] \n", [("f", {"a": 1})]),
])
def test_pythonic_reads_a_list_of_calls_with_literal_arguments(text, calls):
    assert _pairs(parse_pythonic(text)) == (None, calls)


@pytest.mark.parametrize("text", [
    "[f(x=y)]", "[f(x=1 + 2)]", "[f(x=g())]", "[f(1)]", "[f(**k)]", "[obj.method()]", "[f(x={1, 2})]",
    "[f(x=(1, 2))]", '[f(x=b"b")]', "[f(x={k: 1})]", "[f(x=lambda: 0)]", "[f(x=__import__('os'))]",
    'get_weather(city="Paris")', 'Sure: [f()]', "[]", "[f()] and more", "[1, 2]", '[f(x="Pa', "no calls",
])
def test_pythonic_refuses_anything_but_literal_calls(text):
    assert _pairs(parse_pythonic(text)) == (text, [])


# ---- streamed -----------------------------------------------------------------------------------
def _streamed(plan: ToolPlan, text: str, piece: int) -> tuple[str, list[dict]]:
    stream, content, calls = ToolStream(plan), "", []
    for start in range(0, len(text), piece):
        delta = stream.step(text[start:start + piece], start + piece >= len(text))
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    return content, calls


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_qwen3_coder_streams_content_until_the_calls_open(piece):
    plan = ToolPlan(ToolChoiceKind.AUTO, FUNCTIONS, parser=ToolCallParser.QWEN3_CODER)
    lead = "x < y <tool <func "
    content, calls = _streamed(plan, lead + QWEN_WEATHER, piece)
    assert content == lead and [(c["index"], c["function"]) for c in calls] == [
        (0, {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'})]
    bare = "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>"  # no <tool_call>: held too
    content, calls = _streamed(plan, "a " + bare, piece)
    assert content == "a " and [c["function"] for c in calls] == [{"name": "get_time", "arguments": '{"zone": "UTC"}'}]
    assert _streamed(plan, "ends <tool_ca", piece) == ("ends <tool_ca", [])  # held, then released
    cut = "<tool_call>\n<function=get"  # cut in the name: no call, the text (as unstreamed)
    assert _streamed(plan, cut, piece) == (cut, []) and parse_qwen3_coder(cut) == (cut, [])
    assert _streamed(plan, "<tool_call>\n{}", piece) == ("<tool_call>\n{}", [])


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_pythonic_streams_a_reply_that_does_not_open_with_a_list(piece):
    plan = ToolPlan(ToolChoiceKind.AUTO, FUNCTIONS, parser=ToolCallParser.PYTHONIC, parallel=False)
    content, calls = _streamed(plan, '[get_time(zone="UTC"), get_time(zone="MST")]', piece)
    assert content == "" and [c["function"] for c in calls] == [{"name": "get_time", "arguments": '{"zone": "UTC"}'}]
    assert _streamed(plan, "Sure [x] is a list", piece) == ("Sure [x] is a list", [])
    assert _streamed(plan, "[1] is a citation", piece) == ("[1] is a citation", [])  # held to the end: not calls
    stream = ToolStream(plan)  # text streams as soon as it cannot open the calls
    assert stream.step(" Su", False) == {"content": " Su"}


def test_the_parsers_are_server_options():
    assert server_options({"tool_call_parser": "qwen3_coder"}, "m").tool_call_parser == "qwen3_coder"
    assert ToolCallParser("pythonic") is ToolCallParser.PYTHONIC
    for parser in (ToolCallParser.QWEN3_CODER, ToolCallParser.PYTHONIC):  # their markers are plain text
        assert not parser.keeps_special_tokens


# ---- over HTTP ----------------------------------------------------------------------------------
FORCED = {  # a regex that makes the demo model write two calls in each family's syntax, after some content
    "qwen3_coder": (r"Checking\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nTucson\n</parameter>\n"
                    r"<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    r"<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
                    "Checking.\n"),
    "pythonic": (r'\[get_weather\(city="Tucson", days=3\), get_time\(zone="UTC"\)\]', None),
}


@pytest.fixture(scope="module")
def llm():
    target, draft = demo_pair()
    engine = LLM(model=target, draft=draft, mode="ssd", k=4, draft_executor="thread")
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("parser", sorted(FORCED))
def test_each_parser_reads_its_familys_calls_over_http(llm, parser):
    """tool_choice auto with a regex that writes the family's syntax: the server's parser turns the reply into
    typed calls (days is an integer by the request's schema), whole and streamed, finishing with tool_calls."""
    regex, content = FORCED[parser]
    with serve_on_loopback(create_app(llm, ServerOptions("demo", tool_call_parser=parser))) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        body = dict(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=256, temperature=0,
                    extra_body={"structured_outputs": {"regex": regex}})
        out = client.chat.completions.create(**body)
        chunks = list(client.chat.completions.create(stream=True, **body))
    calls = out.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Tucson", "days": 3}), ("get_time", {"zone": "UTC"})]
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content == content
    streamed = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == (content or "")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"



# ---- qwen3_coder as vLLM's newest parser reads it; arguments are strict JSON -------------------
def _strict_loads(arguments: str):
    """JSON.parse's reading: NaN / Infinity are not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not strict JSON")
    return json.loads(arguments, parse_constant=refuse)


@pytest.mark.parametrize("value, schema, typed", [
    ("null", {"type": "string"}, "null"), ("null", None, "null"), ("None", {"type": "text"}, "None"),  # text
    ("None", {"type": "integer"}, None), ("none", {"type": "object"}, None),  # Qwen3.5 writes null as None
    ("null", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),  # a nullable string
    ("None", {"type": ["string", "null"]}, None), ("null", {"type": "null"}, None),
])
def test_qwen3_coder_reads_null_as_text_where_the_parameter_is_text(value, schema, typed):
    got = qwen_typed_value(value, schema)
    assert got == typed and type(got) is type(typed)


NULLABLE_INT = {"anyOf": [{"type": "integer"}, {"type": "null"}]}


@pytest.mark.parametrize("value, schema, typed", [
    ("5", NULLABLE_INT, 5), ("five", NULLABLE_INT, "five"), ("5", {"type": ["integer", "null"]}, 5),
    ("5", {"anyOf": [{"type": "null"}, {"type": "number"}]}, 5), ("2.5", {"type": ["null", "number"]}, 2.5),
    ("true", {"type": ["boolean", "null"]}, True), ("true", {"anyOf": [{"type": "boolean"}, {"type": "null"}]}, True),
    ("42", {"type": ["string", "null"]}, "42"), ("42", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "42"),
    ('["a"]', {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}, ["a"]),
    ("7", {"anyOf": [{"description": "untyped"}]}, "7"),  # no typed option: a string
    ('"{\'k\': \'v\'}"', {"type": "object"}, {"k": "v"}),  # a quoted Python repr is read once more
    ("\"['a', 1]\"", {"type": "array"}, ["a", 1]), ('"x"', {"type": "object"}, "x"),
])
def test_qwen3_coder_types_a_nullable_union_by_its_first_non_null_type(value, schema, typed):
    got = qwen_typed_value(value, schema)
    assert got == typed and type(got) is type(typed)


STRICT = {"name": "f", "parameters": {"type": "object", "properties": {
    "o": {"type": "object"}, "a": {"type": "array"}, "n": {"type": "number"}, "t": {"type": "tuple"}}}}


@pytest.mark.parametrize("key, value", [
    ("o", '{"a": NaN}'), ("o", '{"a": Infinity}'), ("a", "[1e400]"), ("a", "[float('nan')]"), ("n", "1e400"),
    ("n", "nan"), ("t", "1e400"), ("t", "-1e999"), ("a", "[" + "9" * 5000 + "]"),
])
def test_qwen3_coder_keeps_as_text_what_strict_json_cannot_hold(key, value):
    text = f"<tool_call>\n<function=f>\n<parameter={key}>\n{value}\n</parameter>\n</function>\n</tool_call>"
    _, calls = ToolCallParser.QWEN3_CODER.parse(text, (STRICT,))
    assert _strict_loads(calls[0].arguments) == {key: value}


def _qwen(*parameters: tuple[str, str], name: str = "get_weather") -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


NESTED = _qwen(("zone", "UTC"), name="get_time")  # a whole call, as code about tool calls may hold one


@pytest.mark.parametrize("text, calls", [
    (_qwen(("city", "a </parameter> b")), [("get_weather", {"city": "a </parameter> b"})]),
    (_qwen(("city", "a </function> b </tool_call> then <tool_call> c"), ("days", "2")),
     [("get_weather", {"city": "a </function> b </tool_call> then <tool_call> c", "days": 2})]),
    (_qwen(("city", "code:\n" + NESTED + "\nend"), ("days", "3")) + "\n" + NESTED,
     [("get_weather", {"city": "code:\n" + NESTED + "\nend", "days": 3}), ("get_time", {"zone": "UTC"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n<parameter=days>\n2\n</parameter>\n"
     "</function>\n</tool_call>", [("get_weather", {"city": "Dallas", "days": 2})]),  # a missing </parameter>
    ("<tool_call><function=get_weather><parameter=city>Paris</parameter><parameter=days>3</parameter></function>"
     "</tool_call>", [("get_weather", {"city": "Paris", "days": 3})]),  # no newlines at all
    (_qwen(("city", "Rome")) + "\nThat was one. " + _qwen(("city", "Oslo")),  # text between the calls
     [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})]),
    (_qwen(("city", "Rome")) + "\nDone: </tool_call> ends a call.",  # a closing tag in the text after
     [("get_weather", {"city": "Rome"})]),
])
def test_qwen3_coder_reads_the_markup_structurally(text, calls):
    assert _pairs(parse_qwen3_coder(text, FUNCTIONS)) == (None, calls)
    assert _pairs(parse_qwen3_coder(text))[1][0][0] == calls[0][0]  # no schema: each name still read


def test_qwen3_coder_keeps_text_about_the_tags_and_unrendered_templates_as_content():
    about = "Wrap calls in <tool_call></tool_call>. "
    assert _pairs(parse_qwen3_coder(about + QWEN_WEATHER, FUNCTIONS)) == (
        about, [("get_weather", {"city": "Paris", "days": 3})])
    template = "<tool_call>\n<function={{ tool.name }}>\n</function>\n</tool_call>"  # not a call: content
    assert parse_qwen3_coder(template, FUNCTIONS) == (template, [])


@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_qwen3_coder_streams_a_value_holding_the_tags(piece):
    plan = ToolPlan(ToolChoiceKind.AUTO, FUNCTIONS, parser=ToolCallParser.QWEN3_CODER)
    text = "Here.\n" + _qwen(("city", "a </parameter> b"), ("days", "null"))
    content, calls = _streamed(plan, text, piece)
    assert content == "Here.\n" and [_strict_loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "a </parameter> b", "days": None}]


# ---- pythonic: arguments are strict JSON -------------------------------------------------------
def test_pythonic_keeps_a_number_json_cannot_hold_as_its_text():
    """vLLM writes 1e999 as Infinity, which JSON.parse refuses: the argument keeps its source text instead."""
    _, calls = ToolCallParser.PYTHONIC.parse("[f(x=1e999, y=[-1e999, 1], z=1.5, w={'k': 1e400})]")
    assert _strict_loads(calls[0].arguments) == {"x": "1e999", "y": "[-1e999, 1]", "z": 1.5, "w": "{'k': 1e400}"}
