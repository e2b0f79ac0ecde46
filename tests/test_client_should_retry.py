"""The SDK honours an error reply's `x-should-retry` header as the openai SDK does, against a real loopback server:
"true" retries what the status alone would not (a generation's 500, a LoRA load's 500, a 400), "false" forbids a
retry the status alone would make (a 503, a 429), and any other value leaves the status to decide."""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import ClassVar

import pytest

from saguaro_dist.client import APIStatusError, AsyncClient, Client
from scripted_openai import ScriptedServer, Servers


class _Says(ScriptedServer):
    """/<status>/<header value>/v1/...: that status with `x-should-retry: <value>` ("-": no header); counts hits."""
    hits: ClassVar[Counter] = Counter()

    def do_GET(self):
        self.do_POST()

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        type(self).hits[self.path] += 1
        _, status, says = self.path.split("/")[:3]
        data = json.dumps({"error": {"message": f"status {status}"}}).encode()
        self.send_response(int(status))
        if says != "-":
            self.send_header("x-should-retry", says)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def server():
    servers = Servers()
    handler = type("Says", (_Says,), {"hits": Counter()})
    yield servers.start(handler), handler
    servers.close()


def _sync(url, name, *args):
    with Client(url, max_retries=2, backoff_s=0.01) as client:
        return getattr(client, name)(*args)


async def _async(url, name, *args):
    async with AsyncClient(url, max_retries=2, backoff_s=0.01) as client:
        return await getattr(client, name)(*args)


@pytest.fixture(params=["sync", "async"])
def call(request):
    if request.param == "sync":
        return _sync
    return lambda *args: asyncio.run(_async(*args))


@pytest.mark.parametrize("status, says, method, args, sent", [
    (500, "true", "complete", ("x",), 3),                 # a generation's 500: not retried on its own
    (500, "true", "load_lora_adapter", ("a", "/p"), 3),   # a stateful call's 500: the server says it is safe
    (400, "true", "complete", ("x",), 3),
    (503, "false", "complete", ("x",), 1),                # retried on its own: the server forbids it
    (429, "false", "models", (), 1),
    (500, "false", "models", (), 1),
    (503, "True", "complete", ("x",), 3),                 # not openai's exact "true"/"false": the status decides
    (500, "yes", "complete", ("x",), 1),
    (503, "-", "complete", ("x",), 3),
])
def test_x_should_retry_overrides_the_status_rules(server, call, status, says, method, args, sent):
    url, handler = server
    handler.hits.clear()
    with pytest.raises(APIStatusError) as err:
        call(f"{url}/{status}/{says}", method, *args)
    assert err.value.status_code == status
    assert sum(handler.hits.values()) == sent
