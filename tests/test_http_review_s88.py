"""The serving app under uvicorn on loopback: an unexpected exception is a 500 envelope on a connection that stays
usable (logged once), and a streamed error event's `type` gives the client its status when its `code` is a name."""
from __future__ import annotations

import http.client
import json
import logging
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import Request
from fastapi.responses import StreamingResponse

from http_helpers import serve_on_loopback
from saguaro_dist.client import Client, InternalServerError, SaguaroError
from saguaro_dist.serve import info_routes, responses
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.errors import APIError, error_body, stream_error

pytest_plugins = ["test_serve_fixtures"]
BUG = "a test-only route's bug"


async def _buggy(request: Request):
    raise RuntimeError(BUG)  # what any route's unforeseen bug looks like to the app


async def _half_sent(request: Request):
    async def chunks():
        yield b"data: one\n\n"
        raise RuntimeError(BUG)  # after the headers: the reply is cut short
    return StreamingResponse(chunks(), media_type="text/event-stream")


async def _error_event(request: Request):
    """A stream whose only event is the server's envelope (stream_error) for the status the prompt names, with a
    code that is a name (as a mid-stream APIError's "model_not_found")."""
    status = int((await request.json())["prompt"])
    event = stream_error(APIError(status, f"failed with {status}", code="named_code"))
    return StreamingResponse(iter([responses.sse(event) + responses.sse("[DONE]")]), media_type="text/event-stream")


@pytest.fixture(scope="module")
def root(reference_llm):
    """The real app, plus test-only routes (the real /v1 routes untouched) under /buggy/v1 and /typed/v1."""
    app = create_app(reference_llm, ServerOptions("tiny"))
    app.add_api_route("/buggy/v1/completions", _buggy, methods=["POST"])
    app.add_api_route("/buggy/v1/models", info_routes.models, methods=["GET"])
    app.add_api_route("/buggy/half_sent", _half_sent, methods=["GET"])
    app.add_api_route("/typed/v1/completions", _error_event, methods=["POST"])
    with serve_on_loopback(app) as url:
        yield url.removesuffix("/v1")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def server_logs():
    """The records of the app's error logger and of uvicorn's (whose "Exception in ASGI application" was a second
    traceback, for an exception the app had answered)."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("saguaro_dist.serve.errors", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


def test_a_route_bug_is_a_500_envelope_and_the_connection_stays_usable(root, server_logs):
    """It was answered by Starlette's ServerErrorMiddleware, which re-raised: uvicorn closed the kept-alive connection
    the 500 had not said it would close, and the next request sent on it was never answered."""
    where = urlsplit(root)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    try:
        for _ in range(3):
            conn.request("POST", "/buggy/v1/completions", body=b'{"prompt": "x"}',
                         headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            assert reply.status == 500
            assert json.loads(reply.read())["error"] == {"message": "internal server error", "type": "server_error",
                                                         "param": None, "code": 500}
            conn.request("GET", "/v1/models")  # on the same connection
            reply = conn.getresponse()
            assert reply.status == 200 and json.loads(reply.read())["data"][0]["id"] == "tiny"
    finally:
        conn.close()
    # each logged once, with its traceback: by the app, not again by uvicorn
    assert [r.name for r in server_logs] == ["saguaro_dist.serve.errors"] * 3
    assert all(r.levelno == logging.ERROR and str(r.exc_info[1]) == BUG for r in server_logs)


def test_the_sdk_client_goes_on_after_a_500(root):
    """The SDK's pooled connection (httpx), no retries to hide a reset: the next call after each 500 is answered."""
    with Client(f"{root}/buggy/v1", model="tiny", max_retries=0) as client:
        for _ in range(10):
            with pytest.raises(InternalServerError):
                client.complete("x", max_tokens=2)
            assert client.models() == ["tiny"]


def test_an_error_after_the_headers_still_cuts_the_reply_short(root):
    """A reply half sent cannot become a 500: the connection is dropped, so the client sees a truncated reply (never
    one that ends as if complete), and the server goes on serving."""
    with httpx.Client(timeout=60) as http:
        with http.stream("GET", f"{root}/buggy/half_sent") as reply:
            assert reply.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                reply.read()
        assert http.get(f"{root}/v1/models").status_code == 200


@pytest.mark.parametrize("status, expected", [(400, 400), (401, 401), (403, 403), (404, 404), (408, 408),
                                              (413, 400), (429, 429), (500, 500), (502, 500), (503, 503)])
def test_a_streamed_error_with_a_named_code_has_the_status_of_its_type(root, status, expected):
    """404 (not_found_error), 429 (rate_limit_error), ... were 500s: only an int code or invalid_request_error
    gave a status. A type several statuses share gives the first (413 -> invalid_request_error -> 400)."""
    with Client(f"{root}/typed/v1", model="tiny", max_retries=0) as client:
        with pytest.raises(SaguaroError) as caught:
            list(client.complete(str(status), max_tokens=2, stream=True))
    assert caught.value.status_code == expected
    assert f"failed with {status}" in str(caught.value)


def test_the_shared_table_maps_each_servers_type_back_to_its_status():
    from saguaro_dist.error_types import STATUS_TYPES, status_of_type

    for status in (*STATUS_TYPES, 500, 501, 502, 504, 418):
        back = status_of_type(error_body(status, "m")["error"]["type"])
        assert error_body(back, "m")["error"]["type"] == error_body(status, "m")["error"]["type"]
        assert back == (status if status in (400, 401, 403, 404, 408, 429, 500, 503) else 400 if status < 500 else 500)
    assert status_of_type("insufficient_quota") is None and status_of_type(None) is None


def test_a_client_that_hangs_up_mid_body_is_a_499_and_no_server_error(reference_llm, server_logs):
    """A raw-body route's request.json() raised Starlette's ClientDisconnect: logged as an unhandled error with its
    traceback and counted as a 500 (a reviewer's reproduction); nobody reads the reply, and no server part failed."""
    import asyncio
    app = create_app(reference_llm, ServerOptions("tiny"))
    app.add_api_route("/raw", _error_event, methods=["POST"])  # reads request.json() itself
    messages = iter([{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}])
    sent = []

    async def receive():
        return next(messages, {"type": "http.disconnect"})

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/raw", "raw_path": b"/raw", "root_path": "", "query_string": b"", "server": ("127.0.0.1", 80),
             "client": ("127.0.0.1", 5), "headers": [(b"content-type", b"application/json")]}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert not [r for r in server_logs if r.levelno >= logging.ERROR]
