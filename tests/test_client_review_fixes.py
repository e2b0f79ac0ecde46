"""The SDK against a real loopback server doing what a review caught it mishandling: raw U+2028 in a stream's JSON,
read timeouts of a generation (retried: the server ran it three times), a LoRA load's 500 sent thrice, an API key
ending in a newline, redirects, a stream cut short, a 503 whose body breaks off, and a 200 carrying an error; then a
second review's: a long SSE line, an event unended at EOF, Retry-After dates, bodies that do not decode."""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from email.utils import formatdate
from types import SimpleNamespace
from typing import ClassVar

import pytest

from saguaro_dist.client import (APIConnectionError, APIResponseValidationError, APIStatusError, APITimeoutError,
                                 AsyncClient, BadRequestError, Client, InternalServerError)
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

    def route_tail(self, body):
        """A stream whose last event the body leaves unended: cut mid-line, or without its blank line."""
        self._start_stream()
        self.event(chunk("a"))
        tails = {"midline": 'data: {"choices": [{"index": 0, "te',
                 "noblank": f"data: {json.dumps(chunk('b', 'stop'))}\n"}
        self.wfile.write(tails[self.path.split("/")[2]].encode())

    def route_nullerror(self, body):
        self._start_stream()
        self.event({**chunk("ok", "stop"), "error": None})
        self.wfile.write(b"data: [DONE]\n\n")

    def route_busy(self, body):
        """503 asking for a wait (retry-after-ms, or Retry-After as an HTTP date 5 s ahead) once, then a reply."""
        if type(self).hits[self.path] > 1:
            return self.route_ok(body)
        how = self.path.split("/")[2]
        in_5_s = formatdate(time.time() + 5, usegmt=True)
        wait = ("retry-after-ms", "1500") if how == "ms" else ("retry-after", in_5_s)
        self.send_response(503)
        self.send_header(*wait)
        self.send_header("content-length", "0")
        self.end_headers()

    def route_gzip(self, body):
        """A body that says gzip and is not."""
        status, garbage = int(self.path.split("/")[2]), b"this is not gzip"
        self.send_response(status)
        self.send_header("content-type", "text/event-stream" if body.get("stream") else "application/json")
        self.send_header("content-encoding", "gzip")
        self.send_header("content-length", str(len(garbage)))
        self.end_headers()
        self.wfile.write(garbage)

    def route_loop(self, body):
        self.send_response(307)
        self.send_header("location", self.path)
        self.send_header("content-length", "0")
        self.end_headers()

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
    or the async client; a stream's deltas joined. The base URL gets /v1 here (one with a path is used as given):
    the routes count hits at /<route>/v1/..."""
    def sync(url, name, *args, stream=False, **settings):
        with Client(url + "/v1", **{"max_retries": 0, **settings}) as client:
            out = getattr(client, name)(*args, **({"stream": True} if stream else {}))
            return "".join(out) if stream else out

    async def run_async(url, name, *args, stream=False, **settings):
        async with AsyncClient(url + "/v1", **{"max_retries": 0, **settings}) as client:
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
    # The client gave up before the server answered, so the handler may not have counted the request yet. A
    # resend would have been sent before the client gave up: once the first is counted, a resend's count is given
    # two more timeouts to show.
    hits_reaching(handler, "/slow/v1/completions", 1)
    time.sleep(2 * TIMEOUT_S)
    assert handler.hits["/slow/v1/completions"] == 1


def test_a_read_only_call_s_timeout_is_still_retried(server, call):
    url, handler = server
    with pytest.raises(APITimeoutError):
        call(url + "/slow", "models", timeout=TIMEOUT_S, max_retries=2, backoff_s=0.01)
    assert hits_reaching(handler, "/slow/v1/models", 3) == 3


def hits_reaching(handler, path: str, want: int, deadline_s: float = 10.0) -> int:
    """The path's hits once they reach `want` (or the deadline passes): a request the client timed out on is
    counted by a handler thread the client does not wait for, later on a loaded box."""
    deadline = time.monotonic() + deadline_s
    while handler.hits[path] < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return handler.hits[path]


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


# -- 7: second review: linear line splitting, one classification with or without a stream, EOF per the spec ---

class _CountingPattern:
    """The splitter's line-end pattern, counting the characters it is asked to search."""

    def __init__(self, pattern):
        self.pattern, self.searched = pattern, 0

    def __getattr__(self, name):
        method = getattr(self.pattern, name)

        def counted(text, *args, **kwargs):
            self.searched += len(text)
            return method(text, *args, **kwargs)
        return counted


