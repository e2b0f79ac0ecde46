"""The SDK against a real loopback server doing what a review caught it mishandling: raw U+2028 in a stream's JSON,
read timeouts of a generation (retried: the server ran it three times), a LoRA load's 500 sent thrice, an API key
ending in a newline, redirects, a stream cut short, a 503 whose body breaks off, and a 200 carrying an error."""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import ClassVar

import pytest

from saguaro_dist.client import (APIConnectionError, APIStatusError, APITimeoutError, AsyncClient, BadRequestError,
                                 Client, InternalServerError)
from scripted_openai import ScriptedServer, Servers

SLOW_S, TIMEOUT_S = 1.5, 0.3  # a reply slower than the client waits
WEIRD = "a\u2028b\x85c\u2029d\u00e9\u4e2d"  # line separators to str.splitlines(), and multi-byte characters


def chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "c", "model": "m", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


class _Review(ScriptedServer):
    """Routes by the path's first segment (the client's base URL); counts requests by path, keeps Authorization."""
    hits: ClassVar[Counter] = Counter()
    auth: ClassVar[list] = []

    def do_GET(self):
        self.do_POST()

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        type(self).hits[self.path] += 1
        type(self).auth.append(self.headers.get("authorization"))
        route = self.path.split("/")[1]
        getattr(self, "route_" + route, self.route_ok)(body)

    def route_ok(self, body):
        if self.path.endswith("/models"):
            return self.json_reply(200, {"data": [{"id": "m"}]})
        self.json_reply(200, chunk(f"{self.command} {body['prompt']}", "stop"))

    def route_weird(self, body):
        raw = (f"data: {json.dumps(chunk(WEIRD), ensure_ascii=False)}\r\n\r\n"
               f"data: {json.dumps(chunk('!', 'stop'), ensure_ascii=False)}\r\rdata: [DONE]\n\n").encode()
        self._start_stream()
        for i in range(0, len(raw), 7):  # pieces that split characters and CRLFs
            self.wfile.write(raw[i:i + 7])
            self.wfile.flush()
            time.sleep(0.002)

    def route_redirect(self, body):
        status = int(self.path.split("/")[2])
        self.send_response(status)
        self.send_header("location", "/ok/v1/" + self.path.rsplit("/", 1)[1])
        self.send_header("content-length", "0")
        self.end_headers()

    def route_cut(self, body):
        self._start_stream()
        self.event(chunk("partial"))

    def route_unfinished_done(self, body):
        self._start_stream()
        self.event(chunk("whole", "stop"))

    def route_slow(self, body):
        time.sleep(SLOW_S)
        try:
            self.route_ok(body or {"prompt": ""})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up waiting, as the test means it to

    def route_status(self, body):
        status = int(self.path.split("/")[2])
        self.json_reply(status, {"error": {"message": f"status {status}"}})

    def route_broken503(self, body):
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "500")
        self.end_headers()
        self.wfile.write(b'{"error": {"mess')  # then the connection closes (HTTP/1.0)

    def route_error200(self, body):
        error = {"error": {"message": "bad temperature", "type": "invalid_request_error", "code": 400}}
        if self.path.split("/")[2] == "flat":
            error = {"object": "error", "message": "bad temperature", "type": "BadRequestError", "code": 400}
        self.json_reply(200, error)

    def _start_stream(self):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()


@pytest.fixture(scope="module")
def _running():
    servers = Servers()
    handler = type("Review", (_Review,), {"hits": Counter(), "auth": []})
    yield servers.start(handler), handler
    servers.close()


@pytest.fixture
def server(_running):
    """(the server's URL, its handler class: `hits`, `auth`, cleared for each test)."""
    url, handler = _running
    handler.hits.clear()
    handler.auth.clear()
    return url, handler


@pytest.fixture(params=["sync", "async"])
def call(request):
    """call(base_url, method name, *args, stream=..., **client settings): the method's result through the sync
    or the async client; a stream's deltas joined."""
    def sync(url, name, *args, stream=False, **settings):
        with Client(url, **{"max_retries": 0, **settings}) as client:
            out = getattr(client, name)(*args, **({"stream": True} if stream else {}))
            return "".join(out) if stream else out

    async def run_async(url, name, *args, stream=False, **settings):
        async with AsyncClient(url, **{"max_retries": 0, **settings}) as client:
            out = await getattr(client, name)(*args, **({"stream": True} if stream else {}))
            return "".join([d async for d in out]) if stream else out
    if request.param == "sync":
        return sync
    return lambda *args, **kw: asyncio.run(run_async(*args, **kw))


# -- 1: SSE lines end at CR, LF or CRLF only ------------------------------------------------------------------

def test_unicode_line_separators_inside_a_chunk_do_not_split_it(server, call):
    """httpx's iter_lines() split at U+2028, U+0085, U+2029 (str.splitlines): vLLM sends them raw in its JSON,
    and the half line was no JSON (APIResponseValidationError)."""
    url, _ = server
    assert call(url + "/weird", "complete", "x", stream=True) == WEIRD + "!"


def test_the_line_splitter_takes_any_split_of_the_bytes():
    from saguaro_dist.client._sse import LineSplitter
    data = f"\ufeffdata: {WEIRD}\r\n\r\nx\ry\r\r\nz".encode()
    want = [f"data: {WEIRD}", "", "x", "y", "", "z"]
    for cut in range(len(data) + 1):
        for second in range(cut, len(data) + 1):
            splitter = LineSplitter()
            got = splitter.feed(data[:cut]) + splitter.feed(data[cut:second]) + splitter.feed(data[second:])
            assert got + splitter.finish() == want, (cut, second)


