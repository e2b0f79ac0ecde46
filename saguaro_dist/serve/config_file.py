"""`saguaro serve --config FILE`: a `serve run` / KubeRay-style Serve config, or a bare mapping of app args.

Every setting the file holds is applied, or the file is refused with the setting named: a setting dropped
in silence changes what is served (an API key in runtime_env env_vars left the server without auth)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from saguaro_dist.serve.app import APP_IMPORT_PATH, DEPLOYMENT_NAME
from saguaro_dist.serve.args import API_KEY_ENV
from saguaro_dist.serve.lora_modules import _ENV_TRUE, RUNTIME_UPDATE_ARG, RUNTIME_UPDATE_ENVS

log = logging.getLogger(__name__)

# Deployment settings `saguaro serve` passes to serve.deployment as they are (the others are refused).
DEPLOYMENT_OPTIONS = ("num_replicas", "max_ongoing_requests", "max_queued_requests", "ray_actor_options",
                      "autoscaling_config", "health_check_period_s", "health_check_timeout_s",
                      "graceful_shutdown_timeout_s", "graceful_shutdown_wait_loop_s", "placement_group_bundles",
                      "placement_group_strategy", "max_replicas_per_node", "logging_config")
# What `saguaro serve` applies anyway: a file may state it.
APPLIED_AS_IS = {"proxy_location": "EveryNode"}
FLAG_FOR = {"ssl_keyfile": "--ssl-keyfile", "ssl_certfile": "--ssl-certfile",
            "logging_config": "--uvicorn-log-level / --disable-uvicorn-access-log"}


@dataclass
class ServeFile:
    args: dict
    host: str | None = None
    port: int | None = None
    deployment_options: dict = field(default_factory=dict)
    route_prefix: str = "/"  # where the app's routes live, as serve.run(route_prefix=...) mounts them


def load_serve_config(path: str) -> ServeFile:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"cannot read config {path}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must be a mapping")
    if "applications" not in data:
        return ServeFile(args=dict(data))  # just the app's args
    return _from_serve_schema(data, path)


def _from_serve_schema(data: dict, path: str) -> ServeFile:
    from ray.serve.schema import ServeDeploySchema

    try:
        schema = ServeDeploySchema(**data)
    except Exception as err:  # pydantic's ValidationError: say what is wrong, no trace
        raise ValueError(f"config {path} is not a valid Serve config: {err}") from None
    given = schema.model_dump(exclude_unset=True)
    if len(given["applications"]) != 1:
        raise ValueError(f"config {path} must hold exactly one application (saguaro serve runs one), "
                         f"it holds {len(given['applications'])}")
    http = given.get("http_options") or {}
    _refuse_unapplied(path, "", {k: v for k, v in given.items()
                                 if k not in ("applications", "http_options") and not _applied_anyway(k, v)})
    _refuse_unapplied(path, "http_options.", {k: v for k, v in http.items() if k not in ("host", "port")})
    app = given["applications"][0]
    args, options = _application(app, path)
    return ServeFile(args=args, host=http.get("host"), port=http.get("port"), deployment_options=options,
                     route_prefix=check_route_prefix(app.get("route_prefix", "/"), path))


def _applied_anyway(name: str, value) -> bool:
    """What `serve build` always writes that saguaro serve does anyway: gRPC options with no servicer functions
    (Serve starts no gRPC server for them) and Ray's default logging config."""
    if name == "grpc_options":
        return not value.get("grpc_servicer_functions")
    if name == "logging_config" and value is None:  # null: unset, as it read before this check
        return True
    if name == "logging_config":
        from ray.serve.schema import LoggingConfig
        return LoggingConfig(**value) == LoggingConfig()
    return False


def check_route_prefix(prefix, path: str) -> str:
    """Ray Serve's rules for a route_prefix, checked before Ray starts (Serve checks them only at serve.run)."""
    if prefix is None:  # Serve's "no HTTP route": nothing `saguaro serve` could answer on
        raise ValueError(f"config {path}: application.route_prefix null serves no HTTP route; saguaro serve "
                         "serves over HTTP (give a prefix such as / or /myprefix)")
    problem = ("must start with '/'" if not str(prefix).startswith("/") else
               "may not end with '/' (unless it is just '/')" if prefix != "/" and prefix.endswith("/") else
               "may not contain wildcards ('{' or '}')" if "{" in prefix or "}" in prefix else None)
    if problem:
        raise ValueError(f"config {path}: application.route_prefix {prefix!r} {problem}, as Ray Serve requires")
    return prefix


