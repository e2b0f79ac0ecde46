"""Review s88 of tool calling: each test failed before its fix. tool_choice "required" keeps each function's
"#..." references meaning what they mean under a named choice; the mistral parser reads v11+ calls
([TOOL_CALLS]name[ARGS]{...}) and a pre-v11 list followed by text, whole and streamed alike; a named or
required choice's constraint refused with ignore_eos / min_tokens names tool_choice, not structured_outputs.
Real HTTP (the serving app under uvicorn on loopback, the demo model) where a request's path matters."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.demo import demo_pair
from saguaro_dist.engine.structured import GrammarCompiler
from saguaro_dist.sampling_params import SamplingParams
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.protocol import ChatCompletionRequest
from saguaro_dist.serve.tool_parsers import ToolCallParser, parse_mistral
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan, ToolStream

MESSAGES = [{"role": "user", "content": "def f(x):"}]
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
RECURSIVE = {"type": "object", "properties": {"all": {"type": "array", "items": {"$ref": "#"}}},
             "additionalProperties": False}
SAME_AS_A = {"type": "object", "properties": {"a": DIGIT, "b": {"$ref": "#/properties/a"}}, "required": ["a", "b"],
             "additionalProperties": False}
DRAFT7 = {"type": "object", "properties": {"p": {"$ref": "#/definitions/P"}}, "required": ["p"],
          "definitions": {"P": {"type": "string", "enum": ["x"]}}}
LOOKS_LIKE_A_REF = {"type": "object", "properties": {"k": {"const": {"$ref": "#/x"}}, "default": {"$ref": "#/$defs/D"}},
                    "required": ["k"], "$defs": {"D": DIGIT}}  # data that looks like a reference; a keyword's name


def _tools(**parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": p}} for name, p in parameters.items()]


def _required_schema(**parameters) -> dict:
    request = ChatCompletionRequest(messages=MESSAGES, tools=_tools(**parameters), tool_choice="required")
    return json.loads(request.tool_plan().structure().json)


@pytest.fixture(scope="module")
def served():
    """One engine (the demo model, ar) behind a mistral-parser app and a plain one."""
    target, _ = demo_pair()
    llm = LLM(model=target, mode="ar")
    with serve_on_loopback(create_app(llm, ServerOptions("demo", tool_call_parser="mistral"))) as mistral, \
            serve_on_loopback(create_app(llm, ServerOptions("demo"))) as plain:
        yield {"llm": llm, "mistral": mistral, "plain": plain}
    llm.shutdown()


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json={"model": "demo", "messages": MESSAGES, "temperature": 0,
                                                       **body}, timeout=120)


def _sse_chunks(reply: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in reply.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# ---- required: each function's parameters keep their own root ----------------------------------------------
def test_required_reads_root_references_against_the_functions_parameters():
    """Old: the parameters were inlined in the calls array's schema, so "#" meant the array and
    "#/properties/a" pointed nowhere."""
    schema = _required_schema(q=RECURSIVE, w=SAME_AS_A, d=DRAFT7, k=LOOKS_LIKE_A_REF)
    jsonschema.validate([{"name": "q", "parameters": {"all": [{"all": []}]}},
                         {"name": "w", "parameters": {"a": 1, "b": 2}}, {"name": "d", "parameters": {"p": "x"}},
                         {"name": "k", "parameters": {"k": {"$ref": "#/x"}}}], schema)
    for wrong in ({"name": "q", "parameters": {"all": [[{"name": "q", "parameters": {}}]]}},
                  {"name": "w", "parameters": {"a": 1, "b": "2"}}, {"name": "d", "parameters": {"p": "y"}},
                  {"name": "k", "parameters": {"k": {"$ref": "#/x"}, "default": 10}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([wrong], schema)


def grammar_accepts(tok, spec, text: str) -> bool:
    """Whether the grammar of `spec` (StructuredOutputsParams) takes `text` whole, then the end."""
    state = GrammarCompiler(tok, len(tok), {tok.eos_token_id}).state(SamplingParams(structured_outputs=spec))
    for token in tok.encode(text, add_special_tokens=False):
        if not bool(state.mask()[token]):
            return False
        state.commit(token)
    return bool(state.mask()[tok.eos_token_id])


def test_a_recursive_tool_is_followed_by_the_grammar_under_required(served):
    tok = served["llm"].tokenizer
    spec = ChatCompletionRequest(messages=MESSAGES, tools=_tools(q=RECURSIVE), tool_choice="required").requested_structure()

    def allowed(text: str) -> bool:
        return grammar_accepts(tok, spec, text)

    assert allowed('[{"name": "q", "parameters": {"all": [{"all": []}]}}]')
    assert not allowed('[{"name": "q", "parameters": {"all": [[{"name": "q", "parameters": {}}]]}}]')


def test_required_calls_a_tool_whose_parameters_point_into_themselves(served):
    """Old: a 400 "structured_outputs is not valid: Pointer '/properties/a' does not exist"."""
    body = {"tools": _tools(w=SAME_AS_A), "tool_choice": "required", "max_tokens": 40, "parallel_tool_calls": False}
    reply = _post(served["plain"], body)
    assert reply.status_code == 200, reply.text
    (call,) = reply.json()["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SAME_AS_A)
    deltas = [d for c in _sse_chunks(_post(served["plain"], {**body, "stream": True})) for ch in c["choices"]
              for d in ch["delta"].get("tool_calls") or []]
    assert "".join(d["function"].get("arguments") or "" for d in deltas) == call["function"]["arguments"]


# ---- mistral: v11+ calls, and a pre-v11 list followed by text ----------------------------------------------
@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", '{"city": "Paris"}')]),
    ('Sure.[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}', "Sure.",
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ('[TOOL_CALLS]a[ARGS]{"x": {"y": [1]}}\n[TOOL_CALLS]b[ARGS]{}\n', None, [("a", '{"x": {"y": [1]}}'), ("b", "{}")]),
    ('[TOOL_CALLS][{"name": "a", "arguments": {}}] ', None, [("a", "{}")]),
    ('[TOOL_CALLS][{"name": "a", "arguments": {"k": 1}}]\n\nDone.', None, [("a", '{"k": 1}')]),  # vLLM: tail left out
    ('[TOOL_CALLS]a{"x": ', '[TOOL_CALLS]a{"x": ', []),  # cut short: the text
    ('[TOOL_CALLS]a{} and more', '[TOOL_CALLS]a{} and more', []),  # text after the arguments: the text
    ('[TOOL_CALLS]a', '[TOOL_CALLS]a', []),
    ('[TOOL_CALLS][ARGS]{}', '[TOOL_CALLS][ARGS]{}', []),  # no name
    ('x[TOOL_CALLS]a{}[TOOL_CALLS]b', 'x[TOOL_CALLS]a{}[TOOL_CALLS]b', []),
])
def test_mistral_reads_v11_calls_and_a_list_followed_by_text(text, content, calls):
    got_content, got = parse_mistral(text)
    assert got_content == content and [(c.name, c.arguments) for c in got] == calls
    assert all(len(c.id) == 9 and c.id.isalnum() for c in got)  # Mistral's templates refuse other ids
    plan = ToolPlan(ToolChoiceKind.AUTO, ({"name": "a"},), parser=ToolCallParser.MISTRAL)
    for piece in (1, 2, 3, 7, 1000):  # streamed: what the whole reply gives, in pieces
        stream, streamed, deltas = ToolStream(plan), "", []
        for start in range(0, len(text), piece):
            delta = stream.step(text[start:start + piece], start + piece >= len(text))
            streamed, deltas = streamed + delta.get("content", ""), deltas + delta.get("tool_calls", [])
        assert streamed == (content or "")
        assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == calls
        assert [d["index"] for d in deltas] == list(range(len(calls)))


def test_mistral_v11_calls_over_http_whole_and_streamed(served):
    """A regex has the demo model write two v11 calls after some content, as a Hugging Face tokenizer
    decodes them ([ARGS] kept)."""
    forced = r'Checking\.\[TOOL_CALLS\]get_time\[ARGS\]\{"zone": "UTC"\}\[TOOL_CALLS\]get_date\{\}'
    body = {"tools": _tools(get_time={"type": "object"}, get_date={"type": "object"}), "max_tokens": 64,
            "structured_outputs": {"regex": forced}}
    choice = _post(served["mistral"], body).json()["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert calls == [("get_time", '{"zone": "UTC"}'), ("get_date", "{}")]
    assert choice["message"]["content"] == "Checking." and choice["finish_reason"] == "tool_calls"
    chunks = _sse_chunks(_post(served["mistral"], {**body, "stream": True}))
    deltas = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls") or []]
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == calls
    assert "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]) == "Checking."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---- a tool choice's constraint refused: named as the tool choice ------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice, setting, message", [
    ({"type": "function", "function": {"name": "w"}}, {"ignore_eos": True}, "tool_choice 'w' cannot be combined with ignore_eos"),
    ("required", {"min_tokens": 2}, "tool_choice 'required' cannot be combined with min_tokens"),
])
def test_a_tool_choice_that_cannot_hold_with_a_setting_is_a_400_naming_tool_choice(served, stream, choice, setting,
                                                                                   message):
    """Old: "structured_outputs cannot be combined with ...", param structured_outputs, never sent."""
    reply = _post(served["plain"], {"tools": _tools(w=SAME_AS_A), "tool_choice": choice, "max_tokens": 8,
                                    "stream": stream, **setting})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == message and reply.json()["error"]["param"] == "tool_choice"


def test_a_tool_schema_that_does_not_compile_is_a_400_naming_tools(served):
    bad = _tools(w={"type": "objekt"})
    reply = _post(served["plain"], {"tools": bad, "tool_choice": {"type": "function", "function": {"name": "w"}},
                                    "max_tokens": 8})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
    assert reply.json()["error"]["message"].startswith("the tools' parameters are not valid: ")
    plain = _post(served["plain"], {"structured_outputs": {"json": {"type": "object"}}, "ignore_eos": True,
                                    "max_tokens": 8})  # asked for by the client: named as it was asked
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "structured_outputs"