# -- 2: retries only where the server did not process the request ----------------------------------------

def test_a_generation_s_read_timeout_is_not_sent_again(server, call):
    """APITimeoutError is an APIConnectionError, and all of those were retried: the server got the completion
    three times (it had the first and was generating it)."""
    url, handler = server
    with pytest.raises(APITimeoutError):
        call(url + "/slow", "complete", "x", timeout=TIMEOUT_S, max_retries=2, backoff_s=0.01)
    assert handler.hits["/slow/v1/completions"] == 1


def test_a_read_only_call_s_timeout_is_still_retried(server, call):
    url, handler = server
    with pytest.raises(APITimeoutError):
        call(url + "/slow", "models", timeout=TIMEOUT_S, max_retries=2, backoff_s=0.01)
    assert handler.hits["/slow/v1/models"] == 3


@pytest.mark.parametrize("status, method, args, sent", [
    (500, "load_lora_adapter", ("a", "/p"), 1),   # its state may have changed: a second load fails or reloads
    (502, "load_lora_adapter", ("a", "/p"), 1),
    (503, "load_lora_adapter", ("a", "/p"), 3),   # the server says to try again
    (429, "unload_lora_adapter", ("a",), 3),
    (500, "complete", ("x",), 1),                 # the server failed this request: again would fail it again
    (504, "complete", ("x",), 1),                 # a proxy gave up waiting: the server may still be generating
    (502, "complete", ("x",), 3),
    (500, "models", (), 3),
])
def test_statuses_are_retried_by_what_a_second_send_does(server, call, status, method, args, sent):
    url, handler = server
    with pytest.raises(APIStatusError) as err:
        call(f"{url}/status/{status}", method, *args, max_retries=2, backoff_s=0.01)
    assert err.value.status_code == status and sum(handler.hits.values()) == sent


# -- 3: an API key with a trailing newline -----------------------------------------------------------------

def test_an_api_key_s_surrounding_whitespace_is_dropped(server, call):
    """h11 refused "Bearer sk-abc\\n" with the key quoted in the error, which was a retried connection error."""
    url, handler = server
    assert call(url + "/ok", "models", api_key=" sk-abc\n") == ["m"]
    assert handler.auth == ["Bearer sk-abc"]


@pytest.mark.parametrize("key", ["sk-secret\nmore", "sk-secret\x00", "sk-s\u00e9cret"])
def test_a_key_no_header_can_carry_is_refused_without_showing_it(server, key):
    url, handler = server
    for make in (Client, AsyncClient):
        with pytest.raises(ValueError, match="api_key") as err:
            make(url, api_key=key)
        assert "secret" not in str(err.value)
    assert not handler.hits


# -- 4: redirects and a stream cut short ------------------------------------------------------------------

@pytest.mark.parametrize("status", [307, 308])
def test_a_post_s_307_or_308_is_followed_with_its_body(server, call, status):
    """A 3xx was taken for a success: its empty body streamed nothing, an empty text passed for a result."""
    url, handler = server
    assert call(f"{url}/redirect/{status}", "complete", "x").text == "POST x"
    assert handler.hits["/ok/v1/completions"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_redirect_that_would_turn_a_post_into_a_get_is_an_error_naming_where(server, call, stream):
    url, handler = server
    with pytest.raises(APIStatusError, match="redirected to /ok/v1/completions") as err:
        call(f"{url}/redirect/302", "complete", "x", stream=stream)
    assert err.value.status_code == 302 and not handler.hits["/ok/v1/completions"]


def test_a_get_s_redirect_is_followed(server, call):
    url, _ = server
    assert call(f"{url}/redirect/302", "models") == ["m"]


def test_a_stream_cut_before_its_choice_finished_raises(server, call):
    """It ended quietly: the partial text passed for the whole."""
    url, _ = server
    with pytest.raises(APIConnectionError, match="ended before \\[DONE\\]"):
        call(url + "/cut", "complete", "x", stream=True)


def test_a_stream_whose_choice_finished_may_leave_out_done(server, call):
    """As openai's client, which ends a stream at its body's end: servers that never send [DONE] still work."""
    url, _ = server
    assert call(url + "/unfinished_done", "complete", "x", stream=True) == "whole"


# -- 5: an error status whose body breaks off ---------------------------------------------------------------

def test_a_503_whose_body_breaks_off_is_typed_and_retried(server, call):
    """response.read() sat outside the try: a raw httpx.RemoteProtocolError escaped, never retried."""
    url, handler = server
    with pytest.raises(InternalServerError, match="broke off") as err:
        call(url + "/broken503", "complete", "x", stream=True, max_retries=2, backoff_s=0.01)
    assert err.value.status_code == 503 and handler.hits["/broken503/v1/completions"] == 3


# -- 6: a 200 carrying an error -----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["envelope", "flat"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_200_whose_body_is_an_error_raises_it_typed(server, call, shape, stream):
    """It returned an empty Completion; on a stream an APIResponseValidationError."""
    url, _ = server
    with pytest.raises(BadRequestError, match="bad temperature"):
        call(f"{url}/error200/{shape}", "complete", "x", stream=stream)