def _application(app: dict, path: str) -> tuple[dict, dict]:
    """The app's args and our deployment's options, with the app's runtime_env env_vars applied."""
    if app.get("import_path") != APP_IMPORT_PATH:
        raise ValueError(f"config {path}: application import_path {app.get('import_path')!r} is not saguaro's "
                         f"({APP_IMPORT_PATH}); saguaro serve runs only its own application")
    if app.get("name") not in (None, "saguaro"):
        log.info("config %s: application %r is served under the name 'saguaro'", path, app["name"])
    runtime_env = app.get("runtime_env") or {}
    _refuse_unapplied(path, "runtime_env.", {k: v for k, v in runtime_env.items() if k != "env_vars"})
    _refuse_unapplied(path, "application.", {k: v for k, v in app.items() if k not in (
        "name", "import_path", "args", "deployments", "runtime_env", "route_prefix")})
    env_vars = {str(k): str(v) for k, v in (runtime_env.get("env_vars") or {}).items()}
    args = _with_env_settings(dict(app.get("args") or {}), env_vars)
    return args, _with_env_vars(_deployment_options(app.get("deployments") or [], path), env_vars)


def _refuse_unapplied(path: str, where: str, settings: dict) -> None:
    """Settings `saguaro serve` does not apply: named in an error rather than dropped."""
    unapplied = {k: v for k, v in settings.items() if v not in (None, {}, []) and APPLIED_AS_IS.get(k) != v}
    if unapplied:
        hints = "".join(f"; use {FLAG_FOR[k]} for {k}" for k in unapplied if k in FLAG_FOR)
        raise ValueError(f"config {path}: saguaro serve does not apply {', '.join(where + k for k in unapplied)}"
                         f" (remove it, or deploy the file with `serve run` / `serve deploy`){hints}")


def _deployment_options(deployments: list[dict], path: str) -> dict:
    options = {}
    for deployment in deployments:
        if deployment.get("name") != DEPLOYMENT_NAME:
            raise ValueError(f"config {path}: deployment {deployment.get('name')!r} is not in saguaro's "
                             f"application (its one deployment is {DEPLOYMENT_NAME!r})")
        _refuse_unapplied(path, f"deployments[{DEPLOYMENT_NAME}].", {
            k: v for k, v in deployment.items() if k != "name" and k not in DEPLOYMENT_OPTIONS})
        options.update({k: v for k, v in deployment.items() if k in DEPLOYMENT_OPTIONS})
    return options


def _with_env_vars(options: dict, env_vars: dict) -> dict:
    """The app's env_vars reach the replica as Serve gives them: under the deployment's own, which win."""
    if not env_vars:
        return options
    actor = dict(options.get("ray_actor_options") or {})
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = {**env_vars, **(runtime_env.get("env_vars") or {})}
    return {**options, "ray_actor_options": {**actor, "runtime_env": runtime_env}}


def _with_env_settings(args: dict, env_vars: dict) -> dict:
    """The settings `saguaro serve` resolves from the environment before Ray starts (the API key, runtime LoRA
    updating), read from the file's env_vars first: the replica would see those, not this shell's."""
    key_env = str(args.get("api_key_env") or API_KEY_ENV)
    if not args.get("api_key") and env_vars.get(key_env):
        args["api_key"] = env_vars[key_env]
    if args.get(RUNTIME_UPDATE_ARG) in (None, "") and any(name in env_vars for name in RUNTIME_UPDATE_ENVS):
        seen = {name: env_vars.get(name, os.environ.get(name, "0")) for name in RUNTIME_UPDATE_ENVS}
        args[RUNTIME_UPDATE_ARG] = any(v.strip().lower() in _ENV_TRUE for v in seen.values())
    return args
