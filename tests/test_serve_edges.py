"""The HTTP edge against input JSON allows but no model can take: each is a 400 naming its field, over real
HTTP to the serving app on an SSD engine, and the server serves on unchanged afterwards."""
from __future__ import annotations

import json

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist.serve.api import ServerOptions, create_app

pytest_plugins = ["test_serve_fixtures"]
GREEDY = {"prompt": "the cat sat on", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def base(reference_llm):
    with serve_on_loopback(create_app(reference_llm, ServerOptions("tiny"))) as url:
        yield url.removesuffix("/v1")


def _post(base: str, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as "\ud800", valid JSON; httpx's own encoder refuses to send one.
    return httpx.post(base + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)


def _greedy_text(base: str) -> str:
    return _post(base, "/v1/completions", GREEDY).json()["choices"][0]["text"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "the \ud800 cat", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["the cat", "a \udfff"], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "the cat \ud800", "max_tokens": 2, "stream": True}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2}, "messages"),
    ("/tokenize", {"prompt": "hi \ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udc00 hi"}]}, "messages"),
    ("/v1/responses", {"input": "hi \ud800", "max_output_tokens": 2}, None),  # "input": no chat field to name
])
def test_lone_surrogates_are_a_400_not_a_500(base, path, body, param):
    """JSON may escape half a surrogate pair; the tokenizer refused such text with a TypeError (a 500)."""
    before = _greedy_text(base)
    r = _post(base, path, body)
    error = r.json()["error"]
    assert r.status_code == 400 and "lone surrogate" in error["message"] and error["param"] == param
    assert _greedy_text(base) == before
    paired = _post(base, "/v1/completions", {"prompt": "the cat \ud83c\udf35", "max_tokens": 2})  # a whole pair: fine
    assert paired.status_code == 200


@pytest.mark.parametrize("seed, n", [(2**63, 1), (-2**63 - 1, 1), (2**70, 1), (2**70, 2)])
def test_seeds_past_int64_are_a_400(base, seed, n):
    """The engine sends seeds to its draft workers as protobuf int64s; on the distributed engine one past it
    failed the engine step and every request in flight. Sample i draws from seed + i wrapped into int64, so
    a valid seed stays valid whatever n (test_serve_request_edges)."""
    r = _post(base, "/v1/completions", {"prompt": "the cat", "max_tokens": 2, "seed": seed, "n": n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    edge = {"prompt": "the cat", "max_tokens": 2, "temperature": 1, "n": 2}
    assert _post(base, "/v1/completions", {**edge, "seed": 2**63 - 1}).status_code == 200
    assert _post(base, "/v1/completions", {**edge, "seed": -2**63}).status_code == 200
