"""A malformed chat message's 400 names the member the client meant and the field at fault, over real HTTP (the
serving app under uvicorn with the demo model). Old: content and tool_choice were plain unions, so pydantic
reported their first member ("messages.1.content: Input should be a valid string", "tool_choice: Input should
be 'none', 'auto' or 'required'"), and a part's or a tool turn's problem was reported at the message or content."""
from __future__ import annotations

import pytest
import test_responses_batch_review_fixes as responses_tests
from test_responses_batch_review_fixes import post

url = responses_tests.url  # the module fixture: the serving app on an ar demo engine, over uvicorn
USER = {"role": "user", "content": "hi"}

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def error_of(url: str, body: dict) -> tuple[str, str]:
    reply = post(url, "/chat/completions", {"max_tokens": 1, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error["message"], error["param"]


def with_part(part) -> dict:
    return {"messages": [USER, {"role": "user", "content": [part]}]}


@pytest.mark.parametrize("part, message", [
    ({"type": "text"}, "messages.1.content.0.text: Field required in a part of type 'text'"),
    ({"type": "input_text", "text": None}, "messages.1.content.0.text: Field required in a part of type 'input_text'"),
    ({"type": "text", "text": 5}, "messages.1.content.0.text: Input should be a valid string"),
    ({"type": "refusal", "text": "x"}, "messages.1.content.0.refusal: Field required in a part of type 'refusal'"),
    ({"type": "thinking"}, "messages.1.content.0.thinking: Field required in a part of type 'thinking'"),
    ({"type": "image_url"}, "messages.1.content.0.image_url: Field required"),
    ({"type": "image_url", "image_url": {}}, "messages.1.content.0.image_url.url: Field required"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg=="}}, "messages.1.content.0.input_audio.format: "
                                                                     "Field required"),
    ({"text": "x"}, "messages.1.content.0.type: Field required"),
    ("x", "messages.1.content.0: must be a content part (an object with a type)"),
])
def test_a_parts_missing_or_wrong_field_is_named_by_its_path(url, part, message):
    """Old: "messages.1.content: part 0 is of type 'image_url': this server reads text parts only" for a
    malformed image part too, and prose at messages.1.content for a text part without its text."""
    assert error_of(url, with_part(part)) == (message, message.split(": ")[0])


def test_a_part_of_an_unknown_type_names_the_types_a_part_may_have(url):
    message, param = error_of(url, with_part({"type": "input_image", "image_url": "http://example.com/cat.png"}))
    assert param == "messages.1.content.0.type"
    assert message == ("messages.1.content.0.type: Input should be 'text', 'input_text', 'output_text', 'refusal', "
                       "'thinking', 'image_url', 'input_audio' or 'file'")


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "file-1"}}])
def test_a_well_formed_media_part_is_still_refused_by_name(url, part):
    message, param = error_of(url, with_part(part))
    assert param == "messages.1.content" and f"part 0 is of type {part['type']!r}" in message
    assert "text parts only" in message


def test_content_that_is_neither_a_string_nor_parts_says_so(url):
    """Old: "messages.1.content: Input should be a valid string" (the first member) for an object."""
    for content in (5, {"type": "text", "text": "x"}):
        body = {"messages": [USER, {"role": "user", "content": content}]}
        assert error_of(url, body) == ("messages.1.content: must be a string or a list of content parts",
                                       "messages.1.content")


@pytest.mark.parametrize("message, error", [
    ({"role": "tool", "content": "sunny"}, "messages.1.tool_call_id: Field required in a message with role 'tool'"),
    ({"role": "tool", "content": "sunny", "tool_call_id": ""},
     "messages.1.tool_call_id: must not be empty in a message with role 'tool'"),
    ({"role": "user", "content": "x", "tool_calls": [{"id": "c1", "type": "function",
                                                      "function": {"name": "get_time", "arguments": "{}"}}]},
     "messages.1.tool_calls: only assistant messages carry tool_calls"),
    ({"role": "bot", "content": "x"}, "messages.1.role: Input should be 'system', 'developer', 'user', 'assistant' "
                                      "or 'tool'"),
])
def test_a_role_dependent_field_is_named_by_its_path(url, message, error):
    """Old: "messages.1: a message with role 'tool' needs tool_call_id" (param messages.1): OpenAI's param
    names messages[1].tool_call_id."""
    assert error_of(url, {"messages": [USER, message]}) == (error, error.split(": ")[0])


@pytest.mark.parametrize("choice, error", [
    ({"type": "function"}, "tool_choice.function: Field required"),
    ({"type": "function", "function": {}}, "tool_choice.function.name: Field required"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto"}}, "tool_choice.allowed_tools.tools: Field required"),
    ({"type": "web_search"}, "tool_choice: must be 'none', 'auto', 'required', {\"type\": \"function\", \"function\": "
                             "{\"name\": ...}} or {\"type\": \"allowed_tools\", \"allowed_tools\": {\"mode\": ..., "
                             "\"tools\": [...]}}"),
    ("sometimes", "tool_choice: Input should be 'none', 'auto' or 'required'"),
])
def test_a_bad_tool_choice_names_the_form_it_has(url, choice, error):
    """Old: every object was "tool_choice: Input should be 'none', 'auto' or 'required'"."""
    assert error_of(url, {"messages": [USER], "tools": TOOLS, "tool_choice": choice}) == (error, error.split(": ")[0])


def test_valid_parts_and_tool_turns_read_as_before(url):
    """Every text part type still reads as its text, one a line; a tool turn with its id and a named choice run."""
    parts = [{"type": "text", "text": "the"}, {"type": "input_text", "text": "cat"}, {"type": "refusal", "refusal": "sat"},
             {"type": "output_text", "text": "on"}, {"type": "thinking", "thinking": "it"}]
    base = url.removesuffix("/v1")
    as_parts = post(base, "/tokenize", {"messages": [{"role": "assistant", "content": parts}, USER]}).json()
    as_text = post(base, "/tokenize", {"messages": [{"role": "assistant", "content": "the\ncat\nsat\non\nit"}, USER]})
    assert as_parts["tokens"] == as_text.json()["tokens"]
    history = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "noon"}]}]
    reply = post(url, "/chat/completions", {"messages": history, "tools": TOOLS, "max_tokens": 1,
                                            "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert reply.status_code == 200, reply.text


def test_the_part_models_are_importable_where_text_part_was():
    """TextPart took refusal and thinking parts before they got models of their own: those are exported beside it."""
    from saguaro_dist.serve.protocol import RefusalPart, ThinkingPart

    assert RefusalPart(type="refusal", refusal="no").value() == "no"
    assert ThinkingPart(type="thinking", thinking="hm").value() == "hm"
