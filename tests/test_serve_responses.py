"""OpenAI's Responses API (/v1/responses) over real HTTP: the serving app under uvicorn, the demo model,
the `openai` client's own types and stream parser."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import demo_pair
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.openai_responses import ResponsesRequest
from saguaro_dist.serve.protocol import PromptEnd
from saguaro_dist.serve.responses_route import prompt_end

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
          "required": ["name", "size"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served():
    target, _ = demo_pair()
    llm = LLM(model=target, mode="ar")
    plain, reasoning = create_app(llm, ServerOptions("demo")), create_app(llm, ServerOptions("demo", reasoning_parser="deepseek_r1"))
    with serve_on_loopback(plain) as url, serve_on_loopback(reasoning) as r1_url:
        yield llm, openai.OpenAI(base_url=url, api_key="none", max_retries=0), \
            openai.OpenAI(base_url=r1_url, api_key="none", max_retries=0), url
    llm.shutdown()


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Tucson", "Phoenix"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "forecast", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]


def greedy_chat(llm, messages, max_tokens):
    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens))[0]


def test_a_reply_is_the_chat_reply(served):
    llm, client, _, _ = served
    resp = client.responses.create(model="demo", input="def add(a, b):", max_output_tokens=10, temperature=0)
    expected = greedy_chat(llm, [{"role": "user", "content": "def add(a, b):"}], 10)
    assert resp.output_text == expected.text and resp.id.startswith("resp_") and resp.object == "response"
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (len(expected.prompt_token_ids), len(expected.token_ids))
    assert resp.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    assert [item.type for item in resp.output] == ["message"]


def test_instructions_and_message_items(served):
    llm, client, _, _ = served
    items = [{"role": "user", "content": [{"type": "input_text", "text": "import os"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "import sys"}]},
             {"type": "message", "role": "user", "content": "and json?"}]
    resp = client.responses.create(model="demo", instructions="Write Python.", input=items, max_output_tokens=8,
                                   temperature=0)
    expected = greedy_chat(llm, [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "import os"},
                                 {"role": "assistant", "content": "import sys"}, {"role": "user", "content": "and json?"}], 8)
    assert resp.output_text == expected.text and resp.instructions == "Write Python."


def test_streamed_events_in_openai_order(served):
    _, client, _, _ = served
    whole = client.responses.create(model="demo", input="class Stack:", max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model="demo", input="class Stack:", max_output_tokens=12, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{'incomplete' if whole.status == 'incomplete' else 'completed'}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and "".join(deltas) == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole.output_text and events[-1].response.usage.output_tokens == 12


def test_text_format_json_schema(served):
    _, client, _, _ = served
    resp = client.responses.create(model="demo", input="a config:", max_output_tokens=60, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "cfg", "schema": SCHEMA}})
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)


def test_reasoning_comes_as_its_own_item(served):
    """Under deepseek_r1 the demo model's reply (it never writes </think>) is all reasoning, as in chat."""
    _, client, r1, _ = served
    plain = client.responses.create(model="demo", input="def f(x):", max_output_tokens=12, temperature=0).output_text
    resp = r1.responses.create(model="demo", input="def f(x):", max_output_tokens=12, temperature=0)
    assert [item.type for item in resp.output] == ["reasoning", "message"] and resp.output_text == ""
    assert resp.output[0].content[0].text == plain
    events = list(r1.responses.create(model="demo", input="def f(x):", max_output_tokens=12, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == plain
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]


def test_an_earlier_output_goes_back_in_as_is(served):
    """`input = [...] + response.output + [...]`, the SDK's way of going on: the reasoning item is accepted
    and left out of the prompt (as chat templates leave earlier reasoning out), the message is the
    assistant's turn."""
    llm, _, r1, _ = served
    first = r1.responses.create(model="demo", input="def f(x):", max_output_tokens=6, temperature=0)
    assert [item.type for item in first.output] == ["reasoning", "message"]
    follow = r1.responses.create(model="demo", input=[{"role": "user", "content": "def f(x):"}, *first.output,
                                                      {"role": "user", "content": "and g?"}],
                                 max_output_tokens=6, temperature=0)
    history = [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": ""},
               {"role": "user", "content": "and g?"}]
    assert follow.output[0].content[0].text == greedy_chat(llm, history, 6).text


def test_logprobs_are_chats_on_the_output_text_whole_and_streamed(served):
    """top_logprobs with include message.output_text.logprobs (OpenAI's pair): the entries chat returns for the
    same turn, on the message's output_text; streamed, each delta carries its tokens' and done all of them."""
    _, client, _, url = served
    ask = {"model": "demo", "input": "import os", "max_output_tokens": 8, "temperature": 0, "top_logprobs": 2,
           "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}
    chat = httpx.post(f"{url}/chat/completions", json={"model": "demo", "messages": [{"role": "user", "content": "import os"}],
                                                      "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2},
                      timeout=60).json()["choices"][0]["logprobs"]["content"]
    resp = client.responses.create(**ask)
    logprobs = resp.output[0].content[0].logprobs
    assert [lp.model_dump() for lp in logprobs] == chat and len(chat) == resp.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    events = list(client.responses.create(**ask, stream=True))
    streamed = [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert streamed == chat and [lp.model_dump() for lp in done.logprobs] == chat
    assert [lp.model_dump() for lp in events[-1].response.output[0].content[0].logprobs] == chat
    plain = client.responses.create(**{**ask, "include": None})  # top_logprobs alone asks for nothing (OpenAI's)
    assert plain.output[0].content[0].logprobs == []


def test_a_reply_that_is_all_reasoning_keeps_its_logprobs_streamed_too(served):
    _, _, r1, _ = served
    ask = {"model": "demo", "input": "def f(x):", "max_output_tokens": 6, "temperature": 0,
           "include": ["message.output_text.logprobs"]}
    whole = r1.responses.create(**ask)
    assert [i.type for i in whole.output] == ["reasoning", "message"] and len(whole.output[1].content[0].logprobs) == 6
    streamed = list(r1.responses.create(**ask, stream=True))[-1].response.output[1].content[0].logprobs
    assert [lp.model_dump() for lp in streamed] == [lp.model_dump() for lp in whole.output[1].content[0].logprobs]


@pytest.mark.parametrize("extra, param", [
    ({"include": ["message.output_text.logprobs", "file_search_call.result"]}, "include"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, None),  # built-in tools: only functions run here
    ({"tools": [{"type": "function", "name": "f"}]}, "tool_choice"),  # auto without a tool-call parser
    ({"background": True}, "background"),
    ({"n": 2}, "n"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, None),
    ({"input": ""}, "input"),
])
def test_refused_with_a_400_naming_the_field(served, extra, param):
    url = served[3]
    reply = httpx.post(f"{url}/responses", json={"model": "demo", "input": "hi", **extra}, timeout=30)
    assert reply.status_code == 400, reply.text
    if param:
        assert param in reply.json()["error"]["message"] or reply.json()["error"]["param"] == param


def test_a_named_function_call_whole_and_streamed(served):
    """tool_choice naming a function: chat's constrained call, as a function_call item."""
    _, client, _, _ = served
    body = dict(model="demo", input="def forecast(city):", tools=TOOLS, max_output_tokens=60, temperature=0,
                tool_choice={"type": "function", "name": "get_weather"})
    resp = client.responses.create(**body)
    (call,) = resp.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(client.responses.create(stream=True, **body))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert (added.item.type, added.item.name) == ("function_call", "get_weather")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert arguments == done.arguments == call.arguments
    assert [i.type for i in events[-1].response.output] == ["function_call"]
    assert events[-1].response.output[0].call_id == added.item.call_id


def test_required_calls_come_as_items(served):
    """The demo model repeats its call until max tokens unless held to one (as on chat): parallel_tool_calls
    false gives one item; penalised, it calls both functions and closes the list (streamed: an item per call)."""
    _, client, _, _ = served
    body = dict(model="demo", input="def forecast(city):", tools=TOOLS, max_output_tokens=96, temperature=0,
                tool_choice="required")
    (one,) = client.responses.create(parallel_tool_calls=False, **body).output
    assert one.type == "function_call" and one.name in ("get_weather", "get_time")
    both = client.responses.create(extra_body={"frequency_penalty": 1.0}, **body)
    assert {i.type for i in both.output} == {"function_call"} and {i.name for i in both.output} == {"get_weather", "get_time"}
    events = list(client.responses.create(extra_body={"frequency_penalty": 1.0}, stream=True, **body))
    assert [(i.name, i.arguments) for i in events[-1].response.output] == [(i.name, i.arguments) for i in both.output]
    assert [e.item.name for e in events if e.type == "response.output_item.added"] == [i.name for i in both.output]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    streamed = events[-1].response.output
    assert ["".join(e.delta for e in deltas if e.item_id == i.id) for i in streamed] == [i.arguments for i in both.output]


def test_calls_and_their_outputs_go_back_as_chat_turns(served):
    llm, client, _, _ = served
    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Tucson", "days": 1}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    resp = client.responses.create(model="demo", input=items, tools=TOOLS, tool_choice="none", max_output_tokens=6,
                                   temperature=0)
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Tucson", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    expected = llm.chat(history, SamplingParams(temperature=0, max_tokens=6), tools=chat_tools)[0]
    assert resp.output_text == expected.text and resp.usage.input_tokens == len(expected.prompt_token_ids)


def test_auto_reads_the_parsers_calls(served):
    """tool_choice auto on a server with the hermes parser, the demo model made to write a call by a regex
    (it knows no tools): one function_call item, whole and streamed."""
    llm = served[0]
    with serve_on_loopback(create_app(llm, ServerOptions("demo", tool_call_parser="hermes"))) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        body = dict(model="demo", input="what time is it?", tools=TOOLS, max_output_tokens=40, temperature=0,
                    extra_body={"structured_outputs": {"regex": r'<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'}})
        (call,) = client.responses.create(**body).output
        events = list(client.responses.create(stream=True, **body))
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_time", {})
    assert [(i.type, i.name, i.arguments) for i in events[-1].response.output] == [("function_call", "get_time", call.arguments)]
    assert not [e for e in events if e.type == "response.output_text.delta"]


@pytest.mark.parametrize("status", ["incomplete", "in_progress"])
def test_a_partial_assistant_message_last_is_continued(served, status):
    """vLLM's should_continue_final_message: the reply continues it (chat's continue_final_message), where
    the old route closed it and opened a new turn."""
    llm, client, _, _ = served
    partial = {"type": "message", "role": "assistant", "status": status, "content": [{"type": "output_text", "text": "def"}]}
    resp = client.responses.create(model="demo", input=[{"role": "user", "content": "hi"}, partial],
                                   max_output_tokens=4, temperature=0)
    expected = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def"}],
                        SamplingParams(temperature=0, max_tokens=4), add_generation_prompt=False,
                        continue_final_message=True)[0]
    assert (resp.output_text, resp.usage.input_tokens) == (expected.text, len(expected.prompt_token_ids))


def test_the_response_echoes_annotations_and_reports_the_settings_used(served):
    """OpenAI echoes user, top_logprobs, service_tier, prompt_cache_key, safety_identifier; vLLM reports the
    temperature, top_p and max_output_tokens it ran with, defaults included (they came back null)."""
    llm, client, _, _ = served
    notes = dict(user="u1", top_logprobs=2, service_tier="auto", prompt_cache_key="k", safety_identifier="s")
    resp = client.responses.create(model="demo", input="hi", max_output_tokens=2, **notes)
    assert {name: getattr(resp, name) for name in notes} == notes
    assert (resp.temperature, resp.top_p, resp.max_output_tokens) == (1.0, 1.0, 2)
    with client.responses.create(model="demo", input="hi", stream=True) as stream:  # (closed after its first event)
        created = next(iter(stream)).response
    room = llm.max_model_len - len(llm.chat([{"role": "user", "content": "hi"}],
                                                   SamplingParams(max_tokens=1))[0].prompt_token_ids)
    assert (created.temperature, created.top_p, created.max_output_tokens, created.user) == (1.0, 1.0, room, None)


@pytest.mark.parametrize("last, end", [
    ({"type": "reasoning", "summary": [], "status": "in_progress", "content": [{"type": "reasoning_text", "text": "t"}]},
     PromptEnd.CONTINUE),
    ({"role": "assistant", "status": "completed", "content": "x"}, PromptEnd.NEW_TURN),
    ({"role": "assistant", "content": "x"}, PromptEnd.NEW_TURN),
    ({"role": "user", "status": "incomplete", "content": "x"}, PromptEnd.NEW_TURN),  # only the assistant's is continued
])
def test_which_last_items_are_continued(last, end):
    request = ResponsesRequest.model_validate({"model": "demo", "input": [{"role": "user", "content": "hi"}, last]})
    assert prompt_end(request) is end
