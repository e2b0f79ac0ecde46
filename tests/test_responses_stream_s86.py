"""Streamed /v1/responses (session 86), over real HTTP with the openai client: a reasoning item's content part
opens and closes as a message's does (vLLM's and OpenAI's response.content_part.added / .done with a
reasoning_text part), and a stream whose engine fails half way ends with response.failed, its sequence
numbers contiguous. Every event also validates strictly as the openai SDK's ResponseStreamEvent."""
from __future__ import annotations

import openai
import pytest
from http_helpers import serve_on_loopback
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from saguaro_dist import LLM
from saguaro_dist.demo import demo_pair
from saguaro_dist.serve.api import ServerOptions, create_app

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def r1_server():
    """The demo model under deepseek_r1 (it never writes </think>: its reply is all reasoning), on an engine of
    its own: the last test shuts it down under an open stream (the engine failing mid-generation)."""
    llm = LLM(model=demo_pair()[0], mode="ar")
    with serve_on_loopback(create_app(llm, ServerOptions("demo", reasoning_parser="deepseek_r1"))) as url:
        yield llm, openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    llm.shutdown()


def _strictly_parsed(events: list) -> None:
    """The SDK builds its events without validating: each one is validated here as well, and numbered in order."""
    for event in events:
        STREAM_EVENT.validate_python(event.to_dict())
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_reasoning_item_opens_and_closes_its_reasoning_text_part(r1_server):
    """Old: the reasoning item had no content_part.added / .done (its added item carried the part instead)."""
    events = list(r1_server[1].responses.create(model="demo", input="def f(x):", max_output_tokens=8, temperature=0,
                                                stream=True))
    _strictly_parsed(events)
    reasoning_id = events[2].item.id
    own = [e for e in events if getattr(e, "item_id", None) == reasoning_id or getattr(e, "item", None) is not None
           and e.item.id == reasoning_id]
    kinds = [e.type for e in own]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-3:] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert set(kinds[2:-3]) == {"response.reasoning_text.delta"}
    text = "".join(e.delta for e in own if e.type == "response.reasoning_text.delta")
    assert own[0].item.content == [] and own[0].item.status == "in_progress"
    assert (own[1].part.type, own[1].part.text, own[1].content_index) == ("reasoning_text", "", 0)
    assert (own[-2].part.type, own[-2].part.text, own[-3].text) == ("reasoning_text", text, text)
    assert events[-1].response.output[0].content[0].text == text


def test_an_engine_failing_mid_stream_ends_it_with_response_failed(r1_server):
    """Old: an `error` event (its code an int, which the SDK's event refuses) and no response.failed.
    Last in this module: it shuts the module's engine down."""
    llm, client = r1_server
    stream = client.responses.create(model="demo", input="def f(x):", max_output_tokens=480, temperature=0,
                                     extra_body={"ignore_eos": True}, stream=True)
    events = []
    for event in stream:  # the loop ends by itself: the stream closes cleanly after its last event
        events.append(event)
        if event.type == "response.reasoning_text.delta" and event.sequence_number == 4:  # its first delta
            llm.shutdown()  # with a reasoning item open
    _strictly_parsed(events)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error" and "retry" in failed.error.message
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert [(i.type, i.status, i.content[0].text) for i in failed.output] == [("reasoning", "incomplete", text)]
    assert "response.completed" not in {e.type for e in events} and events[-2].code == "503"
