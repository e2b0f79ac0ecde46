"""/v1/completions and /v1/chat/completions against OpenAI's and vLLM's rules: an explicit null for n, stream,
completions' echo and chat's parallel_tool_calls is the default; one `created` per request, on every chunk;
`usage` only when asked (include_usage: the closing chunk alone); truncate_prompt_tokens past
max_model_len - max_tokens is a 400 naming it (-1: that many); top_logprobs without logprobs as vLLM.
Over real HTTP (uvicorn) on an engine over a tiny Llama written by transformers."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist.serve.api import ServerOptions, create_app
from test_serve_fixtures import make_tokenizer, write_llama

MAX_MODEL_LEN = 128
HI = [{"role": "user", "content": "the cat"}]
PROMPT = "the cat sat on the mat"
GREEDY = {"model": "m", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
ROUTES = [("/completions", {"prompt": PROMPT}), ("/chat/completions", {"messages": HI})]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from saguaro_dist import LLM
    path = write_llama(tmp_path_factory.mktemp("s86"), make_tokenizer(), hidden=32, layers=1, seed=3)
    with LLM(model=path, mode="ar", max_model_len=MAX_MODEL_LEN, max_batch_size=4) as llm, \
            serve_on_loopback(create_app(llm, ServerOptions("m", stream_interval_ms=0))) as base:
        yield base


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def _chunks(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("path, body, field", [
    ("/completions", {"prompt": PROMPT}, "n"), ("/completions", {"prompt": PROMPT}, "stream"),
    ("/completions", {"prompt": PROMPT}, "echo"), ("/chat/completions", {"messages": HI}, "n"),
    ("/chat/completions", {"messages": HI}, "stream"), ("/chat/completions", {"messages": HI}, "parallel_tool_calls")])
def test_an_explicit_null_is_the_fields_default(url, path, body, field):
    """Old: a 400 "Input should be a valid integer/boolean". OpenAI's schema allows null there, and the openai SDK
    sends it for an argument passed as None: the reply is the one without the field (one choice, unstreamed,
    no echo)."""
    plain = _post(url, path, {**body, **GREEDY})
    nulled = _post(url, path, {**body, **GREEDY, field: None})
    assert nulled.status_code == 200, nulled.text
    assert [c.get("text", c.get("message")) for c in nulled.json()["choices"]] == \
           [c.get("text", c.get("message")) for c in plain.json()["choices"]]


def test_the_openai_sdk_passing_none_is_served(url):
    client = openai.OpenAI(base_url=url, api_key="x")
    chat = client.chat.completions.create(model="m", messages=HI, max_tokens=2, n=None, stream=None,
                                          parallel_tool_calls=None)
    completion = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, n=None, stream=None, echo=None)
    assert len(chat.choices) == 1 == len(completion.choices)


@pytest.mark.parametrize("field, value", [("n", 0), ("n", "two"), ("stream", "maybe"), ("echo", 3)])
def test_other_values_are_still_checked(url, field, value):
    r = _post(url, "/completions", {"prompt": PROMPT, **GREEDY, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def _stream_across_a_second(url: str, path: str, body: dict) -> list[dict]:
    """A stream started just before a clock second ends, so its chunks are made on both sides of it (a
    `created` per chunk differed then); retried if this box was too fast for that."""
    for _ in range(3):
        time.sleep((0.93 - time.time() % 1) % 1)  # until the clock reads x.93 s
        started = int(time.time())
        chunks = _chunks(url, path, {**body, "model": "m", "max_tokens": 24, "ignore_eos": True, "n": 2,
                                     "stream": True, "stream_options": {"include_usage": True}})
        if int(time.time()) > started:
            return chunks
    return chunks


@pytest.mark.parametrize("path, body", ROUTES)
def test_every_chunk_of_a_stream_carries_the_requests_created(url, path, body):
    """Old: each chunk took the time it was made. OpenAI's and vLLM's: one `created`, the request's arrival."""
    before = int(time.time())
    chunks = _stream_across_a_second(url, path, body)
    created = {c["created"] for c in chunks}
    assert len(created) == 1 and before <= created.pop() <= int(time.time())


