"""The engine gauges of a server that has answered nothing yet, under plain uvicorn: they came only with its first
request (the reporter started there), so a fresh server read as no data to dashboards and autoscalers, while a Ray
Serve replica exports them from start-up (test_serve_metrics_aborts.test_an_idle_replica_exports_its_engine_gauges).
Real HTTP (the app under loopback uvicorn), a real engine over the tiny serving checkpoint, scraped from the session
Ray node's real Prometheus endpoint."""
from __future__ import annotations

from http_helpers import serve_on_loopback
from test_serve_metrics_aborts import GAUGES
from test_serving_metrics_review import samples, wait_for

from saguaro_dist import LLM
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.metrics import ServeMetrics

pytest_plugins = ["test_serve_fixtures"]



def gauges(url: str, model: str) -> dict[str, list[float]]:
    return {g: [s.value for s in samples(url, f"saguaro_{g}", model)] for g in GAUGES}


def test_a_fresh_uvicorn_server_exports_its_engine_gauges(metrics_url, serving_pair):
    """Scraped before any request: every gauge, at the idle engine's values (ar: no draft workers)."""
    model = "startup-gauges-uvicorn"
    with LLM(model=serving_pair[0], mode="ar", max_model_len=256) as llm:
        app = create_app(llm, ServerOptions(model), ServeMetrics(model))
        with serve_on_loopback(app):
            found = wait_for(metrics_url, "saguaro_draft_workers", model, bool, timeout_s=15)
            exported = gauges(metrics_url, model)
            assert app.state.saguaro.running == 0  # nothing was asked of it
        reporter_ended = app.state.saguaro._engine_reporter is None
    assert found and exported == {g: [0.0] for g in GAUGES}
    assert reporter_ended  # the server's shutdown ends it too (it was left pending on a closed loop)

