"""Chat completions' `echo` (vLLM's extension): the reply starts with the last message when that message is
the reply's role (an assistant prefill continued); streamed, the echoed text is the first content delta.
Over real HTTP (the serving app under uvicorn, the demo model, the `openai` client and httpx)."""
from __future__ import annotations

import httpx
import openai
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.demo import demo_pair
from saguaro_dist.serve.api import ServerOptions, create_app

PREFILL = "    return"
QUESTION = [{"role": "user", "content": "def f(x):"}]
PREFILLED = QUESTION + [{"role": "assistant", "content": PREFILL}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def served():
    target, _ = demo_pair()
    llm = LLM(model=target, mode="ar")
    with serve_on_loopback(create_app(llm, ServerOptions("demo"))) as url:
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0), url
    llm.shutdown()


def _chat(client, messages, **extra):
    return client.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0, **extra)


def test_echo_prepends_a_continued_prefill(served):
    """Old: echo was a 400."""
    client, _ = served
    plain = _chat(client, PREFILLED, extra_body=CONTINUE)
    echoed = _chat(client, PREFILLED, n=2, extra_body={**CONTINUE, "echo": True})
    assert plain.choices[0].message.content
    assert [c.message.content for c in echoed.choices] == [PREFILL + plain.choices[0].message.content] * 2
    assert echoed.usage.completion_tokens == 2 * plain.usage.completion_tokens  # the echo is no generated token


def test_echo_streams_the_prefill_first(served):
    client, _ = served
    plain = _chat(client, PREFILLED, extra_body=CONTINUE).choices[0].message.content
    chunks = [c for c in _chat(client, PREFILLED, n=2, stream=True, extra_body={**CONTINUE, "echo": True}) if c.choices]
    for index in (0, 1):
        deltas = [c.choices[0].delta for c in chunks if c.choices[0].index == index]
        assert deltas[0].role == "assistant" and deltas[1].content == PREFILL
        assert "".join(d.content or "" for d in deltas) == PREFILL + plain


def test_echo_adds_nothing_when_the_roles_differ(served):
    client, _ = served
    plain = _chat(client, QUESTION)
    echoed = _chat(client, QUESTION, extra_body={"echo": True})
    assert echoed.choices[0].message.content == plain.choices[0].message.content
    streamed = _chat(client, QUESTION, stream=True, extra_body={"echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain.choices[0].message.content


def test_echo_stays_refused_on_responses(served):
    """The Responses API has no echo: still a 400 naming it, not silently dropped."""
    _, url = served
    reply = httpx.post(f"{url}/responses", json={"input": "def f(x):", "max_output_tokens": 2, "echo": True})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "echo"
