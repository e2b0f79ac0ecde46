"""Plain ASGI middleware (not BaseHTTPMiddleware, which buffers and breaks streaming and disconnects)."""
from __future__ import annotations

import hashlib
import hmac
import json

from starlette.exceptions import HTTPException

from saguaro_dist.serve.errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})  # reachable without the API key: probes and Prometheus scrapers (vLLM's)


def app_path(scope) -> str:
    """The request's path inside this app: without the prefix it is mounted under (a Serve route_prefix
    arrives as the ASGI root_path, which `path` includes)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


async def send_error(send, status: int, message: str, headers: list | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _digest(token: bytes) -> bytes:
    """Keys are compared as digests: equal lengths, so a comparison's time tells nothing of a key's length."""
    return hashlib.sha256(token).digest()


def bearer_token(authorization: bytes) -> bytes | None:
    """The token of `Authorization: Bearer <token>`; the scheme in any case (RFC 9110, and vLLM's); None otherwise."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.lstrip() if scheme.lower() == b"bearer" else None


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but the open ones; 401 otherwise. OPTIONS requests pass
    (vLLM's): a preflight carries no key, with or without an Origin header."""

    def __init__(self, app, api_key: str | tuple[str, ...]):
        self.app = app
        keys = (api_key,) if isinstance(api_key, str) else api_key  # several: any one authenticates (vLLM's)
        self._expected = [_digest(key.encode()) for key in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or self._open(scope) or self._authorized(scope):
            return await self.app(scope, receive, send)
        await send_error(send, 401, "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                         [(b"www-authenticate", b"Bearer")])

    @staticmethod
    def _open(scope) -> bool:
        # "/health/" too: a probe configured with the slash gets the app's redirect, not a 401
        return (app_path(scope).rstrip("/") or "/") in OPEN_PATHS

    def _authorized(self, scope) -> bool:
        token = bearer_token(dict(scope["headers"]).get(b"authorization", b""))
        if token is None:
            return False
        given = _digest(token)
        # constant time, and every key compared: no key guessing by timing
        return sum(hmac.compare_digest(given, expected) for expected in self._expected) > 0


class RootPathMiddleware:
    """The app served under `root_path`, the prefix a reverse proxy in front adds, composed with the root path the
    server already set (a Serve route_prefix): /api + /llm, as Serve's own http_options root_path composes. FastAPI's
    `app.root_path` would replace Serve's /llm instead, and no route would match. A path the proxy stripped gets the
    prefix back (ASGI's path includes root_path); one it kept is left as it is."""

    def __init__(self, app, root_path: str):
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            root = self.root_path + scope.get("root_path", "")
            path = scope["path"]
            if not (path == root or path.startswith(root + "/")):
                path = self.root_path + path
            # in place, as FastAPI sets its root_path: the outer middleware read the path after the call
            scope.update(root_path=root, path=path)
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for bodies over the limit: at once from Content-Length, or while reading a chunked body."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, 413, self._message())
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive):
        seen = 0

        async def wrapped():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                # FastAPI re-raises HTTPExceptions from body reading, so our handler answers 413.
                raise HTTPException(413, self._message())
            return message
        return wrapped

    def _message(self) -> str:
        return f"request body larger than {self.max_bytes} bytes"


class RequestCountMiddleware:
    """Counts requests by route and response status into the serving metrics (but uncounted_paths')."""

    def __init__(self, app, metrics, known_paths: frozenset[str], uncounted_paths: frozenset[str] = frozenset()):
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths
        self.uncounted_paths = uncounted_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or app_path(scope) in self.uncounted_paths:
            return await self.app(scope, receive, send)
        status = 500

        async def capture(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, capture)
        finally:
            # Unknown paths share one label so scanners cannot blow up the metric's cardinality.
            route = app_path(scope) if app_path(scope) in self.known_paths else "other"
            self.metrics.request(route, status)
