"""Errors in the OpenAI envelope `{"error": {"message", "type", "param", "code"}}`.

Clients only ever see a message we chose: unexpected exceptions are logged here with their stack
trace and answered with a generic 500.
"""
from __future__ import annotations

import functools
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from saguaro_dist.error_types import error_type

log = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went away (nobody reads it)


class APIError(Exception):
    """An error with a status and a message meant for the client."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """The first problem, phrased for humans, and the request field it concerns."""
    first = err.errors()[0]
    loc = _field_path([p for p in first.get("loc", ()) if p != "body"], err.body, first.get("type"))
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if param is None and first.get("type") == "value_error":  # a check across fields: it names the field first
        return msg, _param_of(msg)
    if param is None:  # the body itself is wrong: not an object, or not JSON at all
        return "the request body must be a JSON object", None
    return f"{param}: {msg}", param


def _field_path(loc: list, body, kind: str | None) -> list[str]:
    """The loc's steps into the request body. Pydantic adds the label of each union member it tried ("str",
    "list[...]", a tag such as "message"), which names no field: those are left out ("input.0.content", not
    "input.items.0.message.content"). A missing field is the last step, absent from the body."""
    if not isinstance(body, (dict, list)):
        return [str(p) for p in loc]
    path, node = [], body
    for n, part in enumerate(loc):
        if isinstance(node, dict) and (part in node or (n == len(loc) - 1 and kind == "missing")):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif part != "[key]":  # a union member's label (pydantic's "[key]", a mapping's key at fault, stays)
            continue
        path.append(str(part))
    return path


async def _on_validation(_: Request, err: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(err)
    return error_response(400, message, param)


async def _on_api_error(_: Request, err: APIError) -> JSONResponse:
    return error_response(err.status, err.message, err.param, err.code)


async def _on_http(_: Request, err: StarletteHTTPException) -> JSONResponse:
    return error_response(err.status_code, str(err.detail), headers=getattr(err, "headers", None))


async def _on_value_error(_: Request, err: ValueError) -> JSONResponse:
    # Engine and SamplingParams validation: the message names the field and is safe to show.
    if _adapter_dropped(err):
        return error_response(500, str(err))
    return error_response(400, str(err), _param_of(str(err)))


def _adapter_dropped(err: ValueError) -> bool:
    """The engine's AdapterDroppedError (on Ray its text alone arrives): a served adapter it dropped past
    max_cpu_loras can no longer be read. The server's state, not the request's fault: a 500 (not a 503: retrying
    cannot help until the adapter is loaded again), with the engine's text, which says so."""
    from saguaro_dist.engine.lora_slots import (
        AdapterDroppedError,  # (the engine's module: loaded with the app's)
    )
    if AdapterDroppedError.PHRASE not in str(err):
        return False
    log.error("%s", err)
    return True


async def _on_unexpected(request: Request, err: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    if getattr(err, "retriable", False):
        return error_response(503, "the engine failed while serving this request; retry it")
    return error_response(500, "internal server error")


class UnexpectedErrorMiddleware:
    """Answers an exception no handler took with the 500 envelope (_on_unexpected logs it, once). Starlette runs an
    `Exception` handler in its outermost ServerErrorMiddleware, which sends the 500 and then re-raises: uvicorn then
    logs it again and drops the connection, while the 500 said nothing of closing it, so a client's next request on
    that kept-alive connection was reset unanswered. Added innermost: the request counter sees the 500."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, watch)
        except ClientDisconnect:  # hung up while sending its body: nobody reads a reply, and it is no server error
            if not started:
                await Response(status_code=CLIENT_CLOSED_REQUEST)(scope, receive, send)
        except Exception as err:  # noqa: BLE001 - every error: its traceback is logged by _on_unexpected
            if started:  # a reply half sent (a stream's own errors go out as events): the server drops the
                raise    # connection, the one way left to tell the client the reply is cut short
            response = await _on_unexpected(Request(scope), err)
            await response(scope, receive, send)


def stream_error(err: Exception) -> dict:
    """The envelope for an error after a stream's headers went out (no status to set any more)."""
    if isinstance(err, APIError):
        return error_body(err.status, err.message, err.param, err.code)
    if isinstance(err, ValueError):
        if _adapter_dropped(err):
            return error_body(500, str(err))
        return error_body(400, str(err), _param_of(str(err)))
    log.exception("generation failed mid-stream", exc_info=err)
    if getattr(err, "retriable", False):
        return error_body(503, "the engine failed while serving this request; retry it")
    return error_body(500, "internal server error")


def _param_of(message: str) -> str | None:
    """Our ValueErrors start with the field they concern ("max_tokens must be ..."): a request field."""
    head = message.split(" ", 1)[0]
    return head if head in _request_fields() else None


@functools.cache
def _request_fields() -> frozenset[str]:
    """Every field a generation request may name (derived, so a new field needs no entry here). Imported
    on first use: the protocol module imports this one."""
    from saguaro_dist.serve.protocol import ChatCompletionRequest, CompletionRequest
    return frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)


def install_error_handlers(app: FastAPI) -> None:
    # Imported here: the engine is not for protocol's importers.
    from saguaro_dist.engine.loop_thread import EngineError

    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(ValueError, _on_value_error)
    # Starlette answers an `Exception` handler's errors outside every middleware, so requests_total counted
    # the engine's 503s as 500s; a handler for the class itself answers inside them.
    app.add_exception_handler(EngineError, _on_unexpected)
    app.add_exception_handler(Exception, _on_unexpected)  # what escapes the outer middlewares (api.create_app)
