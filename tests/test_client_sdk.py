"""The Python SDK against the real Serve app, and its retries against a real flaky HTTP server."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import SamplingParams
from saguaro_dist.client import (APIConnectionError, APITimeoutError, AsyncClient, AuthenticationError, BadRequestError,
                                 Client, InternalServerError, NotFoundError)
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.prompts import encode_chat
from saguaro_dist.serve.protocol import ChatMessage
from test_serve_fixtures import free_port

pytest_plugins = ["test_serve_fixtures"]


def expected(reference_llm, prompt: str, max_tokens: int) -> str:
    return reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].text


@pytest.fixture(scope="module")
def client(server):
    with Client(server.url, api_key=server.api_key) as c:
        yield c


def test_complete_and_chat(client, server, reference_llm):
    out = client.complete("the cat sat", max_tokens=12, temperature=0)
    assert out.text == expected(reference_llm, "the cat sat", 12)
    assert out.usage["completion_tokens"] >= 1 and out.speculation["mode"] == "ssd"
    chat = client.chat("hello", max_tokens=6, temperature=0)
    assert chat.text and chat.finish_reason in ("stop", "length") and chat.model == server.model
    assert client.models() == [server.model] and client.health()
    from saguaro_dist import __version__
    assert client.version() == __version__ and client.reset_prefix_cache() is None
    assert client.complete("the cat sat", max_tokens=12, temperature=0, min_p=0.5).text == out.text  # extra fields
    assert out.logprobs is None  # only when asked for; extra keywords go into the body
    scored = client.chat("hello", max_tokens=4, temperature=0, logprobs=True, top_logprobs=1)
    assert len(scored.logprobs["content"]) == scored.usage["completion_tokens"]


def test_stream_yields_text_deltas_then_stats(client, reference_llm):
    stream = client.complete("hello world", max_tokens=16, temperature=0, stream=True,
                             stream_options={"include_usage": True})  # usage only when asked (OpenAI's, vLLM's)
    deltas = list(stream)
    assert "".join(deltas) == expected(reference_llm, "hello world", 16)
    assert stream.finish_reason in ("stop", "length") and stream.speculation["rounds"] >= 1
    assert stream.usage["completion_tokens"] >= len(deltas) > 0


def test_async_client(server, reference_llm):
    async def go():
        async with AsyncClient(server.url + "/v1", api_key=server.api_key) as c:
            plain = await c.complete("the mat", max_tokens=10, temperature=0)
            stream = await c.chat([{"role": "user", "content": "the cat sat"}], max_tokens=8, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
            deltas = [d async for d in stream]
            assert await c.version() and await c.reset_prefix_cache() is None
            return plain, deltas, stream
    plain, deltas, stream = asyncio.run(go())
    assert plain.text == expected(reference_llm, "the mat", 10)
    assert stream.finish_reason in ("stop", "length") and stream.usage["completion_tokens"] == 8
    ids = encode_chat(reference_llm.tokenizer, [ChatMessage(role="user", content="the cat sat")])
    chat = reference_llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=8))
    assert "".join(deltas) == chat[0].text


def test_typed_errors_carry_the_server_message(client, server):
    with pytest.raises(NotFoundError) as err:
        client.complete("hi", model="nope", max_tokens=2)
    assert err.value.status_code == 404 and "nope" in err.value.message and err.value.param == "model"
    with pytest.raises(BadRequestError) as err:
        client.complete("hi", temperature=-1)
    assert err.value.status_code == 400 and err.value.param == "temperature"
    with pytest.raises(AuthenticationError):
        Client(server.url, api_key="wrong", max_retries=0).models()


class _Flaky(BaseHTTPRequestHandler):
    """A real OpenAI-style server that fails the first `failures` requests with 503."""
    failures = 2
    seen = 0

    def do_POST(self):
        type(self).seen += 1
        self.rfile.read(int(self.headers["content-length"]))
        if type(self).seen <= type(self).failures:
            return self._reply(503, {"error": {"message": "warming up", "type": "server_error", "code": 503}},
                               {"Retry-After": "0"})
        self._reply(200, {"id": "x", "model": "m", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def _reply(self, status, body, headers=None):
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"content-type": "application/json", "content-length": str(len(data)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky_url():
    _Flaky.seen = 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_retries_5xx_with_backoff_then_succeeds(flaky_url):
    out = Client(flaky_url, model="m", max_retries=2, backoff_s=0.01).complete("x")
    assert out.text == "ok" and _Flaky.seen == 3  # any OpenAI-compatible server, no speculation field
    assert out.speculation is None


def test_gives_up_with_the_last_error(flaky_url):
    _Flaky.failures = 5
    try:
        with pytest.raises(InternalServerError) as err:
            Client(flaky_url, max_retries=1, backoff_s=0.01).complete("x")
        assert err.value.status_code == 503 and err.value.message == "warming up" and _Flaky.seen == 2
    finally:
        _Flaky.failures = 2


def test_connection_errors_are_retried_then_raised():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    with pytest.raises(APIConnectionError):
        Client(url, max_retries=2, backoff_s=0.01).complete("x")


@pytest.fixture(scope="module")
def local_url(reference_llm):
    """The serving app on the reference engine under uvicorn: no Ray needed."""
    with serve_on_loopback(create_app(reference_llm, ServerOptions("tiny"))) as url:
        yield url


def test_a_stream_of_several_choices_keeps_them_apart(local_url, reference_llm):
    """Chunks of n > 1 (or several prompts) interleave choices: the deltas were every choice's, run together."""
    prompts = ["the cat sat", "hello world"]
    want = [expected(reference_llm, p, 8) for p in prompts]
    stream = Client(local_url).complete(prompts, max_tokens=8, temperature=0, stream=True)
    assert "".join(stream) == want[0] and stream.texts == {0: want[0], 1: want[1]}

    async def go():
        async with AsyncClient(local_url) as c:
            stream = await c.complete(prompts, max_tokens=8, temperature=0, stream=True)
            return "".join([d async for d in stream]), stream.texts
    assert asyncio.run(go()) == (want[0], {0: want[0], 1: want[1]})


