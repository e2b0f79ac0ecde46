"""The SDK against a real loopback server that answers what the API never sends: a proxy's HTML page with 200,
a stream read twice, `event: error` events without OpenAI's "error" envelope."""
from __future__ import annotations

import asyncio
import json
from typing import ClassVar

import pytest

from saguaro_dist.client import (APIResponseValidationError, AsyncClient, BadRequestError, Client, InternalServerError,
                                 SaguaroError, StreamClosedError)
from scripted_openai import ScriptedServer, Servers

HTML = b"<!DOCTYPE html><html><body><h1>Sign in to the guest Wi-Fi</h1></body></html>"


class _Replies(ScriptedServer):
    """Every request gets the class's `reply`: (content type, raw body), status 200, HTTP/1.0 (the body ends where
    the connection closes, as a stream's does)."""
    reply: ClassVar[tuple] = ("text/html", HTML)

    def do_GET(self):
        self._send_reply()

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self._send_reply()

    def _send_reply(self):
        content_type, body = self.reply
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def serve():
    """serve(content_type, body) -> the URL of a server answering every request with it."""
    servers = Servers()
    yield lambda content_type, body: servers.start(type("R", (_Replies,), {"reply": (content_type, body)}))
    servers.close()


def sse(*events) -> bytes:
    return "".join(events).encode()


def data(chunk) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "c", "model": "m", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


async def _async_call(url: str, call):
    async with AsyncClient(url, max_retries=0) as client:
        return await call(client)


def both(url: str, call):
    """`call(client)` through the sync client and then the async one (its coroutine awaited)."""
    with Client(url, max_retries=0) as client:
        yield lambda: call(client)
    yield lambda: asyncio.run(_async_call(url, call))


# -- 1a: a 200 reply whose body is not the API's ------------------------------------------------------------

CALLS = {"complete": lambda c: c.complete("x", max_tokens=4), "chat": lambda c: c.chat("x", max_tokens=4),
         "models": lambda c: c.models(), "tokenize": lambda c: c.tokenize("x"), "version": lambda c: c.version()}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_proxy_s_html_page_with_200_is_a_typed_error_naming_status_and_body(serve, name):
    """response.json() raised a bare json.JSONDecodeError: no SaguaroError, nothing of what came back."""
    url = serve("text/html", HTML)
    for run in both(url, CALLS[name]):
        with pytest.raises(APIResponseValidationError, match=r"200: .*not a JSON object.*Sign in to the guest") as err:
            run()
        assert isinstance(err.value, SaguaroError) and err.value.status_code == 200 and "<!DOCTYPE" in err.value.body


@pytest.mark.parametrize("body", [b"[1, 2]", b'{"object": "list"}'])
def test_json_that_is_not_the_reply_s_shape_is_a_typed_error(serve, body):
    """A JSON list made Completion.from_body an AttributeError; an object without "data" made models() a KeyError."""
    url = serve("application/json", body)
    call = CALLS["complete"] if body.startswith(b"[") else CALLS["models"]
    for run in both(url, call):
        with pytest.raises(APIResponseValidationError, match="200: "):
            run()


def test_a_long_body_is_quoted_by_its_start_only(serve):
    url = serve("text/html", b"<html>" + b"x" * 100_000)
    with pytest.raises(APIResponseValidationError) as err:
        Client(url, max_retries=0).complete("x")
    assert len(str(err.value)) < 400 and str(err.value).endswith("...")


@pytest.mark.parametrize("body", [HTML, json.dumps(chunk("whole", "stop")).encode(),
                                  sse(data(chunk("a")), "data: <html>oops</html>\n\n")])
def test_a_stream_that_is_no_event_stream_is_a_typed_error(serve, body):
    """An HTML page (or a whole JSON reply from a server ignoring stream=True) streamed nothing and ended quietly,
    an empty text taken for a result; a data line that is not JSON raised a bare JSONDecodeError."""
    url = serve("text/html", body)
    with pytest.raises(APIResponseValidationError, match="200: "):
        list(Client(url, max_retries=0).complete("x", stream=True))

    async def go(client):
        return [d async for d in await client.complete("x", stream=True)]
    with pytest.raises(APIResponseValidationError, match="200: "):
        asyncio.run(_async_call(url, go))


