"""Session 93's client review: reads cut by the caller, against a real ASGI app under uvicorn on loopback whose stream
holds its second delta until the test lets it go; the client's timeouts; base URLs that are no http(s) URL.

Old: a read cancelled mid-stream (asyncio.wait_for around anext(), a task cancelled) or interrupted (Ctrl-C in a
notebook) used up the reader without marking the stream: the next read ended quietly, the text cut short and no
finish_reason, where the SDK's own rule is a StreamClosedError for a stream whose rest is gone. The client's one
`timeout` (120 s) bounded the connect too, each retry of it: a host that is gone took minutes to fail; and a
generation not streamed failed at 120 s (`saguaro generate --url` had no way to wait longer). A base_url without a
scheme ("localhost:8000", read as scheme "localhost") failed only at the first request, as "cannot reach
/8000/completions", and one with a query had the API's paths appended after the query."""
from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from http_helpers import serve_on_loopback
from saguaro_dist.client import AsyncClient, Client, StreamClosedError
from saguaro_dist.client._options import split_options


@pytest.fixture(scope="module")
def held():
    """(base URL, release): a completion stream sends "a", then waits for release (a threading.Event) before "b"."""
    release = threading.Event()

    async def generate(request):
        await request.json()

        async def events():
            yield _chunk("a", None)
            while not release.is_set():
                await asyncio.sleep(0.02)
            yield _chunk("b", "length")
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    with serve_on_loopback(Starlette(routes=[Route("/v1/completions", generate, methods=["POST"])])) as url:
        yield url, release
        release.set()


def _chunk(text: str, finish: str | None) -> str:
    return "data: " + json.dumps({"id": "x", "model": "m", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}) + "\n\n"


def test_an_async_read_cancelled_mid_stream_closes_the_stream(held):
    url, release = held
    release.clear()

    async def run():
        async with AsyncClient(url, max_retries=0) as client:
            stream = await client.complete("x", stream=True, max_tokens=2)
            assert await anext(stream) == "a"
            with pytest.raises(asyncio.TimeoutError):  # a per-delta deadline: the read under way is cancelled
                await asyncio.wait_for(anext(stream), 0.3)
            release.set()
            with pytest.raises(StreamClosedError, match="cancelled or interrupted"):
                await anext(stream)
            assert stream.finish_reason is None
    asyncio.run(run())


def test_a_sync_read_interrupted_by_ctrl_c_closes_the_stream(held):
    url, release = held
    release.clear()

    def ctrl_c(*_):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGALRM, ctrl_c)
    try:
        with Client(url, max_retries=0) as client:
            stream = client.complete("x", stream=True, max_tokens=2)
            assert next(stream) == "a"
            signal.setitimer(signal.ITIMER_REAL, 0.3)  # Ctrl-C while the read of "b" waits
            with pytest.raises(KeyboardInterrupt):
                next(stream)
            release.set()
            with pytest.raises(StreamClosedError, match="cancelled or interrupted"):
                list(stream)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("make", [Client, AsyncClient])
@pytest.mark.parametrize("timeout, want", [
    ("default", httpx.Timeout(600.0, connect=5.0)),  # openai's defaults
    (30, httpx.Timeout(30.0, connect=5.0)),
    (2.5, httpx.Timeout(2.5)),                       # a connect never waits longer than the rest
    (None, httpx.Timeout(None)),
    (httpx.Timeout(7.0, connect=1.0), httpx.Timeout(7.0, connect=1.0)),
])
def test_the_client_connects_within_5_s_whatever_its_read_timeout(make, timeout, want):
    client = make("http://127.0.0.1:9") if timeout == "default" else make("http://127.0.0.1:9", timeout=timeout)
    try:
        assert client._http.timeout == want
    finally:
        asyncio.run(client.close()) if make is AsyncClient else client.close()


@pytest.mark.parametrize("base_url, message", [
    ("localhost:8000", "http:// or https:// URL with a host"), ("svc:8000", "http:// or https:// URL with a host"),
    ("ftp://h", "http:// or https:// URL with a host"), ("http://", "http:// or https:// URL with a host"),
    ("", "http:// or https:// URL with a host"), ("http://h:8000/v1?api-version=1", "no query or fragment"),
    ("http://h:8000#x", "no query or fragment"), (8000, "must be a str"),
])
@pytest.mark.parametrize("make", [Client, AsyncClient])
def test_a_base_url_that_is_no_http_url_is_refused_at_once(make, base_url, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make(base_url)


def test_an_httpx_url_is_a_base_url_as_its_text():
    with Client(httpx.URL("http://[::1]:8000")) as client:
        assert client._root == "http://[::1]:8000/v1"


@pytest.mark.parametrize("timeout, want", [(30, httpx.Timeout(30.0, connect=5.0)), (None, None),
                                           (httpx.Timeout(9.0), httpx.Timeout(9.0))])
def test_a_requests_own_timeout_is_read_as_the_clients(timeout, want):
    """openai's per-request timeout=: a number bounds the connect at 5 s too (else a gone host was tried at it)."""
    assert split_options({"timeout": timeout})[1].timeout == want
    assert split_options({})[1].timeout is httpx.USE_CLIENT_DEFAULT
