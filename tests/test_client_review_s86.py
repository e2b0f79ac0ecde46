"""The SDK against a scripted server on loopback (session 86's review): a stream dropped unclosed gives its connection
back (the server sees the client leave) without waiting for the cyclic GC; a base_url with a path is the API root as
given; a stream's timeout names its type and the timeout; api_key falls back to $SAGUARO_API_KEY; AsyncClient.close()."""
from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections import defaultdict
from typing import ClassVar

import pytest

from saguaro_dist.client import APITimeoutError, AsyncClient, Client
from scripted_openai import ScriptedServer, Servers

TRICKLE_CHUNKS, TRICKLE_GAP_S = 500, 0.02  # a generation that outlasts any test unless the client leaves
GUARD_S = 10.0  # a hang guard, no timing claim: how long a test waits for what it expects
READ_TIMEOUT_S, STALL_S = 0.3, 2.0


def chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "c", "model": "m", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


class _Review(ScriptedServer):
    """Routes by the path's first segment (the client's base URL); keeps each request's path and Authorization."""
    seen: ClassVar[list] = []
    left: ClassVar[defaultdict] = defaultdict(threading.Event)  # a trickle's case -> the client went away

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).seen.append((self.path, self.headers.get("authorization")))
        getattr(self, "route_" + self.path.split("/")[1], self.route_ok)(body)

    def route_ok(self, body):
        self.json_reply(200, chunk(f"ok {body['prompt']}", "stop"))

    def route_trickle(self, body):
        """Streams until the client leaves (its write fails): what a generating server does."""
        self._start_stream()
        try:
            for i in range(TRICKLE_CHUNKS):
                self.event(chunk(str(i)))
                time.sleep(TRICKLE_GAP_S)
        except ConnectionError:
            type(self).left[self.path.split("/")[2]].set()

    def route_stall(self, body):
        self._start_stream()
        self.event(chunk("a"))
        time.sleep(STALL_S)

    def _start_stream(self):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()


@pytest.fixture(scope="module")
def server():
    servers = Servers()
    handler = type("Review", (_Review,), {"seen": [], "left": defaultdict(threading.Event)})
    yield servers.start(handler, queue_size=32), handler
    servers.close()


@pytest.fixture
def no_cyclic_gc():
    """Only reference counting frees objects: a stream kept alive by a cycle stays alive."""
    was_enabled = gc.isenabled()
    gc.disable()
    yield
    if was_enabled:
        gc.enable()


# -- 1: a stream dropped unclosed lets go of its connection ----------------------------------------------------------

@pytest.mark.parametrize("reads", [0, 1])
def test_a_sync_stream_dropped_unclosed_lets_the_server_stop(server, no_cyclic_gc, reads):
    """Never read, it stayed ACTIVE in httpx's pool forever; after next() the stream and its reader referred to each
    other, so only the cyclic GC closed it: the server generated on meanwhile."""
    url, handler = server
    case = f"sync-{reads}"
    with Client(url + f"/trickle/{case}", max_retries=0) as client:
        stream = client.complete("x", stream=True)
        for _ in range(reads):
            next(stream)
        del stream
        assert handler.left[case].wait(GUARD_S), "the server went on streaming to a dropped stream"
        assert not client._http._transport._pool.connections  # (httpx's pool: nothing held)


@pytest.mark.parametrize("reads", [0, 1])
def test_an_async_stream_dropped_unclosed_lets_the_server_stop(server, no_cyclic_gc, reads):
    url, handler = server
    case = f"async-{reads}"

    async def go():
        async with AsyncClient(url + f"/trickle/{case}", max_retries=0) as client:
            stream = await client.complete("x", stream=True)
            for _ in range(reads):
                await stream.__anext__()
            del stream
            for _ in range(int(GUARD_S / 0.05)):  # the close is sent to this loop: let it run
                if handler.left[case].is_set():
                    break
                await asyncio.sleep(0.05)
            return handler.left[case].is_set()
    assert asyncio.run(go()), "the server went on streaming to a dropped stream"


def test_a_stream_read_on_after_next_is_still_whole(server):
    """The reader no longer holds the stream: a loop after next() still reads the same reader to its end."""
    url, _ = server
    with Client(url + "/trickle/whole", max_retries=0) as client:
        stream = client.complete("x", stream=True)
        first, rest = next(stream), []
        for delta in stream:
            rest.append(delta)
            if len(rest) == 3:
                break
    assert [first, *rest] == ["0", "1", "2", "3"]


# -- 2: base_url --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix, path", [("", "/v1/completions"), ("/", "/v1/completions"),
                                          ("/v1/", "/v1/completions"), ("/api/v2", "/api/v2/completions"),
                                          ("/v1beta/openai/", "/v1beta/openai/completions")])
def test_a_base_url_with_a_path_is_used_as_given(server, suffix, path):
    """/v1 was appended to any URL not ending in /v1: ".../v1beta/openai/" went to ".../v1beta/openai/v1"."""
    url, handler = server
    with Client(url + suffix, max_retries=0) as client:
        assert client.complete("x").text == "ok x"
    assert handler.seen[-1][0] == path


# -- 3: a stream's timeout says what timed out -----------------------------------------------------------------

def test_a_stream_s_timeout_names_its_type_and_the_timeout(server):
    """The async one read "the stream timed out: " (anyio's timeout has no text)."""
    url, _ = server

    def sync():
        with Client(url + "/stall", timeout=READ_TIMEOUT_S, max_retries=0) as client:
            list(client.complete("x", stream=True))

    async def run_async():
        async with AsyncClient(url + "/stall", timeout=READ_TIMEOUT_S, max_retries=0) as client:
            [d async for d in await client.complete("x", stream=True)]
    for run in (sync, lambda: asyncio.run(run_async())):
        with pytest.raises(APITimeoutError) as caught:
            run()
        assert "ReadTimeout" in str(caught.value) and f"{READ_TIMEOUT_S} s" in str(caught.value)


# -- 4: api_key from the environment ---------------------------------------------------------------------------

def test_api_key_left_out_is_read_from_saguaro_api_key(server, monkeypatch):
    """No key was sent unless passed; `saguaro serve` reads its key from $SAGUARO_API_KEY. $OPENAI_API_KEY is never
    sent, and "" sends no key."""
    url, handler = server
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    monkeypatch.setenv("SAGUARO_API_KEY", " env-key\n")
    sent = []
    for key in (None, "given", ""):
        with Client(url, api_key=key, max_retries=0) as client:
            client.complete("x")
        sent.append(handler.seen[-1][1])

    async def run_async():
        async with AsyncClient(url, max_retries=0) as client:
            await client.complete("x")
    asyncio.run(run_async())
    monkeypatch.delenv("SAGUARO_API_KEY")
    with Client(url, max_retries=0) as client:
        client.complete("x")
    assert sent + [handler.seen[-2][1], handler.seen[-1][1]] == ["Bearer env-key", "Bearer given", None,
                                                                  "Bearer env-key", None]


# -- 5: AsyncClient.close() ------------------------------------------------------------------------------------

def test_async_client_close_is_aclose(server):
    url, _ = server

    async def go():
        client = AsyncClient(url, max_retries=0)
        assert (await client.complete("x")).text == "ok x"
        await client.close()
        return client._http.is_closed
    assert asyncio.run(go())
