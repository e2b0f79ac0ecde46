"""Second review of session 88's serving fixes; each test failed before its fix. tool_choice "required" gives each
function's parameters their own schema resource ($id), so plain-name anchors ("#A") and references under a
nested $id resolve as under a named choice (rewriting every "#..." broke both); a parsed call whose name is not
a non-empty string leaves the reply as content, whole and streamed alike (was a 200 with name 5, and a 500
mid-stream); /v1/responses names tool_choice for a tool choice's constraint clash, as chat does; min_tokens is
held to the client's max_tokens (an echo's max_tokens 0 took min_tokens 1); BeamSearchParams and SamplingParams
take numpy / torch values (ints, floats, bools, sets and generators of ids, nested 0-d object arrays).
Real HTTP (the serving app under uvicorn on loopback, the demo model) where a request's path matters."""
from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import pytest
import torch

from saguaro_dist import SamplingParams
from saguaro_dist.engine.beam_search import BeamSearchParams
from saguaro_dist.engine.structured import GrammarCompiler
from saguaro_dist.serve.protocol import ChatCompletionRequest
from saguaro_dist.serve.tool_parsers import ToolCall, ToolCallParser
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan, ToolStream
from test_tools_review_s88 import (  # noqa: F401
    MESSAGES, SAME_AS_A, _post, _sse_chunks, _tools, grammar_accepts, served,
)

ANCHORED = {"type": "object", "properties": {"a": {"$ref": "#A"}}, "required": ["a"], "additionalProperties": False,
            "$defs": {"A": {"$anchor": "A", "type": "integer"}}}
OWN_ID = {"$id": "https://example.com/p.json", "type": "object", "properties": {"a": {"$ref": "#/$defs/D"}},
          "required": ["a"], "additionalProperties": False, "$defs": {"D": {"type": "integer"}}}
NESTED_ID = {"type": "object", "properties": {"a": {"$id": "http://x/y", "type": "object", "properties": {
    "b": {"$ref": "#/properties/c"}, "c": {"type": "integer"}}, "required": ["b"], "additionalProperties": False}},
    "required": ["a"], "additionalProperties": False}
FULL_REF = {"$id": "https://example.com/q.json", "type": "object",  # its own $id kept: a reference may name it
            "properties": {"s": {"$ref": "https://example.com/q.json#/$defs/S"}}, "required": ["s"],
            "additionalProperties": False, "$defs": {"S": {"type": "string"}}}
SAME_ID = {**OWN_ID, "$defs": {"D": {"type": "boolean"}}}  # OWN_ID's $id again: its "#..." still mean its own


def _required(**parameters):
    return ChatCompletionRequest(messages=MESSAGES, tools=_tools(**parameters), tool_choice="required")


def _calls(*pairs) -> str:
    return json.dumps([{"name": name, "parameters": arguments} for name, arguments in pairs])


# ---- required: each function's parameters are a schema resource of their own -------------------------------
GOOD = [("x", {"a": 1}), ("o", {"a": 2}), ("n", {"a": {"b": 3}}), ("f", {"s": "t"}), ("d", {"a": True})]
BAD = [("x", {"a": "q"}), ("o", {"a": "q"}), ("n", {"a": {"b": "q"}}), ("f", {"s": 1}), ("d", {"a": 1})]


def test_required_resolves_anchors_and_nested_ids_as_a_named_choice_does(served):  # noqa: F811
    """Old: "#A" became "#/$defs/tool_0A" and a nested $id's "#/properties/c" pointed at the array's root:
    'structured_outputs is not valid: Pointer ... does not exist' (a named choice took both)."""
    spec = _required(x=ANCHORED, o=OWN_ID, n=NESTED_ID, f=FULL_REF, d=SAME_ID).requested_structure()
    schema = json.loads(spec.json)
    tok = served["llm"].tokenizer
    compiler = GrammarCompiler(tok, len(tok), {tok.eos_token_id})
    compiler.check(SamplingParams(structured_outputs=spec))

    def allowed(text: str) -> bool:
        return grammar_accepts(tok, spec, text)

    for good, bad in zip(GOOD, BAD):
        assert allowed(_calls(good)) and not allowed(_calls(bad)), good
        jsonschema.validate(json.loads(_calls(good)), schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(_calls(bad)), schema)


