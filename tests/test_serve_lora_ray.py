"""Multi-LoRA through the real Ray Serve deployment (serve/app.py's replica, its engine's target on a TargetRank
actor and its draft on a draft-worker actor): `saguaro serve --enable-lora --lora-modules one=PATH` as the CLI
deploys it, beside the session's app on the same Serve HTTP port. A request naming the adapter answers its
greedy text offline (LLM.generate with the same LoRARequest), the base name the base's, /v1/models lists it."""
from __future__ import annotations

import httpx
import pytest

from saguaro_dist import LLM, LoRARequest, SamplingParams

pytest_plugins = ["test_serve_fixtures"]
peft = pytest.importorskip("peft")
from test_lora_engine import make_adapter  # noqa: E402 (needs peft)

APP, PREFIX = "lora", "/lora"
PROMPT, N = "hello world", 8


def completion(server, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}{PREFIX}/v1/completions", json=body, headers=server.headers, timeout=120)


@pytest.mark.slow
def test_an_adapter_served_on_ray_runs_on_the_target_actor(server, serving_pair, tmp_path):
    from ray import serve

    from saguaro_dist.serve.app import build_app
    target, draft = serving_pair
    adapter = str(tmp_path / "one")
    make_adapter(target, adapter, 1, ["q_proj", "v_proj", "down_proj"])
    # the app args `saguaro serve --enable-lora --max-loras 1 --max-lora-rank 8 --lora-modules one=PATH` give
    args = {"model": target, "draft": draft, "mode": "ssd", "k": 2, "max_model_len": 256, "cluster": "auto",
            "num_draft_workers": 1, "api_key": server.api_key, "served_model_name": "base", "enable_lora": True,
            "max_loras": 1, "max_lora_rank": 8, "lora_modules": [f"one={adapter}"]}
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    try:
        texts = {}
        for name in ("base", "one"):
            reply = completion(server, name)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == name
            texts[name] = reply.json()["choices"][0]["text"]
        cards = httpx.get(f"{server.url}{PREFIX}/v1/models", headers=server.headers, timeout=30).json()["data"]
    finally:
        serve.delete(APP)
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [("base", None, target), ("one", "base", adapter)]
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    with LLM(model=target, mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        want = {name: llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
                for name, lora in (("base", None), ("one", LoRARequest("one", 1, adapter)))}
    assert texts == want
    assert texts["one"] != texts["base"]  # the adapter reached the target actor: it changes the tokens
