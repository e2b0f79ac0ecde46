"""The SDK against a real server on loopback (an engine under uvicorn) and a scripted one, doing what a review caught it
mishandling: openai's per-request options (extra_body, extra_headers, extra_query, timeout) sent as body fields;
next() on a stream; close() inside its loop; attributes of the private parser; errors without a message; and a
stream's chunks() (every parsed chunk, not just the text)."""
from __future__ import annotations

import asyncio
import json
import time
from typing import ClassVar

import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.client import (APITimeoutError, AsyncClient, AsyncStream, Client, InternalServerError,
                                 RateLimitError, Stream, StreamClosedError)
from saguaro_dist.serve.api import ServerOptions, create_app
from scripted_openai import ScriptedServer, Servers
from test_serve_fixtures import make_tokenizer, write_llama

LONG = 1500                  # tokens a stream asks for: far more than a hang-up takes to land
SLOW_S, TIMEOUT_S = 1.5, 0.3  # a reply slower than the request waits
ROLE = {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
CALL = {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [
    {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]}
USAGE = {"id": "c", "model": "m", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 3}}


def delta(text: str, finish: str | None = None) -> dict:
    return {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


CHUNKS = [ROLE, delta("a"), delta(""), CALL, delta("b"), delta("c", "tool_calls"), USAGE]


class _Scripted(ScriptedServer):
    """Routes by the path's first segment (the client's base URL); keeps each request's (path, headers, body)."""
    seen: ClassVar[list] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).seen.append((self.path, self.headers, body))  # (headers: case-insensitive)
        getattr(self, "route_" + self.path.split("/")[1])(body)

    def route_ok(self, body):
        if not body.get("stream"):
            return self.json_reply(200, delta("ok", "stop"))
        self._start_stream()
        for chunk in CHUNKS:
            self.event(chunk)
        self.wfile.write(b"data: [DONE]\n\n")
        self.event(delta("after [DONE]"))

    def route_slow(self, body):
        time.sleep(SLOW_S)
        try:
            self.route_ok(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up waiting, as the test means it to

    def route_nomessage(self, body):
        error = {"code": 429, "status": "RESOURCE_EXHAUSTED", "details": [{"reason": "quota"}]}
        if not body.get("stream"):
            return self.json_reply(429, {"error": error})
        self._start_stream()
        self.event(delta("a"))
        self.wfile.write(f"event: error\ndata: {json.dumps({'error': {'type': 'overloaded'}})}\n\n".encode())

    def _start_stream(self):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()


@pytest.fixture(scope="module")
def scripted():
    servers = Servers()
    handler = type("Scripted", (_Scripted,), {"seen": []})
    yield servers.start(handler), handler
    servers.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_llama(tmp_path_factory.mktemp("client_review"), make_tokenizer(), hidden=32, layers=1, seed=3,
                       max_positions=LONG + 256)
    with LLM(model=path, mode="ar", max_model_len=LONG + 256) as llm:
        app = create_app(llm, ServerOptions("m"))
        with serve_on_loopback(app) as url:
            yield url, app.state.saguaro


def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def _async(make):
    """make(client) -> a coroutine, run with an AsyncClient on `url`."""
    def run(url, **settings):
        async def go():
            async with AsyncClient(url, **{"max_retries": 0, **settings}) as client:
                return await make(client)
        return asyncio.run(go())
    return run


# -- 1: openai's per-request options ----------------------------------------------------------------------------

def test_request_options_reach_the_body_the_headers_and_the_query(scripted):
    """They were sent as top-level body fields, which a server ignores: none of them did anything."""
    url, handler = scripted
    options = {"extra_body": {"top_k": 5, "max_tokens": 2}, "extra_headers": {"X-Foo": "1"},
               "extra_query": {"api-version": "7"}}
    handler.seen.clear()
    with Client(url + "/ok", max_retries=0) as client:
        client.complete("x", max_tokens=9, **options)
        client.chat("hi", stream=True, **options).close()
    _async(lambda c: c.complete("x", max_tokens=9, **options))(url + "/ok")
    assert len(handler.seen) == 3
    for path, headers, body in handler.seen:
        assert path.endswith("?api-version=7") and headers.get("x-foo") == "1"
        assert body["top_k"] == 5 and body["max_tokens"] == 2  # extra_body wins, as openai merges it
        assert not {"extra_body", "extra_headers", "extra_query"} & set(body)


def test_extra_body_and_headers_take_effect_on_a_real_server(engine):
    url, _ = engine
    with Client(url, max_retries=0) as client:
        out = client.complete("the cat", max_tokens=9, temperature=0, extra_body={"max_tokens": 3, "ignore_eos": True},
                              extra_headers={"X-Request-Id": "review-1"})
    assert (out.usage["completion_tokens"], out.id) == (3, "cmpl-review-1")


def test_a_request_s_timeout_applies_to_it(scripted):
    url, handler = scripted
    with Client(url + "/slow", max_retries=0, timeout=60) as client:
        with pytest.raises(APITimeoutError):
            client.complete("x", timeout=TIMEOUT_S)
        with pytest.raises(ValueError, match="timeout must be"):
            client.complete("x", timeout=0)
    with pytest.raises(APITimeoutError):
        _async(lambda c: c.complete("x", stream=True, timeout=TIMEOUT_S))(url + "/slow", timeout=60)
    assert "timeout" not in handler.seen[-1][2]


# -- 2, 3, 4: next(), close() inside the loop, attributes ---------------------------------------------------------

def test_next_takes_a_delta_and_a_loop_goes_on_from_there(scripted):
    """openai's Stream is an iterator: next(stream) raised TypeError, and the async peek StreamClosedError."""
    url, _ = scripted
    stream = Client(url + "/ok", max_retries=0).complete("x", stream=True)
    assert (next(stream), list(stream), list(stream), stream.usage) == ("a", ["b", "c"], [], USAGE["usage"])

    async def peek(client):
        first = await anext(await client.complete("x", stream=True))
        s = await client.complete("x", stream=True)
        second = await anext(aiter(s))  # a loop dropped (closed later by asyncio) while another reads on
        return first, second, [d async for d in s], s.finish_reason
    assert _async(peek)(url + "/ok") == ("a", "a", ["b", "c"], "tool_calls")


def test_close_inside_the_loop_ends_it_quietly_and_stops_the_generation(engine):
    """It raised APIConnectionError("the stream broke: Bad file descriptor")."""
    url, state = engine
    cancelled = state.cancelled
    stream = Client(url, max_retries=0).complete("the cat", max_tokens=LONG, ignore_eos=True, stream=True)
    got = []
    for piece in stream:
        got.append(piece)
        stream.close()
    assert len(got) == 1
    _until(lambda: state.cancelled == cancelled + 1 and state.running == 0)
    with pytest.raises(StreamClosedError):
        list(stream)

    async def close_inside(client):
        s = await client.complete("the cat", max_tokens=LONG, ignore_eos=True, stream=True)
        seen = []
        async for piece in s:
            seen.append(piece)
            await s.aclose()
        return seen
    assert len(_async(close_inside)(url)) == 1
    _until(lambda: state.cancelled == cancelled + 2 and state.running == 0)


@pytest.mark.parametrize("sync", [True, False])
def test_a_loop_left_early_still_stops_the_generation(engine, sync):
    """What the shared reader must keep: leaving a loop early closes the stream (the server stops generating)."""
    url, state = engine
    cancelled = state.cancelled
    if sync:
        stream = Client(url, max_retries=0).complete("the cat", max_tokens=LONG, ignore_eos=True, stream=True)
        for _ in stream:
            break
    else:
        async def leave(client):
            s = await client.complete("the cat", max_tokens=LONG, ignore_eos=True, stream=True)
            async for _ in s:
                break
            await asyncio.sleep(0.05)  # asyncio closes the loop's generator at its next turn
            return s
        stream = _async(leave)(url)
    _until(lambda: state.cancelled == cancelled + 1 and state.running == 0)
    assert stream.finish_reason is None


def test_unknown_attributes_name_the_stream_and_async_close_is_awaitable(scripted):
    """They named StreamAccumulator (a private class); `await stream.close()` (openai's AsyncStream) failed."""
    url, _ = scripted
    stream = Client(url + "/ok", max_retries=0).complete("x", stream=True)
    with pytest.raises(AttributeError, match="'Stream' object has no attribute 'feed'"):
        stream.feed  # noqa: B018
    assert stream.response.status_code == 200 and stream.usage is None
    stream.close()

    async def close(client):
        s = await client.complete("x", stream=True)
        assert isinstance(s, AsyncStream) and not hasattr(s, "end")
        await s.close()
        return s.response.is_closed
    assert _async(close)(url + "/ok")


# -- 5: an error without a message -------------------------------------------------------------------------------

def test_an_error_without_a_message_says_what_it_holds(scripted):
    """The message was empty ('429: ')."""
    url, _ = scripted
    with Client(url + "/nomessage", max_retries=0) as client:
        with pytest.raises(RateLimitError) as err:
            client.complete("x")
        assert json.loads(err.value.message)["status"] == "RESOURCE_EXHAUSTED"
        with pytest.raises(InternalServerError, match='"type":"overloaded"'):
            list(client.complete("x", stream=True))


# -- 6: chunks() ----------------------------------------------------------------------------------------------

def test_chunks_yields_every_chunk_to_done_and_fills_the_facts(scripted):
    url, _ = scripted
    stream = Client(url + "/ok", max_retries=0).complete("x", stream=True)
    assert isinstance(stream, Stream) and list(stream.chunks()) == CHUNKS and list(stream.chunks()) == []
    assert (stream.usage, stream.finish_reason, stream.texts) == (USAGE["usage"], "tool_calls", {0: "abc"})
    assert stream.tool_calls[0]["function"] == {"name": "f", "arguments": "{}"}

    async def read(client):
        s = await client.complete("x", stream=True)
        return [c async for c in s.chunks()], s.usage
    assert _async(read)(url + "/ok") == (CHUNKS, USAGE["usage"])


def test_chunks_follow_the_stream_s_read_once_rules(scripted):
    url, _ = scripted
    stream = Client(url + "/ok", max_retries=0).complete("x", stream=True)
    assert next(stream) == "a"
    assert list(stream.chunks()) == CHUNKS[2:]  # the shared reader goes on after the text read
    left = Client(url + "/ok", max_retries=0).complete("x", stream=True)
    for _ in left.chunks():
        break
    with pytest.raises(StreamClosedError):
        list(left)


def test_chunks_on_a_real_server_carry_the_text_and_the_usage(engine):
    url, _ = engine
    with Client(url, max_retries=0) as client:
        whole = client.complete("the cat", max_tokens=6, temperature=0, ignore_eos=True)
        stream = client.complete("the cat", max_tokens=6, temperature=0, ignore_eos=True, stream=True,
                                 stream_options={"include_usage": True})
        chunks = list(stream.chunks())
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole.text
    assert chunks[-1]["choices"] == [] and stream.usage["completion_tokens"] == 6 == whole.usage["completion_tokens"]
