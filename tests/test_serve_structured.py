"""Structured outputs over real HTTP: the serving app (create_app, as each Serve replica builds it) under
uvicorn on loopback, in front of the demo pair's SSD engine, spoken to by the `openai` client."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import demo_pair
from saguaro_dist.sampling_params import StructuredOutputsParams
from saguaro_dist.serve.api import ServerOptions, create_app

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "size": {"type": "integer"}},
          "required": ["name", "size"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served():
    target, draft = demo_pair()
    llm = LLM(model=target, draft=draft, mode="ssd", k=4, draft_executor="thread")
    with serve_on_loopback(create_app(llm, ServerOptions("demo"))) as base_url:
        yield llm, openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    llm.shutdown()


def test_response_format_json_schema_gives_json_that_follows_it(served):
    _, client = served
    out = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "def area(r):"}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "shape", "schema": SCHEMA}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    anything = client.completions.create(model="demo", prompt="x = ", max_tokens=48, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert anything.choices[0].finish_reason == "stop" and isinstance(json.loads(anything.choices[0].text), dict)


def test_structured_outputs_and_guided_fields_reach_the_engine(served):
    """vLLM's structured_outputs and its older guided_* spellings: the text is the engine's own under
    the same constraint, streamed or not."""
    llm, client = served
    choices = ["return None", "pass", "raise ValueError"]
    want = llm.generate(["def f(x):\n    "], SamplingParams(temperature=0, max_tokens=16, structured_outputs=
                                                           StructuredOutputsParams(choice=choices)))[0].text
    plain = client.completions.create(model="demo", prompt="def f(x):\n    ", max_tokens=16, temperature=0,
                                      extra_body={"structured_outputs": {"choice": choices}})
    streamed = client.completions.create(model="demo", prompt="def f(x):\n    ", max_tokens=16, temperature=0,
                                         stream=True, extra_body={"guided_choice": choices})
    assert plain.choices[0].text == want == "".join(c.choices[0].text for c in streamed) and want in choices


@pytest.mark.parametrize("extra, message", [
    ({"structured_outputs": {"regex": "(("}}, "not valid"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "once"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
])
def test_bad_structured_outputs_get_a_400(served, extra, message):
    _, client = served
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt="x", max_tokens=4, extra_body=extra)
    assert message in info.value.message
    assert client.completions.create(model="demo", prompt="x", max_tokens=2).choices[0].text is not None


def test_a_grammar_llguidance_cannot_follow_is_that_requests_400(served):
    """It compiles, then llguidance gives up at its second token: that request alone gets a 400 (streamed: an
    error event), sent again too, and a request beside it is served. It failed every request in flight (503)."""
    import threading

    llm, client = served
    beyond = {"structured_outputs": {"regex": "(x|y)a{3000000}"}}
    want = llm.generate(["def f(x):\n    "], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].text
    beside = {}
    other = threading.Thread(target=lambda: beside.setdefault("text", client.completions.create(
        model="demo", prompt="def f(x):\n    ", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0].text))
    other.start()
    # 24 tokens: a request's matcher renewed after llguidance fails now gets past 8 ("yaaaaaaa": its first
    # failures were the lexer budget that the verify's probes of drafted tokens, shared by every copy, used up)
    for _ in range(2):
        with pytest.raises(openai.BadRequestError, match="cannot follow this grammar"):
            client.completions.create(model="demo", prompt="x = ", max_tokens=24, temperature=0, extra_body=beyond)
    with pytest.raises(openai.APIError, match="cannot follow this grammar"):
        for _ in client.completions.create(model="demo", prompt="x = ", max_tokens=24, temperature=0, stream=True,
                                           extra_body=beyond):
            pass
    other.join()
    assert beside["text"] == want
