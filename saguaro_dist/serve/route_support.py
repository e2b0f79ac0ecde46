"""What every route of the API app (api.py) shares: the serving state, the request's id, the chat reply's role,
cancelling a generation whose client hung up, and a streamed body that closes when streaming stops early."""
from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from saguaro_dist.serve.errors import CLIENT_CLOSED_REQUEST, APIError
from saguaro_dist.serve.protocol import REQUEST_ID_PATTERN
from saguaro_dist.serve.state import ServingState

log = logging.getLogger(__name__)


class ClosingStreamingResponse(StreamingResponse):
    """Closes the body iterator when streaming stops early (the client went away and the request was
    cancelled), so the engine aborts the generation now, not whenever the generator is garbage collected."""

    async def stream_response(self, send) -> None:
        async with aclosing(self.body_iterator):
            await super().stream_response(send)


def serving_state(request: Request) -> ServingState:
    return request.app.state.saguaro


def response_role(request: Request) -> str:
    """The server's --response-role (ServerOptions.response_role): a new chat turn's role."""
    return request.app.state.response_role


def cancel_on_disconnect(handler):
    """Runs a generating route's handler until its client hangs up, then cancels it: its generations abort.
    Ray Serve cancels a handler whose client went away; a plain ASGI server (uvicorn) only says so through
    `receive`, so without this a non-streamed request, or a stream still waiting for its first delta, went
    on generating for nobody (vLLM's with_cancellation). A stream once answered is StreamingResponse's."""
    @functools.wraps(handler)
    async def watched(*args, **kwargs):
        work = asyncio.ensure_future(handler(*args, **kwargs))
        hung_up = asyncio.ensure_future(_hung_up(kwargs["request"]))
        try:
            await asyncio.wait((work, hung_up), return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and hung_up.result():
                log.debug("%s: the client went away; cancelling its generations", handler.__name__)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return await work
        finally:
            hung_up.cancel()
            if not work.done():  # the client went away, or this handler was cancelled (Ray Serve)
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)  # its aborts are sent before we return
    return watched


async def _hung_up(request: Request) -> bool:
    """True once the client disconnects (the body is read by now: the next message is the hang-up);
    False when the server cannot say (its receive failed), so the handler just runs on."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - watching is best effort; it must never fail the request
        log.debug("cannot watch this request for a disconnect", exc_info=True)
        return False
    return True


def request_id_of(request: Request, from_body: str | None = None) -> str:
    """The request's id, vLLM's way: the X-Request-Id header, else the body's request_id, else a fresh one.
    The response's id is "<cmpl|chatcmpl>-<it>" and the logs name the request's generations by it. Ray Serve
    echoes the header in the response, and, when the client sent none, forwards one of its own, which then
    wins over a body's request_id as any gateway's header does (logged)."""
    given = request.headers.get("x-request-id")
    if given is None:
        return from_body or uuid.uuid4().hex
    if not REQUEST_ID_PATTERN.fullmatch(given):
        raise APIError(400, "X-Request-Id must be 1-128 letters, digits, '.', '_', ':' or '-'", param="X-Request-Id")
    if from_body is not None and from_body != given:
        log.info("request_id %r: the X-Request-Id header names this request %r (the header wins, as in vLLM)",
                 from_body, given)
    return given
