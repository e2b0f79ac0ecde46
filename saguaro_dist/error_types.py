"""The OpenAI error envelope's `type` for each HTTP status: the server writes it (serve/errors.py); the client reads
the status back from it where no status arrives (an error event inside a stream, sent after a 200's headers).
No imports: the light client and the server both use it."""
from __future__ import annotations

SERVER_ERROR = "server_error"
INVALID_REQUEST = "invalid_request_error"
# (the `openai` client maps the status itself; the type is for humans, and for a streamed error's status)
STATUS_TYPES = {
    400: INVALID_REQUEST, 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: INVALID_REQUEST, 408: "timeout_error",
    413: INVALID_REQUEST, 429: "rate_limit_error", 503: "service_unavailable_error",
}


def error_type(status: int) -> str:
    return STATUS_TYPES.get(status, SERVER_ERROR if status >= 500 else INVALID_REQUEST)


def status_of_type(kind) -> int | None:
    """The status a type stands for: the lowest that has it (400 for invalid_request_error, 500 for server_error);
    None for a type not in the table."""
    if kind == SERVER_ERROR:
        return 500
    return min((status for status, name in STATUS_TYPES.items() if name == kind), default=None)