def test_the_line_splitter_searches_each_character_once(monkeypatch):
    """Each chunk ran the pattern over the line begun plus the chunk: a 16 MiB line in 64 KiB chunks took 12 s."""
    from saguaro_dist.client import _sse
    counting = _CountingPattern(_sse._LINE_END)
    monkeypatch.setattr(_sse, "_LINE_END", counting)
    line = "data: " + "x" * (1 << 20)
    data = (line + "\r\n\r\n").encode()
    splitter, lines = _sse.LineSplitter(), []
    for i in range(0, len(data), 4096):
        lines += splitter.feed(data[i:i + 4096])
    assert lines + splitter.finish() == [line, ""]
    assert counting.searched <= len(data)


def test_a_non_streamed_503_whose_body_breaks_off_is_typed_and_retried(server, call):
    """Without stream=True httpx read the body inside send(): the break was 'cannot reach', status lost, not retried."""
    url, handler = server
    with pytest.raises(InternalServerError, match="broke off") as err:
        call(url + "/broken503", "complete", "x", max_retries=2, backoff_s=0.01)
    assert err.value.status_code == 503 and handler.hits["/broken503/v1/completions"] == 3


@pytest.mark.parametrize("tail", ["midline", "noblank"])
def test_an_event_the_body_leaves_unended_is_discarded(server, call, tail):
    """The SSE spec (and openai's decoder) discard an event unended at EOF. It was dispatched: half a JSON chunk was
    an APIResponseValidationError (never retried: 'not the API's reply'), not the truncation it is."""
    url, _ = server
    with pytest.raises(APIConnectionError, match="ended before \\[DONE\\]"):
        call(f"{url}/tail/{tail}", "complete", "x", stream=True)


def test_a_chunk_with_a_null_error_is_no_error(server, call):
    url, _ = server
    assert call(url + "/nullerror", "complete", "x", stream=True) == "ok"


@pytest.mark.parametrize("how, low, high", [("ms", 1.5, 1.5), ("date", 3.0, 5.0)])
def test_retry_after_ms_and_an_http_date_are_waited_for(server, monkeypatch, how, low, high):
    """Only Retry-After in seconds was read: a date or retry-after-ms fell back to backoff (0 here)."""
    from saguaro_dist.client import client as client_module
    slept = []
    monkeypatch.setattr(client_module, "time", SimpleNamespace(sleep=slept.append))  # record the wait, skip it
    url, _ = server
    with Client(f"{url}/busy/{how}", max_retries=1, backoff_s=0) as client:
        assert client.complete("x").text == "POST x"
    assert len(slept) == 1 and low <= slept[0] <= high


def test_retry_after_headers_are_read_as_openai_does():
    import httpx

    from saguaro_dist.client import RetryPolicy
    policy = RetryPolicy(backoff_s=0, max_backoff_s=8)
    assert policy.delay(0, httpx.Headers({"retry-after-ms": "250", "Retry-After": "3"})) == 0.25
    assert policy.delay(0, httpx.Headers({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) == 0  # passed: now
    assert policy.delay(0, httpx.Headers({"Retry-After": formatdate(time.time() + 60, usegmt=True)})) == 8  # cap
    assert policy.delay(0, "2") == 2 and policy.delay(0, "soon") == 0


@pytest.mark.parametrize("status, error", [(200, APIResponseValidationError), (503, InternalServerError)])
@pytest.mark.parametrize("stream", [False, True])
def test_a_body_that_does_not_decode_is_a_typed_error(server, call, status, error, stream):
    """httpx.DecodingError (a corrupt gzip body) escaped raw."""
    url, _ = server
    with pytest.raises(error):
        call(f"{url}/gzip/{status}", "complete", "x", stream=stream)


def test_a_redirect_loop_names_the_limit(server, call):
    """It said the redirect was 'not followed (only a 307/308 of a POST ... is)', of a 307 it had followed 5 times."""
    url, handler = server
    with pytest.raises(APIStatusError, match="limit of 5") as err:
        call(url + "/loop", "complete", "x")
    assert err.value.status_code == 307 and handler.hits["/loop/v1/completions"] == 6
