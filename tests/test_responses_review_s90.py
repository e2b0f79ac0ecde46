"""Review fixes on /v1/responses (session 90), over real HTTP on the demo model: a json_schema text.format needs
its name (OpenAI's and vLLM's rule: the reply echoes the format, and the openai SDK's Response fails to validate
one without a name); a refusal part is an assistant's output, refused in a user, system or developer message."""
from __future__ import annotations

import pytest
from openai.types.responses import Response
from test_responses_review_s85 import _events, _post  # the streamed events and the whole reply of /responses
from test_serve_responses import SCHEMA, served  # noqa: F401 - the demo model's module fixture

REFUSAL = {"type": "refusal", "refusal": "no"}


def _ok(reply) -> Response:
    """A 200 reply, as the openai SDK's Response type reads it (strictly: a missing required field fails)."""
    assert reply.status_code == 200, reply.text
    return Response.model_validate(reply.json())


def _error(reply) -> dict:
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


# ---- 1. a json_schema format's name ------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_format_without_a_name_is_a_400_naming_it(served, stream):  # noqa: F811
    """Old: a 200 whose text.format had no name, which the openai SDK's Response refuses."""
    error = _error(_post(served[3], {"input": "x", "max_output_tokens": 4, "stream": stream,
                                     "text": {"format": {"type": "json_schema", "schema": SCHEMA}}}))
    assert error["param"] == "text.format.name" and "Field required" in error["message"], error


def test_a_named_json_schema_format_is_echoed_with_its_name(served):  # noqa: F811
    fmt = {"type": "json_schema", "name": "cfg", "schema": SCHEMA, "strict": True}
    body = {"input": "x", "max_output_tokens": 4, "temperature": 0, "text": {"format": fmt}}
    whole = _ok(_post(served[3], body))
    assert whole.text.format.model_dump(by_alias=True, exclude_none=True) == fmt
    completed = _events(served[3], {"model": "demo", **body})[-1]
    assert Response.model_validate(completed["response"]).text.format.name == "cfg"


@pytest.mark.parametrize("fmt", [{"type": "text"}, {"type": "json_object"}])
def test_other_formats_need_no_name(served, fmt):  # noqa: F811
    body = {"input": "x", "max_output_tokens": 4, "temperature": 0, "text": {"format": fmt}}
    assert _ok(_post(served[3], body)).text.format.type == fmt["type"]


# ---- 2. a refusal part is an assistant's --------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["user", "system", "developer"])
@pytest.mark.parametrize("typed", [False, True])  # OpenAI's EasyInputMessage leaves the type out
def test_a_refusal_outside_an_assistant_message_is_a_400_naming_it(served, role, typed):  # noqa: F811
    """Old: a 200, the refusal read as the message's text."""
    message = {"role": role, "content": [{"type": "input_text", "text": "hi"}, REFUSAL]}
    items = [{"role": "user", "content": "x"}, {**message, "type": "message"} if typed else message]
    error = _error(_post(served[3], {"input": items, "max_output_tokens": 4}))
    assert error["param"] == "input.1.content", error
    assert "part 1 is a refusal, which only an assistant message holds" in error["message"], error
    assert f"a {role} message reads text parts" in error["message"], error


@pytest.mark.parametrize("assistant", [
    {"role": "assistant", "content": [REFUSAL]},
    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": [REFUSAL]},
])
def test_a_refusal_in_an_assistant_message_is_still_read(served, assistant):  # noqa: F811
    said = {"role": "user", "content": "x"}
    _ok(_post(served[3], {"input": [said, assistant, said], "max_output_tokens": 4, "temperature": 0}))
