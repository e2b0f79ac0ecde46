"""Request ids (vLLM's X-Request-Id) and request logging (--enable-log-requests): a request can be followed
from the client through the replica's logs."""
from __future__ import annotations

import json
import logging

import httpx

from test_serve_fixtures import MODEL_NAME

pytest_plugins = ["test_serve_fixtures"]


def _post(server, path: str, body: dict, request_id: str | None = None) -> httpx.Response:
    headers = {**server.headers, **({"X-Request-Id": request_id} if request_id else {})}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_the_clients_request_id_names_the_response(server):
    r = _post(server, "/v1/completions", {"prompt": "the cat", "max_tokens": 4}, "job-7.a:b_c")
    assert r.headers["x-request-id"] == "job-7.a:b_c" and r.json()["id"] == "cmpl-job-7.a:b_c"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={**server.headers, "X-Request-Id": "s-1"}) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
        assert streamed.headers["x-request-id"] == "s-1"
    assert {c["id"] for c in chunks} == {"chatcmpl-s-1"}
    fresh = _post(server, "/v1/completions", {"prompt": "the cat", "max_tokens": 2, "model": MODEL_NAME})
    assert fresh.json()["id"] == "cmpl-" + fresh.headers["x-request-id"]  # one is made when none is given
    bad = _post(server, "/v1/completions", {"prompt": "the cat", "max_tokens": 2}, "no spaces allowed")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


def test_requests_are_logged_when_asked(caplog):
    from http_helpers import serve_on_loopback
    from saguaro_dist import LLM
    from saguaro_dist.demo import demo_pair
    from saguaro_dist.serve.api import ServerOptions, create_app
    caplog.set_level(logging.INFO, logger="saguaro_dist.serve.state")
    with LLM(model=demo_pair()[0], mode="ar") as llm:
        for log_requests in (True, False):
            with serve_on_loopback(create_app(llm, ServerOptions("demo", log_requests=log_requests))) as url:
                httpx.post(url + "/completions", json={"prompt": "x = ", "max_tokens": 3, "n": 2},
                           headers={"X-Request-Id": f"logged-{log_requests}"}, timeout=60)
    lines = [r.getMessage() for r in caplog.records if r.name == "saguaro_dist.serve.state"]
    assert not [line for line in lines if "logged-False" in line]
    for choice in ("0", "1"):
        mine = [line for line in lines if line.startswith(f"request logged-True-{choice}-")]
        assert len(mine) == 2 and "prompt tokens" in mine[0] and "temperature" in mine[0]
        assert "finished (length)" in mine[1] and "3 tokens" in mine[1]
