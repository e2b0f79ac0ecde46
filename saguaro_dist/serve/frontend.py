"""vLLM's HTTP-frontend options that live in the app itself, so they hold under either ingress (the replica's
own server or Serve's proxy): CORS, the FastAPI root_path, and the OpenAPI docs routes.

App args (`saguaro serve` flags, or a `serve run` / KubeRay manifest's args, whose values may arrive as strings):
    allowed_origins, allowed_methods, allowed_headers: JSON lists (default ["*"], as vLLM)
    allow_credentials: bool (default false); root_path: str (default none); disable_fastapi_docs: bool (default false)
"""
from __future__ import annotations

import json
from dataclasses import dataclass

CORS_LIST_ARGS = ("allowed_origins", "allowed_methods", "allowed_headers")
FRONTEND_ARGS = frozenset({*CORS_LIST_ARGS, "allow_credentials", "root_path", "disable_fastapi_docs"})
_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


@dataclass(frozen=True)
class FrontendOptions:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""  # the path prefix a reverse proxy serves this app under (FastAPI's root_path)
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json

    def __post_init__(self):
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"root_path must start with '/' and not end with one (e.g. /llm), got {self.root_path!r}")


def json_list(name: str, value) -> tuple[str, ...]:
    """A list of strings: a list, or its JSON text (vLLM's flags take JSON: '["https://a.example"]')."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f'{name} must be a JSON list of strings, e.g. \'["https://example.com"]\', '
                             f"got {value!r}") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{name} must be a list of non-empty strings, got {value!r}")
    return tuple(value)


def _flag(name: str, value) -> bool:
    """A manifest's bool ("true" from `serve run`); any other word is an error, not False."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word not in _BOOLS:
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return _BOOLS[word]


def frontend_options(args: dict) -> FrontendOptions:
    """The app args' frontend options, checked (a bad one fails build_app, at deploy time)."""
    given = {name: args[name] for name in FRONTEND_ARGS if args.get(name) is not None}
    values = {name: json_list(name, given[name]) for name in CORS_LIST_ARGS if name in given}
    for name in ("allow_credentials", "disable_fastapi_docs"):
        if name in given:
            values[name] = _flag(name, given[name])
    if "root_path" in given:
        values["root_path"] = str(given["root_path"])
    return FrontendOptions(**values)


def docs_settings(options: FrontendOptions) -> dict:
    """FastAPI's constructor arguments for the docs routes: FastAPI's defaults unless disabled (vLLM's)."""
    return {"docs_url": None, "redoc_url": None, "openapi_url": None} if options.disable_fastapi_docs else {}


def install_frontend(app, options: FrontendOptions) -> None:
    """Starlette's CORSMiddleware, always, as vLLM adds it: it answers browsers' preflight OPTIONS requests
    (before the API key check, which a preflight cannot pass) and marks responses for the allowed origins. Then
    the root path, outside both (they see the path inside the app), composed with a Serve route_prefix's
    (middleware.RootPathMiddleware): FastAPI's app.root_path, which vLLM sets, would replace it."""
    from starlette.middleware.cors import CORSMiddleware  # here: the CLI imports this module without starlette

    from saguaro_dist.serve.middleware import RootPathMiddleware
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_methods=list(options.allowed_methods), allow_headers=list(options.allowed_headers),
                       allow_credentials=options.allow_credentials)
    if options.root_path:
        app.add_middleware(RootPathMiddleware, root_path=options.root_path)
