"""A replica whose engine died is replaced by Ray Serve: its target actor's process is killed, /health and
Serve's replica health check report it, and Serve brings up a fresh replica (engine and actors) that
answers exactly as before. Real Serve, real Ray actors, a real SIGKILL."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from saguaro_dist import SamplingParams

pytest_plugins = ["test_serve_fixtures"]

APP, PREFIX = "recovery", "/recovery"


def target_pids() -> set[int]:
    """Live target actors' processes, from the GCS (ray.util.state would need the dashboard, off in tests)."""
    from ray._private.state import actors
    return {a["Pid"] for a in actors().values() if a["ActorClassName"] == "TargetRank" and a["State"] == "ALIVE"}


def completion(server, body: dict, timeout_s: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}{PREFIX}/v1/completions", json=body, headers=server.headers, timeout=timeout_s)


def test_health_is_503_once_the_engine_cannot_serve():
    """vLLM's /health: 200 while the engine serves (no API key needed), 503 once it cannot."""
    from http_helpers import serve_on_loopback
    from saguaro_dist import LLM
    from saguaro_dist.demo import demo_pair
    from saguaro_dist.serve.api import ServerOptions, create_app
    llm = LLM(model=demo_pair()[0], mode="ar")
    with serve_on_loopback(create_app(llm, ServerOptions("demo", api_key="k"))) as url:
        health = url.removesuffix("/v1") + "/health"
        assert httpx.get(health, timeout=10).json() == {"status": "ok"}
        llm.check_health()
        llm.shutdown()
        r = httpx.get(health, timeout=10)
    assert r.status_code == 503 and "shut down" in r.json()["error"]["message"]


@pytest.mark.parametrize("scope, path", [
    ({"path": "/health"}, "/health"), ({"path": "/recovery/health", "root_path": "/recovery"}, "/health"),
    ({"path": "/recovery", "root_path": "/recovery"}, "/"), ({"path": "/v1/models", "root_path": ""}, "/v1/models"),
])
def test_routes_are_matched_inside_the_apps_mount_prefix(scope, path):
    from saguaro_dist.serve.middleware import app_path
    assert app_path(scope) == path


@pytest.mark.slow
def test_serve_replaces_a_replica_whose_target_died(server, reference_llm, serving_pair):
    from ray import serve

    from saguaro_dist.serve.app import build_deployment
    target, draft = serving_pair
    args = {"model": target, "draft": draft, "mode": "ssd", "k": 2, "max_model_len": 256, "cluster": "auto",
            "num_draft_workers": 1, "api_key": server.api_key, "served_model_name": server.model}
    before = target_pids()
    # (graceful_shutdown_wait_loop_s: serve.delete's drain check every 0.2 s, not Serve's 2 s, with nothing to drain)
    serve.run(build_deployment(args, health_check_period_s=1, health_check_timeout_s=30, graceful_shutdown_timeout_s=2,
                               graceful_shutdown_wait_loop_s=0.2), name=APP, route_prefix=PREFIX)
    try:
        body = {"prompt": "the cat sat", "max_tokens": 8, "temperature": 0}
        want = reference_llm.generate(["the cat sat"], SamplingParams(temperature=0, max_tokens=8))[0].text
        assert completion(server, body).json()["choices"][0]["text"] == want
        (pid,) = target_pids() - before
        os.kill(pid, signal.SIGKILL)
        deadline, answered = time.monotonic() + 300, None
        while time.monotonic() < deadline:  # 503s (retriable) while Serve replaces the replica
            # Once the old replica is gone, Serve's proxy holds the request until the new one is up: a whole
            # engine start (actors, checkpoints), 16 s on a quiet box, over 60 s with the suite's two workers.
            r = completion(server, body, timeout_s=max(1.0, deadline - time.monotonic()))
            if r.status_code == 200:
                answered = r.json()["choices"][0]["text"]
                break
            assert r.status_code in (500, 502, 503), r.text
            time.sleep(1)
        assert answered == want
        assert target_pids() - before - {pid}  # a fresh target actor serves now
        assert httpx.get(f"{server.url}{PREFIX}/health", timeout=10).status_code == 200
    finally:
        serve.delete(APP)
