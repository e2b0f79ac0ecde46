"""The SDK against a real scripted HTTP server on loopback: SSE events whose data spans several lines, vLLM's flat
error body, a Retry-After it cannot sleep, and bad arguments refused before any request is sent."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from saguaro_dist.client import AsyncClient, BadRequestError, Client, InternalServerError


class _Scripted(BaseHTTPRequestHandler):
    """Answers every request with the class's (status, headers, raw body) replies in turn, the last repeating;
    HTTP/1.0, so the body ends where the connection closes."""
    replies: ClassVar[list] = []
    seen: ClassVar[list] = []

    def do_POST(self):
        type(self).seen.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
        status, headers, body = self.replies[min(len(self.seen), len(self.replies)) - 1]
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    """(the server's URL, its handler class): set `replies`, read `seen` (the request bodies)."""
    handler = type("Scripted", (_Scripted,), {"replies": [], "seen": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    httpd.shutdown()
    httpd.server_close()


def chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "c", "model": "m", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def sse(*events: str) -> tuple:
    return 200, {"content-type": "text/event-stream"}, "".join(events).encode()


def collect(url: str) -> tuple[list[str], list[str]]:
    """The deltas one stream yields, through the sync and the async client."""
    sync = list(Client(url, max_retries=0).complete("x", stream=True))

    async def go():
        async with AsyncClient(url, max_retries=0) as c:
            return [d async for d in await c.complete("x", stream=True)]
    return sync, asyncio.run(go())


def test_an_event_whose_data_spans_lines_is_one_chunk(scripted):
    """SSE joins an event's data lines with newlines: a JSON chunk split over two lines was parsed line by line
    (a JSONDecodeError). Comments and a final event without its blank line count too."""
    url, handler = scripted
    first, second = json.dumps(chunk("Hel"), indent=1).splitlines(), json.dumps(chunk("lo", "stop"))
    handler.replies = [sse(": a keep-alive comment\n\n", "".join(f"data: {line}\n" for line in first), "\n",
                           f"event: message\ndata:{second}\n\n", "data: [DONE]")]
    assert collect(url) == (["Hel", "lo"], ["Hel", "lo"])


def test_an_error_event_mid_stream_is_typed_with_its_message(scripted):
    url, handler = scripted
    error = {"error": {"message": "engine died", "type": "InternalServerError", "code": 503}}
    handler.replies = [sse(f"data: {json.dumps(chunk('a'))}\n\n", f"data: {json.dumps(error)}\n\n")]
    got = []
    with pytest.raises(InternalServerError, match="engine died"):
        for delta in Client(url, max_retries=0).complete("x", stream=True):
            got.append(delta)  # noqa: PERF402 (what came before the error, kept)
    assert got == ["a"]


def test_vllm_s_flat_error_body_keeps_its_message_and_fields(scripted):
    """vLLM's ErrorResponse is flat, not in OpenAI's envelope: the message was the whole body's repr, the
    type, param and code lost."""
    url, handler = scripted
    body = {"object": "error", "message": "max_tokens is too large", "type": "BadRequestError", "param": "max_tokens",
            "code": 400}
    handler.replies = [(400, {"content-type": "application/json"}, json.dumps(body).encode())]
    with pytest.raises(BadRequestError) as err:
        Client(url, max_retries=0).complete("x", max_tokens=10 ** 9)
    assert (err.value.message, err.value.param, err.value.type) == ("max_tokens is too large", "max_tokens",
                                                                   "BadRequestError")


@pytest.mark.parametrize("retry_after", ["-1", "nan"])
def test_a_retry_after_that_cannot_be_slept_falls_back_to_backoff(scripted, retry_after):
    """time.sleep(-1) and sleep(nan) raise ValueError: the retry crashed instead of backing off."""
    url, handler = scripted
    busy = (503, {"content-type": "application/json", "Retry-After": retry_after},
            json.dumps({"error": {"message": "busy"}}).encode())
    ok = (200, {"content-type": "application/json"}, json.dumps(chunk("ok", "stop")).encode())
    handler.replies = [busy, ok]
    assert Client(url, max_retries=1, backoff_s=0.01).complete("x").text == "ok" and len(handler.seen) == 2
    handler.seen.clear()

    async def go():
        async with AsyncClient(url, max_retries=1, backoff_s=0.01) as c:
            return (await c.complete("x")).text
    assert asyncio.run(go()) == "ok" and len(handler.seen) == 2


@pytest.mark.parametrize("kw, match", [({"max_retries": -1}, "max_retries"), ({"backoff_s": -0.5}, "backoff_s"),
                                       ({"timeout": 0}, "timeout"), ({"timeout": -1.0}, "timeout")])
def test_bad_client_settings_are_refused_at_construction(scripted, kw, match):
    """max_retries=-1 made every request an AssertionError('unreachable'); a negative backoff or timeout failed
    only once a request was under way."""
    url, handler = scripted
    with pytest.raises(ValueError, match=match):
        Client(url, **kw)
    with pytest.raises(ValueError, match=match):
        AsyncClient(url, **kw)
    assert handler.seen == []


@pytest.mark.parametrize("messages", [{"role": "user", "content": "hi"}, ["hi", "there"]])
def test_messages_that_are_not_message_dicts_are_refused_before_sending(scripted, messages):
    """One dict iterated its keys into dict('role'): a ValueError about 'dictionary update sequence'."""
    url, handler = scripted
    with pytest.raises(TypeError, match="list of message dicts"):
        Client(url).chat(messages)

    async def go():
        async with AsyncClient(url) as c:
            with pytest.raises(TypeError, match="list of message dicts"):
                await c.chat(messages)
    asyncio.run(go())
    assert handler.seen == []
