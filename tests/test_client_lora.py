"""The SDK's runtime LoRA calls (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter) against the real app on
loopback, started with VLLM_ALLOW_RUNTIME_LORA_UPDATING as a replica builds it: a loaded adapter serves by name (its
greedy text is LLM.generate's with the adapter), the server's refusals are the SDK's typed errors, and without the
variable the routes are a NotFoundError."""
from __future__ import annotations

import asyncio

import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, LoRARequest, SamplingParams
from saguaro_dist.client import AsyncClient, BadRequestError, Client, NotFoundError
from saguaro_dist.serve.api import ServerOptions, create_app

pytest_plugins = ["test_serve_fixtures"]
peft = pytest.importorskip("peft")
from test_lora_engine import make_adapter  # noqa: E402 (needs peft)

KEY, PROMPT, N = "sk-lora", "hello world", 8
REFERENCE_ID = 99  # the offline references' own id: the server hands out 1, 2, ... as it loads


@pytest.fixture(scope="module")
def adapters(serving_pair, tmp_path_factory) -> dict:
    root, target = tmp_path_factory.mktemp("client_loras"), serving_pair[0]
    make_adapter(target, root / "one", 1, ["q_proj", "v_proj", "down_proj"])
    make_adapter(target, root / "wide", 4, ["q_proj"], r=16, alpha=16)  # above max_lora_rank 8
    return {name: str(root / name) for name in ("one", "wide")}


@pytest.fixture(scope="module")
def llm(serving_pair):
    with LLM(model=serving_pair[0], mode="ar", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        yield llm


@pytest.fixture(scope="module")
def url(llm):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")  # read once, as the app starts
        app = create_app(llm, ServerOptions("base", api_key=KEY))
    with serve_on_loopback(app) as url:
        yield url


def offline(llm, path: str | None) -> str:
    lora = LoRARequest("ref", REFERENCE_ID, path) if path else None
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def greedy(client, model: str) -> str:
    return client.complete(PROMPT, model=model, max_tokens=N, temperature=0, ignore_eos=True).text


def test_load_serves_the_adapter_and_unload_removes_it(url, llm, adapters):
    with Client(url, api_key=KEY, max_retries=0) as client:
        assert client.load_lora_adapter("one", adapters["one"]) == "Success: LoRA adapter 'one' added successfully."
        assert client.models() == ["base", "one"]
        assert greedy(client, "one") == offline(llm, adapters["one"]) != greedy(client, "base") == offline(llm, None)
        with pytest.raises(BadRequestError, match="has already been loaded") as err:
            client.load_lora_adapter("one", adapters["one"])
        assert err.value.status_code == 400
        assert client.load_lora_adapter("one", adapters["one"], load_inplace=True).startswith("Success")
        assert client.unload_lora_adapter("one") == "Success: LoRA adapter 'one' removed successfully."
        with pytest.raises(NotFoundError) as err:
            client.unload_lora_adapter("one")
        assert err.value.message == "The lora adapter 'one' cannot be found."
        with pytest.raises(NotFoundError) as err:
            greedy(client, "one")
        assert err.value.param == "model" and client.models() == ["base"]


def test_refusals_are_typed_errors(url, adapters):
    with Client(url, api_key=KEY, max_retries=0) as client:
        with pytest.raises(NotFoundError) as err:
            client.load_lora_adapter("gone", "/no/such/adapter")
        assert err.value.message == "Loading lora gone failed: No adapter found for /no/such/adapter"
        with pytest.raises(BadRequestError, match="max_lora_rank") as err:
            client.load_lora_adapter("wide", adapters["wide"])
        assert err.value.param == "lora_path"
        with pytest.raises(BadRequestError, match="served model name"):
            client.load_lora_adapter("base", adapters["one"])
        for bad in ("", "  ", None):  # refused before a request: the argument named
            with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
                client.load_lora_adapter(bad, adapters["one"])
            with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
                client.unload_lora_adapter(bad)
        with pytest.raises(ValueError, match="lora_path must be a non-empty string"):
            client.load_lora_adapter("x", "")
        assert client.models() == ["base"]


def test_async_client_loads_and_unloads(url, llm, adapters):
    async def go():
        async with AsyncClient(url, api_key=KEY, max_retries=0) as client:
            added = await client.load_lora_adapter("async-one", adapters["one"])
            text = (await client.complete(PROMPT, model="async-one", max_tokens=N, temperature=0, ignore_eos=True)).text
            removed = await client.unload_lora_adapter("async-one")
            with pytest.raises(NotFoundError):
                await client.unload_lora_adapter("async-one")
            with pytest.raises(BadRequestError, match="max_lora_rank"):
                await client.load_lora_adapter("wide", adapters["wide"])
            return added, text, removed
    added, text, removed = asyncio.run(go())
    assert added == "Success: LoRA adapter 'async-one' added successfully."
    assert removed == "Success: LoRA adapter 'async-one' removed successfully."
    assert text == offline(llm, adapters["one"])


def test_without_the_variable_the_routes_are_not_found(llm, adapters, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("SAGUARO_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    with serve_on_loopback(create_app(llm, ServerOptions("base"))) as url, Client(url, max_retries=0) as client:
        with pytest.raises(NotFoundError):
            client.load_lora_adapter("one", adapters["one"])
        with pytest.raises(NotFoundError):
            client.unload_lora_adapter("one")
