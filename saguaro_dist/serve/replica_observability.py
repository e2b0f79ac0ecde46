"""What a Serve replica sets up so operators see it: saguaro's log lines in the replica's log, and vLLM's
GET /metrics on the API port (this node's Ray metrics export, where the replica's metrics go)."""
from __future__ import annotations

import asyncio
import logging
import urllib.request

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from saguaro_dist.log_level import LOG_LEVEL_ENV, PACKAGE_LOGGER, env_log_level

log = logging.getLogger(__name__)

SERVE_LOGGER = "ray.serve"  # Serve's replica logger: its level is the CLI's --uvicorn-log-level (Serve's default INFO)
SCRAPE_TIMEOUT_S = 10.0


def adopt_serve_logging() -> None:
    """saguaro_dist's loggers write where Serve's replica logger does (the replica's log file under
    logs/serve/, and stderr), at its level. A Ray worker's root logger has no handler and WARNING, so the
    periodic stats line and --enable-log-requests' lines (INFO) were dropped."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    ours = logging.getLogger(PACKAGE_LOGGER)
    ours.setLevel(replica_log_level(serve_logger.level))
    if serve_logger.handlers:  # (none outside a Serve replica: propagate as before)
        ours.handlers = list(serve_logger.handlers)
        ours.propagate = False


def replica_log_level(serve_level: int) -> int:
    """$SAGUARO_LOGGING_LEVEL where set (`saguaro --log-level X serve` sets it), else Serve's replica logger's
    level (the deployment's logging_config; Serve's default INFO)."""
    return env_log_level() or serve_level or logging.INFO


def with_log_level(options: dict, log_level: str | None, uvicorn_level_given: bool) -> dict:
    """The deployment's options carrying `saguaro --log-level` to the replica: as Serve's logging_config level
    (Serve's own lines, the access log too, unless --uvicorn-log-level sets theirs) and as $SAGUARO_LOGGING_LEVEL,
    which saguaro's loggers follow there whatever Serve's level, and which the engine's actors inherit (a child
    actor gets its parent's runtime_env)."""
    if not log_level:
        return options
    logging_config = dict(options.get("logging_config") or {})
    if not uvicorn_level_given:
        logging_config["log_level"] = log_level
    actor = dict(options.get("ray_actor_options") or {})
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), LOG_LEVEL_ENV: log_level}
    return {**options, "logging_config": logging_config, "ray_actor_options": {**actor, "runtime_env": runtime_env}}


def job_logging(log_level: str | None):
    """`saguaro --log-level` for the Ray workers of `saguaro serve`'s job (the embedded cluster's replicas, the
    engine's actors): set on the job, not as ray.init's logging_config, which also added a second root handler
    to the CLI's own."""
    import ray

    if not log_level:
        return None
    job_config = ray.job_config.JobConfig()
    job_config.set_py_logging_config(ray.LoggingConfig(log_level=log_level))
    return job_config


def node_metrics_url() -> str:
    """The Prometheus endpoint of the Ray node this process runs on (its metrics agent's export port)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def add_metrics_route(app: FastAPI, url: str) -> None:
    """GET /metrics as vLLM serves it on the API port: the Prometheus text of this node's Ray metrics export
    (ray_saguaro_* and Ray's own; with several replicas, the node of the one that answers)."""

    async def metrics() -> Response:
        try:
            body, content_type = await asyncio.to_thread(_fetch, url)
        except OSError as err:
            log.warning("GET /metrics: the node's Ray metrics export at %s did not answer: %s", url, err)
            return PlainTextResponse(f"Ray's metrics export at {url} did not answer\n", status_code=503)
        return Response(body, media_type=content_type)

    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)


def _fetch(url: str) -> tuple[bytes, str]:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
        return reply.read(), reply.headers.get("Content-Type", "text/plain; version=0.0.4; charset=utf-8")


def local_metrics_export_port(ray) -> int | None:
    """The Ray metrics export port of this process's node (the CLI logs it); None where Ray does not say."""
    try:  # Ray's own node object, as cli/serve.py's log folder: no public API names the driver's node's port
        return ray._private.worker._global_node.metrics_export_port
    except AttributeError:
        return None
