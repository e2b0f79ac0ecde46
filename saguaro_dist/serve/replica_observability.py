"""What a Serve replica sets up so operators see it: saguaro's log lines in the replica's log, and vLLM's
GET /metrics on the API port (this node's Ray metrics export, where the replica's metrics go)."""
from __future__ import annotations

import asyncio
import logging
import urllib.request

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

log = logging.getLogger(__name__)

PACKAGE_LOGGER = "saguaro_dist"
SERVE_LOGGER = "ray.serve"  # Serve's replica logger: its level is the CLI's --uvicorn-log-level (Serve's default INFO)
SCRAPE_TIMEOUT_S = 10.0


def adopt_serve_logging() -> None:
    """saguaro_dist's loggers write where Serve's replica logger does (the replica's log file under
    logs/serve/, and stderr), at its level. A Ray worker's root logger has no handler and WARNING, so the
    periodic stats line and --enable-log-requests' lines (INFO) were dropped."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    ours = logging.getLogger(PACKAGE_LOGGER)
    ours.setLevel(serve_logger.level or logging.INFO)
    if serve_logger.handlers:  # (none outside a Serve replica: propagate as before)
        ours.handlers = list(serve_logger.handlers)
        ours.propagate = False


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
