"""openai's per-request options of a generation: `extra_body`, `extra_headers`, `extra_query` and `timeout`.
They were sent as top-level JSON fields (a server ignores unknown fields: the options did nothing)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from saguaro_dist.client._common import client_timeout

OPTION_NAMES = ("extra_body", "extra_headers", "extra_query", "timeout")


@dataclass(frozen=True)
class RequestOptions:
    """What one request adds to the client's: headers (win over the client's), query parameters, a timeout
    (seconds, an httpx.Timeout, or None: no limit); httpx's client default where not given."""
    headers: Mapping | None = None
    query: Mapping | None = None
    timeout: object = httpx.USE_CLIENT_DEFAULT

    def request_args(self) -> dict:
        """httpx's build_request arguments (a followed redirect keeps them: httpx copies headers and timeout)."""
        return {"headers": self.headers, "params": self.query, "timeout": self.timeout}


DEFAULT = RequestOptions()


def split_options(extra: dict) -> tuple[dict, RequestOptions]:
    """(the body's extra fields, extra_body merged over them as openai merges it: shallow, extra_body wins; the
    request's options). timeout: seconds as the client's (at most 5 s of them to connect), None no limit (openai's),
    an httpx.Timeout as given; left out, the client's."""
    extra = dict(extra)
    body, headers, query = (_mapping(name, extra.pop(name, None)) for name in OPTION_NAMES[:3])
    timeout = extra.pop("timeout", httpx.USE_CLIENT_DEFAULT)
    if timeout is not httpx.USE_CLIENT_DEFAULT:
        timeout = client_timeout(timeout)  # a number: the client's rule, at most 5 s to connect
    return {**extra, **(body or {})}, RequestOptions(headers, query, timeout)


def _mapping(name: str, value) -> Mapping | None:
    if value is not None and not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {value!r:.200}")
    return value
