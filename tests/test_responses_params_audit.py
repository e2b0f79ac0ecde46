"""/v1/responses, field by field: each OpenAI Responses and vLLM field is honoured, accepted because it
changes nothing in the output, or refused with a 400 naming it; none that would change the output or its
shape is silently dropped. Over real HTTP to the serving app on an SSD engine (a tiny Llama pair written by
transformers), as test_serve_params_audit.py does for chat and completions."""
from __future__ import annotations

import logging

import httpx
import pytest
from http_helpers import serve_on_loopback

from saguaro_dist.serve.api import ServerOptions, create_app

pytest_plugins = ["test_serve_fixtures"]
GREEDY = {"input": "the cat sat on", "max_output_tokens": 4, "temperature": 0, "ignore_eos": True}
# A chat template that prints reasoning_effort when given it
READS_EFFORT = ("{% for m in messages %}{{ m.role }} : {{ m.content }}\n{% endfor %}"
                "{% if reasoning_effort %}effort : {{ reasoning_effort }}\n{% endif %}assistant :")


@pytest.fixture(scope="module")
def bases(reference_llm):
    """Base URLs (".../v1") of two apps on one engine: no chat template, and one reading reasoning_effort."""
    plain = create_app(reference_llm, ServerOptions("tiny"))
    effort = create_app(reference_llm, ServerOptions("tiny", chat_template=READS_EFFORT))
    with serve_on_loopback(plain) as plain_url, serve_on_loopback(effort) as effort_url:
        yield {"plain": plain_url, "effort": effort_url}


def _post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/responses", json=body, timeout=120)


def _ignored_warnings(caplog) -> list[str]:
    return [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]


def _text(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return "".join(part["text"] for item in reply.json()["output"] if item["type"] == "message"
                   for part in item["content"])


@pytest.mark.parametrize("extra, param", [
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"reasoning": {"effort": "low", "summary": "detailed"}}, "reasoning.summary"),
    ({"reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary"),
    # (truncation "auto" and include_reasoning false are honoured: test_serve_leftover_fields.py)
    ({"enable_response_messages": True}, "enable_response_messages"),  # vLLM's: the prompt's messages returned
    ({"previous_input_messages": [{"role": "user", "content": "hi"}]}, "previous_input_messages"),
    ({"max_completion_tokens": 2}, "max_completion_tokens"),  # chat's spellings of Responses fields
    ({"logprobs": True}, "logprobs"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"verbosity": "high"}, "verbosity"),
    ({"best_of": 2}, "best_of"),
])
def test_fields_that_would_change_the_output_are_a_400_naming_them(bases, extra, param):
    r = _post(bases["plain"], {**GREEDY, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("extra", [
    {"truncation": "disabled", "max_tool_calls": 3, "store": True, "background": False, "user": "u-1",
     "previous_response_id": None, "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s"},
    {"text": {"format": {"type": "text"}, "verbosity": "medium"}, "reasoning": {"summary": "auto"},
     "include": ["reasoning.encrypted_content"], "session_id": "s-1", "include_reasoning": True},
    {"top_logprobs": 3, "max_tool_calls": 0, "metadata": {"team": "a"}},  # top_logprobs alone asks for nothing
])
def test_fields_that_only_annotate_are_accepted_and_change_nothing(bases, extra):
    assert _text(_post(bases["plain"], {**GREEDY, **extra})) == _text(_post(bases["plain"], GREEDY))


def test_metadata_and_max_tool_calls_come_back_on_the_response(bases):
    """OpenAI's Response echoes the request's metadata; it came back empty."""
    r = _post(bases["plain"], {**GREEDY, "metadata": {"team": "a"}, "max_tool_calls": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["metadata"] == {"team": "a"} and body["max_tool_calls"] == 2 and body["truncation"] == "disabled"


def test_a_stream_with_obfuscation_asked_streams_without_a_warning(bases, caplog):
    """OpenAI's stream option (random padding on deltas, which clients discard) was logged as unknown."""
    body = {**GREEDY, "stream": True, "stream_options": {"include_obfuscation": True}}
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.serve.protocol"), \
            httpx.stream("POST", bases["plain"] + "/responses", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert "event: response.incomplete" in "".join(r.iter_text())  # max_output_tokens ended it
    assert _ignored_warnings(caplog) == []


def _input_tokens(base: str, body: dict) -> int:
    r = _post(base, body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["input_tokens"]


def test_reasoning_effort_reaches_the_chat_template(bases):
    """vLLM passes reasoning.effort to the chat template as reasoning_effort; it was dropped."""
    base = bases["effort"]
    bare = _input_tokens(base, GREEDY)
    effort = _input_tokens(base, {**GREEDY, "reasoning": {"effort": "high", "summary": "auto"}})
    same_as_kwargs = _input_tokens(base, {**GREEDY, "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert effort == same_as_kwargs > bare
    r = _post(base, {**GREEDY, "reasoning": {"effort": "high"}, "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert r.status_code == 400 and "reasoning.effort" in r.json()["error"]["message"], r.text


def test_a_reasoning_effort_the_template_ignores_is_logged_not_refused(bases, caplog):
    """As chat's reasoning_effort: a hint clients send by habit."""
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.serve.prompts"):
        r = _post(bases["plain"], {**GREEDY, "reasoning": {"effort": "high"}})
    assert r.status_code == 200, r.text
    assert any("reasoning_effort is not read" in rec.getMessage() for rec in caplog.records)


def test_the_sdks_fields_at_their_defaults_are_known(bases, caplog):
    """Every Responses field a client sends at its default is declared: none was logged as unknown (truncation,
    max_tool_calls, previous_response_id, ... were)."""
    body = {**GREEDY, "truncation": "disabled", "max_tool_calls": None, "previous_response_id": None,
            "background": False, "conversation": None, "prompt": None, "text": {"verbosity": "medium"},
            "reasoning": {"effort": None, "summary": None}, "include_reasoning": True}
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.serve.protocol"):
        r = _post(bases["plain"], body)
    assert r.status_code == 200, r.text
    assert _ignored_warnings(caplog) == []


@pytest.mark.parametrize("body, typo", [
    ({**GREEDY, "max_output_token": 3}, "'max_output_token' (did you mean 'max_output_tokens'?)"),
    ({**GREEDY, "truncaton": "auto"}, "'truncaton' (did you mean 'truncation'?)"),
    ({**GREEDY, "reasoning": {"efort": "low"}}, "'efort' (did you mean 'effort'?)"),
    ({**GREEDY, "text": {"verbosty": "low"}}, "'verbosty' (did you mean 'verbosity'?)"),
])
def test_unknown_fields_are_logged_with_the_field_a_typo_meant(bases, caplog, body, typo):
    """chat's and completions' rule (protocol.OpenAIModel), here and in the nested reasoning and text options."""
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.serve.protocol"):
        r = _post(bases["plain"], body)
    assert r.status_code == 200, r.text
    assert any(typo in message for message in _ignored_warnings(caplog)), _ignored_warnings(caplog)
