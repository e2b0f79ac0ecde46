"""`saguaro serve`'s HTTP-frontend flags, with `vllm serve`'s names and meaning: CORS, --root-path, the OpenAPI
docs, TLS and the HTTP server's logging.

Where each one lands: CORS, --root-path and --disable-fastapi-docs are app args (serve/frontend.py), so they hold
in the FastAPI app whichever server answers (--ingress direct or proxy). TLS and logging belong to the HTTP
servers Ray Serve starts (its HTTPOptions and LoggingConfig), which it applies to both ingress paths alike.
Flags default to None so a --config file's values are only overridden on purpose; the defaults in the help
are vLLM's, and are what None means.
"""
from __future__ import annotations

import argparse
import ssl
from pathlib import Path

from saguaro_dist.serve.frontend import json_list


# flag dest -> app arg (serve/frontend.py's FRONTEND_ARGS; response_role: serve/app.py's server_options)
FRONTEND_FLAGS = {"allowed_origins": "allowed_origins", "allowed_methods": "allowed_methods",
                  "allowed_headers": "allowed_headers", "allow_credentials": "allow_credentials",
                  "root_path": "root_path", "disable_fastapi_docs": "disable_fastapi_docs",
                  "response_role": "response_role"}
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # vLLM's choices
TLS_FLAGS = "--ssl-keyfile / --ssl-certfile"


def json_list_arg(flag: str):
    """argparse type: a JSON list of strings, as vLLM's CORS flags take ('["https://a.example"]')."""
    def parse(text: str) -> list[str]:
        try:
            return list(json_list(flag, text))
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return parse


def role_name(text: str) -> str:
    """argparse type of --response-role: a blank role is a usage error here, before Ray starts."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a non-empty role name (e.g. assistant), got {text!r}")
    return text


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP frontend (vLLM's flags)")
    _add_cors_args(g)
    g.add_argument("--root-path", help="the path prefix a reverse proxy serves the API under, e.g. /api (the proxy "
                                       "may strip it or not); it composes with a --config file's Serve route_prefix "
                                       "(/api + /llm: /api/llm/v1/...)")
    g.add_argument("--disable-fastapi-docs", action="store_true", default=None,
                   help="no OpenAPI schema, Swagger UI or ReDoc (/openapi.json, /docs, /redoc; default: served)")
    g.add_argument("--response-role", type=role_name, metavar="ROLE",
                   help="the role chat replies carry when the request opens a new turn (add_generation_prompt true; "
                        "otherwise the last message's role) (default assistant)")
    g.add_argument("--ssl-keyfile", help="the TLS private key (PEM): serve HTTPS, with --ssl-certfile")
    g.add_argument("--ssl-certfile", help="the TLS certificate chain (PEM), with --ssl-keyfile")
    g.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS,
                   help="log level of the HTTP servers (Ray Serve's logging_config; trace is debug) (default info)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", default=None,
                   help="no per-request access log lines (Ray Serve's enable_access_log false)")


def _add_cors_args(g) -> None:
    """Starlette's CORSMiddleware settings; it is always on, as in vLLM."""
    for name, what in (("origins", "origins"), ("methods", "methods"), ("headers", "request headers")):
        g.add_argument(f"--allowed-{name}", type=json_list_arg(f"--allowed-{name}"), metavar="JSON",
                       help=f'CORS: allowed {what}, a JSON list (default ["*"])')
    g.add_argument("--allow-credentials", action="store_true", default=None,
                   help="CORS: allow credentials (cookies, Authorization) in cross-origin requests (default off)")


def frontend_app_args(ns: argparse.Namespace) -> dict:
    """The app args the frontend flags given set (the rest keep a config file's values, else the defaults)."""
    return {arg: getattr(ns, dest) for dest, arg in FRONTEND_FLAGS.items() if getattr(ns, dest, None) is not None}


def tls_options(ns: argparse.Namespace) -> dict:
    """Ray Serve HTTPOptions' TLS fields from --ssl-keyfile / --ssl-certfile, checked here: a pair that
    cannot serve is a clear error before Ray starts, never a server that falls back to plain HTTP."""
    keyfile, certfile = getattr(ns, "ssl_keyfile", None), getattr(ns, "ssl_certfile", None)
    if not keyfile and not certfile:
        return {}
    if not (keyfile and certfile):
        raise ValueError(f"{TLS_FLAGS}: HTTPS needs both, got only --ssl-{'keyfile' if keyfile else 'certfile'}")
    _check_serve_supports_tls()
    _check_key_pair(keyfile, certfile)
    return {"ssl_keyfile": str(Path(keyfile).expanduser().resolve()),
            "ssl_certfile": str(Path(certfile).expanduser().resolve())}


def _check_serve_supports_tls() -> None:
    """Ray Serve's HTTP servers (proxy and direct ingress alike) take TLS from HTTPOptions, in recent Rays only."""
    import ray
    from ray.serve.config import HTTPOptions
    if not {"ssl_keyfile", "ssl_certfile"} <= set(HTTPOptions.model_fields):
        raise ValueError(f"{TLS_FLAGS}: the installed Ray Serve ({ray.__version__}) cannot serve HTTPS (its "
                         "HTTPOptions has no ssl_keyfile); upgrade Ray, or put a TLS-terminating proxy in front")


class _EncryptedKey(Exception):
    pass


def _encrypted_key():
    """load_cert_chain's password callback: called only for an encrypted key (without one, OpenSSL would ask
    for the pass phrase on the terminal, and a typed one would pass a key the proxies cannot open)."""
    raise _EncryptedKey


def _check_key_pair(keyfile: str, certfile: str) -> None:
    """Loads the pair as the server will: an unreadable file, or a key that is not the certificate's, is named."""
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if not Path(path).expanduser().is_file():
            raise ValueError(f"{flag} {path!r}: no such file")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(Path(certfile).expanduser(), Path(keyfile).expanduser(),
                                                                password=_encrypted_key)
    except _EncryptedKey:
        raise ValueError(f"--ssl-keyfile {keyfile!r} is encrypted: Serve's proxies are given no pass phrase, so give "
                         f"an unencrypted key") from None
    except (ssl.SSLError, OSError) as err:
        raise ValueError(f"{TLS_FLAGS}: cannot load the certificate and key ({err}); a PEM certificate and its own "
                         "unencrypted private key are needed") from None


def serve_logging_config(ns: argparse.Namespace) -> dict | None:
    """Ray Serve's LoggingConfig from --uvicorn-log-level / --disable-uvicorn-access-log; None when neither is
    given (Serve's defaults: INFO, access log on). Serve runs uvicorn with its own logging switched off and
    writes the access lines itself, so these are the settings that do what vLLM's do."""
    level, no_access = getattr(ns, "uvicorn_log_level", None), getattr(ns, "disable_uvicorn_access_log", None)
    if level is None and not no_access:
        return None
    config = {"log_level": "DEBUG" if level == "trace" else (level or "info").upper()}
    if no_access:
        config["enable_access_log"] = False
    return config


def check_tls_applied(client_http_config, tls: dict) -> None:
    """On a joined cluster whose Serve already runs, serve.start keeps that Serve's HTTP options: refuse
    rather than serve plain HTTP to clients that were promised HTTPS."""
    if tls and getattr(client_http_config, "ssl_certfile", None) != tls["ssl_certfile"]:
        raise ValueError(f"{TLS_FLAGS}: Serve already runs on this cluster with other HTTP options (no such TLS "
                         "certificate); its proxies cannot change: shut Serve down there first, or drop the flags")
