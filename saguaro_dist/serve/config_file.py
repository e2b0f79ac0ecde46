"""`saguaro serve --config FILE`: a `serve run` / KubeRay-style Serve config, or a bare mapping of app args."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from saguaro_dist.serve.app import APP_IMPORT_PATH, DEPLOYMENT_NAME

# Deployment settings of a Serve config that `saguaro serve` applies (the rest is Serve-internal).
DEPLOYMENT_OPTIONS = ("num_replicas", "max_ongoing_requests", "ray_actor_options", "autoscaling_config",
                      "health_check_period_s", "health_check_timeout_s", "graceful_shutdown_timeout_s")


@dataclass
class ServeFile:
    args: dict
    host: str | None = None
    port: int | None = None
    deployment_options: dict = field(default_factory=dict)


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
    apps = [a for a in schema.applications if a.import_path == APP_IMPORT_PATH] or schema.applications
    if len(apps) != 1:
        raise ValueError(f"config {path} must hold exactly one application with import_path {APP_IMPORT_PATH}")
    http = schema.http_options.model_dump(exclude_unset=True) if schema.http_options else {}
    return ServeFile(args=dict(apps[0].args or {}), host=http.get("host"), port=http.get("port"),
                     deployment_options=_deployment_options(apps[0]))


def _deployment_options(app) -> dict:
    for deployment in app.deployments or []:
        if deployment.name == DEPLOYMENT_NAME:
            given = deployment.model_dump(exclude_unset=True)
            return {k: v for k, v in given.items() if k in DEPLOYMENT_OPTIONS}
    return {}
