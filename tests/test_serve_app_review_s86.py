"""Review of the Serve app's front door: --root-path under a Serve route_prefix, and the API key check's edges
(the Bearer scheme in any case, OPTIONS without an Origin, /health/ with its slash). Real HTTP to the shared
Serve app (test_serve_fixtures' `server`) and to one small app deployed beside it under a route prefix."""
from __future__ import annotations

import httpx
import pytest

from test_serve_fixtures import API_KEY

pytest_plugins = ["test_serve_fixtures"]
pytestmark = pytest.mark.slow  # the session's Serve app, and one more replica

PREFIX, PROXY_ROOT = "/s86", "/api"  # Serve's route_prefix; what a reverse proxy in front strips


@pytest.fixture(scope="module")
def prefixed(server, serving_pair):
    """A small app at route_prefix /s86 with root_path /api: a proxy serves it at /api/s86 and strips /api."""
    from ray import serve

    from saguaro_dist.serve.app import build_deployment
    args = {"model": serving_pair[1], "mode": "ar", "max_model_len": 128, "max_batch_size": 1,
            "api_key": server.api_key, "served_model_name": "small", "root_path": PROXY_ROOT}
    serve.run(build_deployment(args, ray_actor_options={"num_cpus": 0.5}), name="s86_prefixed", route_prefix=PREFIX)
    try:
        yield f"{server.url}{PREFIX}"
    finally:
        serve.delete("s86_prefixed")


def test_root_path_composes_with_a_serve_route_prefix(server, prefixed):
    """The routes answer under the route prefix (the proxy stripped /api), /health stays open, and the docs point
    at /api/s86, where the proxy's clients reach them."""
    health = httpx.get(f"{prefixed}/health", timeout=30)
    models = httpx.get(f"{prefixed}/v1/models", headers=server.headers, timeout=30)
    schema = httpx.get(f"{prefixed}/openapi.json", headers=server.headers, timeout=30)
    docs = httpx.get(f"{prefixed}/docs", headers=server.headers, timeout=30)
    no_key = httpx.get(f"{prefixed}/v1/models", timeout=30)
    assert health.status_code == 200, health.text
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "small", models.text
    assert schema.status_code == 200 and schema.json()["servers"][0] == {"url": PROXY_ROOT + PREFIX}
    assert docs.status_code == 200 and f"'{PROXY_ROOT}{PREFIX}/openapi.json'" in docs.text
    assert no_key.status_code == 401


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_read_in_any_case(server, scheme):
    got = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"{scheme} {server.api_key}"}, timeout=30)
    assert got.status_code == 200, got.text


@pytest.mark.parametrize("authorization", ["bearer wrong", f"Basic {API_KEY}", "Bearer", API_KEY, f"Bearer {API_KEY}x"])
def test_a_wrong_key_or_scheme_is_still_refused(server, authorization):
    got = httpx.get(f"{server.url}/v1/models", headers={"Authorization": authorization}, timeout=30)
    assert got.status_code == 401, got.text


def test_options_without_an_origin_passes_the_key_check(server):
    """vLLM lets every OPTIONS through: without an Origin it is no CORS preflight, and the route answers it."""
    got = httpx.options(f"{server.url}/v1/models", timeout=30)
    assert got.status_code != 401 and got.status_code < 500, got.text


def test_health_with_a_trailing_slash_needs_no_key(server):
    """A probe configured as /health/ gets the app's redirect to /health, not a 401."""
    redirect = httpx.get(f"{server.url}/health/", timeout=30)
    followed = httpx.get(f"{server.url}/health/", timeout=30, follow_redirects=True)
    assert redirect.status_code == 307 and redirect.headers["location"].endswith("/health")
    assert followed.status_code == 200, followed.text
