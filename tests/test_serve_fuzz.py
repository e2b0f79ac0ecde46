"""Property test of the HTTP edge: bodies drawn from the server's own OpenAPI schema (schemathesis), sent
over real HTTP to the serving app on an SSD engine. Whatever they hold, the answer is a success or a 4xx
in OpenAI's error shape, never a 5xx; and afterwards a greedy completion still gives its tokens."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.serve.api import ServerOptions, create_app

pytest_plugins = ["test_serve_fixtures"]
pytestmark = pytest.mark.slow
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]
GREEDY = {"model": "tiny", "prompt": "the cat sat on", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(serving_pair):
    target, draft = serving_pair
    with LLM(model=target, draft=draft, mode="ssd", k=2, max_batch_size=8, max_model_len=256) as llm:
        app = create_app(llm, ServerOptions("tiny"))
        with serve_on_loopback(app) as url:
            base = url.removesuffix("/v1")
            reference = httpx.post(f"{base}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
            yield schemathesis.openapi.from_dict(app.openapi()), base, reference


@pytest.mark.parametrize("route", ROUTES)
def test_any_schema_valid_body_gets_an_answer_or_a_4xx_never_a_5xx(served, route):
    schema, base, reference = served

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=schema[route]["POST"].as_strategy())
    def check(case):
        response = case.call(base_url=base, timeout=60)
        assert response.status_code < 500, (case.body, response.text[:500])
        if response.status_code >= 400:
            assert response.json()["error"]["message"], response.text[:500]
    check()
    after = httpx.post(f"{base}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    assert after == reference  # what the fuzzed requests did left the engine as it was
