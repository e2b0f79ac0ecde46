"""When a failed request is sent again, which redirects are followed, and what a transport failure is called.

Retries: a request is sent again only where the server demonstrably did not process it, or says to try again:
- any call: a connection never made (httpx's ConnectError, ConnectTimeout, PoolTimeout), 408, 429 and 503;
- a generation (completions, chat), stateless: also 502 (a proxy that got no valid reply);
- a read-only call (GET, /tokenize, /reset_prefix_cache): also 500 and 504, and any other transport failure
  (a read or write timeout, a dropped connection).
Never retried: a generation's read/write timeout, dropped connection, 500 or 504 (the server has the request and may
still be generating it: a retry would run it again, as openai's retries of timeouts do), nor a runtime LoRA
load/unload's 5xx other than 503 (its state may have changed: a second load of the name fails or reloads it).
An error reply's `x-should-retry` header overrides all of this, as in the openai SDK: "true" retries it, "false"
never does (the server knows whether a second send is safe); any other value leaves the rules above to decide.
"""
from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

import httpx

from saguaro_dist.client.errors import (APIConnectionError, APIResponseValidationError, APIStatusError,
                                        APITimeoutError)

MAX_REDIRECTS = 5
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # the request never left


class RequestKind(Enum):
    """What sending a request twice does: decides its retries (should_retry)."""
    READ_ONLY = "read_only"      # nothing changes: GET, /tokenize, /reset_prefix_cache (twice is once)
    GENERATION = "generation"    # no state, but the server spends a generation on each copy
    STATEFUL = "stateful"        # changes the server: runtime LoRA load/unload


_RETRY_STATUSES = {RequestKind.READ_ONLY: frozenset({408, 429, 500, 502, 503, 504}),
                   RequestKind.GENERATION: frozenset({408, 429, 502, 503}),
                   RequestKind.STATEFUL: frozenset({408, 429, 503})}


def should_retry(kind: RequestKind, error: Exception, headers: Mapping | None = None) -> bool:
    """headers: the error reply's (None for a transport failure): its x-should-retry wins."""
    server_says = (headers or {}).get("x-should-retry")  # (not a standard header; openai's exact "true"/"false")
    if server_says in ("true", "false") and isinstance(error, APIStatusError):
        return server_says == "true"
    if isinstance(error, APIConnectionError):
        cause = error.__cause__
        if isinstance(cause, httpx.LocalProtocolError):  # ours to fix: no retry makes it sendable
            return False
        return isinstance(cause, NOT_SENT) or kind is RequestKind.READ_ONLY
    return getattr(error, "status_code", None) in _RETRY_STATUSES[kind]


def transport_error(method: str, url, err: httpx.TransportError) -> APIConnectionError:
    """The SDK's error for an httpx one. h11's text for a header it refuses quotes the header's value (the API key):
    that text is never used."""
    url = _request_url(err) or url  # after a redirect, the target's
    if isinstance(err, httpx.LocalProtocolError):
        error = APIConnectionError(f"{method} {url} could not be sent: a header or the request is malformed "
                                   f"({type(err).__name__})")
    elif isinstance(err, httpx.TimeoutException):
        error = APITimeoutError(f"{method} {url} timed out ({type(err).__name__}): {err}")
    else:
        error = APIConnectionError(f"cannot reach {url} ({type(err).__name__}): {err}")
    error.__cause__ = err
    return error


def _request_url(err: httpx.TransportError):
    try:
        return err.request.url
    except RuntimeError:  # (an error raised before httpx tied it to a request)
        return None


def redirect_to_follow(response: httpx.Response) -> httpx.Request | None:
    """The request a redirect asks for, where following it is safe: the same method (a POST's 307 or 308, which
    keep the body; any redirect of a GET) and no step down from https to http. httpx drops the Authorization
    header when the origin changes. Otherwise None: the 3xx is an error (redirect_error)."""
    target, request = response.next_request, response.request
    if target is None or target.method != request.method:  # (301/302/303 turn a POST into a GET: the prompt lost)
        return None
    return None if request.url.scheme == "https" and target.url.scheme == "http" else target


def redirect_error(response: httpx.Response) -> APIStatusError:
    """A 3xx not followed: one that is unsafe to follow, or one past the limit of MAX_REDIRECTS (a loop)."""
    location = response.headers.get("location")
    where = f"to {location}" if location else "without a Location"
    request = response.request
    if redirect_to_follow(response) is not None:
        why = f"after {MAX_REDIRECTS} redirects followed (the limit of {MAX_REDIRECTS}; a redirect loop?)"
    else:
        why = "not followed (only a 307/308 of a POST, or a GET's, is)"
    return APIStatusError(response.status_code, f"{request.method} {request.url} was redirected {where}, {why}: "
                                                f"set the client's base_url to the target", body=None)


def decoding_error(status_code: int, err: httpx.DecodingError) -> APIResponseValidationError:
    """A body whose content-encoding does not decode (corrupt gzip): a reply that is not the API's, never retried
    (httpx's DecodingError escaped raw)."""
    error = APIResponseValidationError(status_code, f"the reply's body could not be decoded ({type(err).__name__}): "
                                                    f"{err}")
    error.__cause__ = err
    return error