@pytest.mark.parametrize("path, body", ROUTES)
def test_a_stream_carries_usage_only_when_asked_and_once(url, path, body):
    """Old: the chunk with the last finish_reason carried usage, asked or not, and include_usage's closing chunk
    repeated it (LangChain, summing usage over chunks, counted the request twice). OpenAI's and vLLM's: only the
    closing `choices: []` chunk, with include_usage. Our speculation stats stay on the last finish chunk."""
    plain = _chunks(url, path, {**body, **GREEDY, "n": 2, "stream": True})
    assert not [c for c in plain if "usage" in c]
    assert "speculation" in [c for c in plain if c["choices"] and c["choices"][0]["finish_reason"]][-1]
    asked = _chunks(url, path, {**body, **GREEDY, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    with_usage = [c for c in asked if c.get("usage") is not None]
    whole = _post(url, path, {**body, **GREEDY, "n": 2}).json()
    assert with_usage == [asked[-1]] and asked[-1]["choices"] == [] and asked[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize("path, body", ROUTES)
def test_truncate_prompt_tokens_past_the_room_the_reply_leaves_is_refused(url, path, body):
    """Old: accepted and ignored. vLLM's rule: at most max_model_len - max_tokens, else a 400 naming the field."""
    room = MAX_MODEL_LEN - GREEDY["max_tokens"]
    r = _post(url, path, {**body, **GREEDY, "truncate_prompt_tokens": room + 1})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "truncate_prompt_tokens", r.text
    assert error["message"].startswith(f"truncate_prompt_tokens={room + 1} cannot be greater than max_model_len - "
                                       f"max_tokens = {MAX_MODEL_LEN} - 4 = {room}")
    assert _post(url, path, {**body, **GREEDY, "truncate_prompt_tokens": room}).status_code == 200


def test_truncate_prompt_tokens_minus_one_keeps_what_leaves_the_reply_room(url):
    """Old: -1 kept max_model_len tokens, leaving the reply none (a 400). vLLM's: max_model_len - max_tokens."""
    r = _post(url, "/completions", {"prompt": "the cat " * MAX_MODEL_LEN, **GREEDY, "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - GREEDY["max_tokens"]
    # the route's default max_tokens (completions: 16) counts when max_tokens is left out, as in vLLM
    default = {k: v for k, v in GREEDY.items() if k != "max_tokens"}
    r = _post(url, "/completions", {"prompt": PROMPT, **default, "truncate_prompt_tokens": MAX_MODEL_LEN - 15})
    assert r.status_code == 400 and "= 112" in r.json()["error"]["message"], r.text


def test_top_logprobs_without_logprobs_is_vllms(url):
    """vLLM's rule (unchanged here): top_logprobs 0 alone asks for nothing; more needs logprobs true."""
    zero = _post(url, "/chat/completions", {"messages": HI, **GREEDY, "top_logprobs": 0})
    assert zero.status_code == 200 and zero.json()["choices"][0]["logprobs"] is None
    for logprobs in ({}, {"logprobs": False}, {"logprobs": None}):
        r = _post(url, "/chat/completions", {"messages": HI, **GREEDY, "top_logprobs": 2, **logprobs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_responses_reads_a_null_parallel_tool_calls_as_the_default(url):
    """Old: a 400 "Input should be a valid boolean" on /v1/responses, though chat read null as the default."""
    body = {"model": "m", "input": "the cat", "max_output_tokens": 2, "temperature": 0}
    r = _post(url, "/responses", {**body, "parallel_tool_calls": None})
    assert r.status_code == 200, r.text
    replies = (r.json(), _post(url, "/responses", body).json())
    texts = [[part["text"] for part in reply["output"][0]["content"]] for reply in replies]
    assert r.json()["parallel_tool_calls"] is True and texts[0] == texts[1]


@pytest.mark.parametrize("path, body, field", [*((path, body, "max_tokens") for path, body in ROUTES),
                                               ("/chat/completions", {"messages": HI}, "max_completion_tokens"),
                                               ("/responses", {"input": "the cat"}, "max_output_tokens")])
@pytest.mark.parametrize("keep", [5, -1])
def test_truncation_with_a_reply_longer_than_the_context_names_the_replys_length(url, path, body, field, keep):
    """Old: "truncate_prompt_tokens=5 cannot be greater than max_model_len - max_tokens = 128 - 200 = -72", and -1
    cut the prompt to one token before the context-length 400. vLLM checks the reply's length first."""
    asked = MAX_MODEL_LEN + 72
    r = _post(url, path, {**body, "model": "m", field: asked, "truncate_prompt_tokens": keep})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert r.json()["error"]["message"] == (f"{field}={asked} cannot be greater than max_model_len={MAX_MODEL_LEN}. "
                                            "Please request fewer output tokens.")


@pytest.mark.parametrize("stream", [False, True])
def test_a_beam_search_reply_is_created_when_the_request_arrived(url, stream):
    """Old: the search's body (and chunks) took the time the search ended. A search started just after a clock
    second begins and running past its end (retried if this box was too fast) is created in a second before the
    one its reply ends in: the request's arrival, at or after the send (a loaded box can delay it past a second
    boundary), never the end's (within milliseconds of the reply's, the same second but by rare chance)."""
    body = {"model": "m", "messages": HI, "use_beam_search": True, "n": 4, "max_tokens": 100, "ignore_eos": True,
            "stream": stream}
    for _ in range(3):  # a try is told apart when created < ended; created == ended is retried:
        # a box too fast (the whole search in one second), or an arrival a loaded box delayed into the end's second
        time.sleep((1.02 - time.time() % 1) % 1)  # until the clock reads x.02 s
        sent = int(time.time())
        replies = _chunks(url, "/chat/completions", body) if stream else [_post(url, "/chat/completions", body).json()]
        ended = int(time.time())
        created = {reply["created"] for reply in replies}
        if len(created) != 1 or min(created) < ended:
            break
    # unfixed, every try is created == ended > sent; three all-in-one-second tries prove only the lower bound
    assert len(created) == 1 and sent <= min(created) and (min(created) < ended or ended == sent), (created, sent, ended)