def test_a_stream_without_done_still_ends_quietly(serve):
    url = serve("text/event-stream", sse(": keep-alive\n\n", "id: 1\nretry: 5\n" + data(chunk("a", "stop"))))
    assert list(Client(url, max_retries=0).complete("x", stream=True)) == ["a"]


# -- 1b: a stream iterated twice --------------------------------------------------------------------------

STREAM = sse(data(chunk("a")), data(chunk("b", "stop")), "data: [DONE]\n\n")


def test_a_stream_read_to_its_end_yields_nothing_more_as_openai_s(serve):
    """openai's Stream iterates one generator: a second loop ends at once. Ours raised httpx.StreamClosed."""
    url = serve("text/event-stream", STREAM)
    stream = Client(url, max_retries=0).complete("x", stream=True)
    assert (list(stream), list(stream), stream.finish_reason) == (["a", "b"], [], "stop")

    async def go(client):
        s = await client.complete("x", stream=True)
        return [d async for d in s], [d async for d in s], s.finish_reason
    assert asyncio.run(_async_call(url, go)) == (["a", "b"], [], "stop")


def test_a_stream_that_ended_in_an_error_yields_nothing_more(serve):
    url = serve("text/event-stream", sse(data(chunk("a")), data({"error": {"message": "engine died", "code": 503}})))
    stream = Client(url, max_retries=0).complete("x", stream=True)
    with pytest.raises(InternalServerError, match="engine died"):
        list(stream)
    assert list(stream) == []


def test_a_stream_closed_before_its_end_says_so_when_read_again(serve):
    """A loop left early closes the stream (a saguaro server stops generating): the rest is gone, and a second loop
    must not pass for the whole text. It raised httpx.StreamClosed."""
    url = serve("text/event-stream", STREAM)
    stream = Client(url, max_retries=0).complete("x", stream=True)
    for _ in stream:
        break
    with pytest.raises(StreamClosedError, match="closed before its end"):
        list(stream)
    closed = Client(url, max_retries=0).complete("x", stream=True)
    closed.close()
    with pytest.raises(StreamClosedError):
        list(closed)

    async def go(client):
        s = await client.complete("x", stream=True)
        await s.aclose()
        return [d async for d in s]
    with pytest.raises(StreamClosedError):
        asyncio.run(_async_call(url, go))


# -- 1c: `event: error` without OpenAI's envelope -----------------------------------------------------------

@pytest.mark.parametrize("event, error, message", [
    ('{"message": "KV cache exhausted", "code": 503}', InternalServerError, "KV cache exhausted"),
    ('{"message": "prompt too long", "type": "invalid_request_error"}', BadRequestError, "prompt too long"),
    ('{"detail": "worker lost"}', InternalServerError, "worker lost"),
    ("the engine was restarted", InternalServerError, "the engine was restarted"),
    ("", InternalServerError, "error event without a message"),
])
def test_an_error_event_raises_with_whatever_message_it_carries(serve, event, error, message):
    """The parser read only data lines: `event: error` with data lacking an "error" key was taken for a chunk
    (no choices: nothing) and the stream went on; plain text raised a bare JSONDecodeError."""
    lines = "event: error\n" + "".join(f"data: {line}\n" for line in event.splitlines()) + "\n"
    url = serve("text/event-stream", sse(data(chunk("a")), lines, data(chunk("b", "stop")), "data: [DONE]\n\n"))
    got = []
    with pytest.raises(error, match=message):
        for delta in Client(url, max_retries=0).complete("x", stream=True):
            got.append(delta)  # noqa: PERF402 (what came before the error, kept)
    assert got == ["a"]

    async def go(client):
        return [d async for d in await client.complete("x", stream=True)]
    with pytest.raises(error, match=message):
        asyncio.run(_async_call(url, go))


def test_other_named_events_are_still_chunks(serve):
    url = serve("text/event-stream", sse("event: message\n" + data(chunk("a")), data(chunk("b", "stop"))))
    assert list(Client(url, max_retries=0).complete("x", stream=True)) == ["a", "b"]
