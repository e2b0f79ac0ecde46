"""Typed errors: each carries the server's message, HTTP status and the OpenAI error fields."""
from __future__ import annotations

import json


class SaguaroError(Exception):
    """Base of every error the client raises."""


class APIConnectionError(SaguaroError):
    """The server could not be reached (after retries)."""


class APITimeoutError(APIConnectionError):
    """The request timed out (after retries)."""


class APIResponseValidationError(SaguaroError):
    """A success status whose body is not what the API sends: an HTML page from a proxy or a captive portal,
    a JSON reply to a request for a stream. Names the status and the body's start."""

    def __init__(self, status_code: int, message: str, *, body=None):
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.body = body


class StreamClosedError(SaguaroError):
    """A stream iterated after it was closed before its end (a loop left early, close()): its rest is gone."""


class APIStatusError(SaguaroError):
    """The server answered with an error status (or an error event inside a stream)."""

    def __init__(self, status_code: int, message: str, *, type: str | None = None, param: str | None = None,
                 code=None, body=None):
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.body = body


class BadRequestError(APIStatusError):
    pass


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class RequestTooLargeError(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    pass


class InternalServerError(APIStatusError):
    pass


_BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
              413: RequestTooLargeError, 422: BadRequestError, 429: RateLimitError}


def status_error(status_code: int, body) -> APIStatusError:
    """The typed error for a status and a (possibly non-JSON) error body."""
    error = body.get("error") if isinstance(body, dict) else None
    if error is None and isinstance(body, dict) and "message" in body:
        error = body  # vLLM's flat ErrorResponse: {"object": "error", "message", "type", "param", "code"}
    if isinstance(error, dict):  # without a message, the error itself: an empty one said nothing ('429: ')
        message, fields = str(error.get("message") or json.dumps(error, separators=(",", ":"), default=str)), error
    else:
        message, fields = (str(error or body) if body else f"HTTP {status_code}"), {}
    cls = InternalServerError if status_code >= 500 else _BY_STATUS.get(status_code, APIStatusError)
    return cls(status_code, message, type=fields.get("type"), param=fields.get("param"), code=fields.get("code"),
               body=body)
