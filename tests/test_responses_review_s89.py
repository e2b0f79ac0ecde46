"""Review fixes on /v1/responses (session 89), over real HTTP on the demo model: a streamed message keeps the
log-probabilities of the text held back before a call (as the unstreamed one does); an earlier output's refusal
part goes back in as its text (as chat reads it); function_call_arguments.done names its function (OpenAI's
event); an unknown `include` value's 400 names the field."""
from __future__ import annotations

import pytest
from http_helpers import serve_on_loopback
from test_responses_review_s85 import _events, _post  # the streamed events and the whole reply of /responses
from test_serve_responses import served  # noqa: F401 - the demo model's module fixture

from saguaro_dist.serve.api import ServerOptions, create_app

GET_TIME = [{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
CALL = r'<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'


@pytest.fixture(scope="module")
def hermes_url(served):  # noqa: F811
    with serve_on_loopback(create_app(served[0], ServerOptions("demo", tool_call_parser="hermes"))) as url:
        yield url


def test_a_streamed_message_before_a_call_keeps_every_tokens_logprobs(hermes_url):
    """Old: streamed, the message had the entries of its deltas' tokens only (4 of 32): those of the text held
    back while the call was written were dropped when the call opened; unstreamed it has all 32."""
    body = {"model": "demo", "input": "t?", "tools": GET_TIME, "max_output_tokens": 60, "temperature": 0,
            "include": ["message.output_text.logprobs"], "structured_outputs": {"regex": "before " + CALL}}
    whole = _post(hermes_url, body).json()
    events = _events(hermes_url, body)
    assert [i["type"] for i in whole["output"]] == ["message", "function_call"]
    expected = whole["output"][0]["content"][0]["logprobs"]
    assert len(expected) == whole["usage"]["output_tokens"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == expected
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == expected


def test_function_call_arguments_done_names_the_function(hermes_url):
    body = {"model": "demo", "input": "t?", "tools": GET_TIME, "max_output_tokens": 60, "temperature": 0,
            "tool_choice": {"type": "function", "name": "get_time"}}
    (done,) = [e for e in _events(hermes_url, body) if e["type"] == "response.function_call_arguments.done"]
    assert done["name"] == "get_time"


def test_an_earlier_outputs_refusal_goes_back_in_as_its_text(served):  # noqa: F811
    """OpenAI's output message may hold a refusal part; chat reads one as its text. Old: a 400 ("reads text
    parts only")."""
    url = served[3]
    said = {"role": "user", "content": "x"}
    refused = _post(url, {"input": [said, {"type": "message", "role": "assistant", "status": "completed", "content": [
        {"type": "refusal", "refusal": "no"}]}, said], "max_output_tokens": 4, "temperature": 0})
    as_text = _post(url, {"input": [said, {"role": "assistant", "content": "no"}, said], "max_output_tokens": 4,
                          "temperature": 0})
    assert refused.status_code == 200, refused.text
    assert refused.json()["output"][0]["content"][0]["text"] == as_text.json()["output"][0]["content"][0]["text"]
    assert refused.json()["usage"]["input_tokens"] == as_text.json()["usage"]["input_tokens"]


@pytest.mark.parametrize("item, message", [
    ({"role": "assistant", "content": [{"type": "refusal"}]}, "input.0.content.0.refusal: Field required"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "refusal", "refusal": "no"}]},
     "output part 0 is of type 'refusal'"),  # a function's output is its text, never a refusal
])
def test_a_bad_refusal_part_is_named(served, item, message):  # noqa: F811
    reply = _post(served[3], {"input": [item]})
    assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text


def test_an_unknown_include_names_the_field(served):  # noqa: F811
    """Old: the message named it but param was null (the check ran across fields)."""
    error = _post(served[3], {"input": "x", "include": ["message.output_text.logprobs", "x"]}).json()["error"]
    assert error["param"] == "include" and "'x'" in error["message"]