class _Stalling(BaseHTTPRequestHandler):
    """Starts an SSE stream, sends one chunk, then goes quiet until `released` (the test's end)."""
    released = threading.Event()

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        chunk = {"id": "x", "model": "m", "choices": [{"index": 0, "text": "ok", "finish_reason": None}]}
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()
        self.released.wait(60)

    def log_message(self, *args):
        pass


def test_a_stream_that_goes_quiet_is_a_timeout():
    handler = type("Stalling", (_Stalling,), {"released": threading.Event()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    timeout_s = 2.0  # the in-process server's first chunk must beat it, on a loaded box too; the silence never ends
    try:
        deltas = []
        with pytest.raises(APITimeoutError):  # was APIConnectionError, which `except APITimeoutError` missed
            for delta in Client(url, timeout=timeout_s, max_retries=0).complete("x", stream=True):
                deltas.append(delta)
        assert deltas == ["ok"]  # what came before the silence was delivered

        async def go():
            async with AsyncClient(url, timeout=timeout_s, max_retries=0) as c:
                got = []
                with pytest.raises(APITimeoutError):
                    async for delta in await c.complete("x", stream=True):
                        got.append(delta)
                return got
        assert asyncio.run(go()) == ["ok"]
    finally:
        handler.released.set()
        httpd.shutdown()
        httpd.server_close()


def test_a_stream_has_its_usage_without_asking(client):
    """Servers send a stream's usage only when asked (the server now does too): the client asks unless the caller
    set stream_options, so `usage` stays filled."""
    stream = client.complete("hello world", max_tokens=4, temperature=0, stream=True, ignore_eos=True)
    list(stream)
    assert stream.usage["completion_tokens"] == 4


def test_the_sdk_and_sampling_params_import_without_torch_or_transformers():
    """The client SDK (and SamplingParams, which it takes) load in ~1 s: they used to pull in torch through the
    speculative maths package (bad words' tokenization and the left-to-generate check lived there)."""
    code = ("import sys, saguaro_dist.client\nfrom saguaro_dist import SamplingParams\n"
            "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