def test_required_calls_an_anchored_tool_over_http(served):  # noqa: F811
    """Old: a 400 naming tools (a named choice of the same tool: 200)."""
    body = {"tools": _tools(w=ANCHORED), "tool_choice": "required", "max_tokens": 40, "parallel_tool_calls": False}
    reply = _post(served["plain"], body)
    assert reply.status_code == 200, reply.text
    (call,) = reply.json()["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), ANCHORED)


# ---- a call's name must be a non-empty string --------------------------------------------------------------
@pytest.mark.parametrize("parser, text", [
    (ToolCallParser.MISTRAL, '[TOOL_CALLS][{"name": 5, "arguments": {}}]'),
    (ToolCallParser.MISTRAL, '[TOOL_CALLS]{"name": "", "arguments": {}}'),
    (ToolCallParser.HERMES, '<tool_call>{"name": 5, "arguments": {}}</tool_call>'),
    (ToolCallParser.HERMES, '<tool_call>{"name": ["a"], "arguments": {}}</tool_call>'),
    (ToolCallParser.LLAMA3_JSON, '{"name": {"a": 1}, "parameters": {}}'),
    (ToolCallParser.LLAMA3_JSON, '{"name": null, "parameters": {}}'),
])
def test_a_call_without_a_string_name_leaves_the_reply_as_content(parser, text):
    """Old: a call named 5 (or None, a list, ...) went out, and a stream died in plain_delta."""
    assert parser.parse(text) == (text, [])
    plan = ToolPlan(ToolChoiceKind.AUTO, ({"name": "a"},), parser=parser)
    stream = ToolStream(plan)
    deltas = [stream.step(text[i:i + 3], i + 3 >= len(text)) for i in range(0, len(text), 3)]
    assert "".join(d.get("content", "") for d in deltas) == text and not any(d.get("tool_calls") for d in deltas)
    with pytest.raises(TypeError):
        ToolCall.new(5, {})


@pytest.mark.parametrize("name", ["5", "null", '""'])
def test_a_call_without_a_string_name_over_http_whole_and_streamed(served, name):  # noqa: F811
    """Old: 200 with tool_calls named 5 whole; streamed, a 500 (AttributeError in plain_delta) mid-stream."""
    text = '[TOOL_CALLS][{"name": %s, "arguments": {}}]' % name
    body = {"tools": _tools(a={"type": "object"}), "max_tokens": 40,
            "structured_outputs": {"regex": text.replace("[", r"\[").replace("]", r"\]").replace("{", r"\{")
                                   .replace("}", r"\}")}}
    whole = _post(served["mistral"], body)
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert message["content"] == text and not message.get("tool_calls")
    streamed = _post(served["mistral"], {**body, "stream": True})
    assert streamed.status_code == 200 and "error" not in streamed.text, streamed.text
    chunks = _sse_chunks(streamed)
    assert "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]) == text
    assert not any(ch["delta"].get("tool_calls") for c in chunks for ch in c["choices"])


# ---- /v1/responses: a tool choice's clash names tool_choice, as chat's ------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice, setting, message", [
    ({"type": "function", "name": "w"}, {"ignore_eos": True}, "tool_choice 'w' cannot be combined with ignore_eos"),
    ("required", {"min_tokens": 2}, "tool_choice 'required' cannot be combined with min_tokens"),
    ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "w"}]}, {"min_tokens": 2},
     "tool_choice 'allowed_tools (required)' cannot be combined with min_tokens"),
])
def test_responses_names_tool_choice_for_a_clash(served, stream, choice, setting, message):  # noqa: F811
    """Old: "tools cannot be combined with min_tokens", param tools."""
    reply = httpx.post(f"{served['plain']}/responses", json={
        "model": "demo", "input": "a", "tools": [{"type": "function", "name": "w", "parameters": SAME_AS_A}],
        "tool_choice": choice, "max_output_tokens": 8, "stream": stream, **setting}, timeout=120)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"] == message and reply.json()["error"]["param"] == "tool_choice"


# ---- min_tokens against the client's max_tokens ------------------------------------------------------------
def test_an_echo_with_max_tokens_0_refuses_min_tokens(served):  # noqa: F811
    """Old: a 200 for min_tokens 1 (the engine's max_tokens is 1 for a scores-only echo), a 400 for 2."""
    body = {"model": "demo", "prompt": "a", "echo": True, "max_tokens": 0}
    for least in (1, 2):
        reply = httpx.post(f"{served['plain']}/completions", json={**body, "min_tokens": least}, timeout=120)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"] == {**reply.json()["error"], "param": "min_tokens",
                                         "message": f"min_tokens must be at most max_tokens (0), got {least}"}
    scored = httpx.post(f"{served['plain']}/completions", json={**body, "min_tokens": 0}, timeout=120)
    assert scored.status_code == 200 and scored.json()["choices"][0]["text"] == "a", scored.text


# ---- numpy / torch values offline --------------------------------------------------------------------------
def test_beam_search_params_take_numpy_and_torch_numbers():
    """Old: np.int64 beam_width and np.float32 length_penalty refused (np.float64, a float subclass, passed)."""
    params = BeamSearchParams(beam_width=np.int64(2), max_tokens=torch.tensor(3), temperature=np.float32(0.5),
                              length_penalty=np.float32(0.5), ignore_eos=np.True_,
                              include_stop_str_in_output=torch.tensor(False))
    assert (params.beam_width, params.max_tokens, params.temperature, params.length_penalty) == (2, 3, 0.5, 0.5)
    assert [type(v) for v in (params.beam_width, params.length_penalty, params.ignore_eos)] == [int, float, bool]
    assert params.ignore_eos is True and params.include_stop_str_in_output is False
    for bad in ({"beam_width": np.float32(2.0)}, {"length_penalty": np.float32("nan")}, {"ignore_eos": np.int64(1)}):
        with pytest.raises(ValueError):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 3, **bad})


@pytest.mark.parametrize("name", ["ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"])
def test_sampling_params_flags_take_numpy_and_torch_bools(name):
    for value, plain in ((np.True_, True), (np.False_, False), (torch.tensor(True), True), (torch.tensor(False), False),
                         (np.array(np.True_, dtype=object), True)):
        got = getattr(SamplingParams(**{name: value}), name)
        assert got is plain, (value, got)
    for bad in (np.int64(1), torch.tensor(1), "false"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: bad})


def test_sampling_params_take_token_id_sets_generators_and_nested_object_arrays():
    """Old: a set or generator of np.int64 ids, and a 0-d object array holding np.float32, were refused."""
    params = SamplingParams(stop_token_ids={np.int64(1)}, allowed_token_ids=(np.int64(t) for t in (2, 4)),
                            temperature=np.array(np.float32(0.5), dtype=object))
    assert params.stop_token_ids == (1,) and params.allowed_token_ids == (2, 4) and params.temperature == 0.5
    assert [type(t) for t in params.stop_token_ids + params.allowed_token_ids] == [int, int, int]
    assert type(params.temperature) is float
    for bad in ({"stop_token_ids": np.int64(3)}, {"stop_token_ids": {np.True_}}, {"allowed_token_ids": "12"},
                {"stop_token_ids": {1: 2}}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
