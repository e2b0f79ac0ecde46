"""Python SDK for saguaro servers (and any OpenAI-compatible server).

    from saguaro_dist.client import Client
    with Client("http://127.0.0.1:8000", api_key="...") as client:
        print(client.complete("def add(a, b):", max_tokens=32, temperature=0).text)
        for delta in client.chat("Write a haiku", stream=True):
            print(delta, end="")

Light on purpose: httpx only, no torch or ray.
"""
from __future__ import annotations

from saguaro_dist.client._common import Completion, RetryPolicy
from saguaro_dist.client.async_client import AsyncClient, AsyncStream
from saguaro_dist.client.client import Client, Stream
from saguaro_dist.client.errors import (APIConnectionError, APIResponseValidationError, APIStatusError, APITimeoutError,
                                        AuthenticationError, BadRequestError, InternalServerError, NotFoundError,
                                        PermissionDeniedError, RateLimitError, RequestTooLargeError, SaguaroError,
                                        StreamClosedError)

__all__ = ["Client", "AsyncClient", "Stream", "AsyncStream", "Completion", "RetryPolicy", "SaguaroError",
           "APIConnectionError", "APITimeoutError", "APIStatusError", "BadRequestError", "AuthenticationError",
           "PermissionDeniedError", "NotFoundError", "RequestTooLargeError", "RateLimitError", "InternalServerError",
           "APIResponseValidationError", "StreamClosedError"]
