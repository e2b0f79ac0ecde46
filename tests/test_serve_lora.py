"""Multi-LoRA served as vLLM serves it, over real HTTP on loopback (the app each Serve replica builds, a real tiny
checkpoint and PEFT adapters): a request whose `model` names an adapter runs it (its greedy text is LLM.generate's
with the same LoRARequest), base names run the base, /v1/models lists both (vLLM's parent / root), unknown models
are vLLM's 404, runtime load / unload exist only under VLLM_ALLOW_RUNTIME_LORA_UPDATING, and every refused flag
combination stops `saguaro serve` before Ray starts."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, LoRARequest, SamplingParams
from saguaro_dist.beam_search import BeamSearchParams
from saguaro_dist.cli import main
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.app import server_options
from saguaro_dist.serve.lora_modules import LoRAModule, lora_modules

pytest_plugins = ["test_serve_fixtures"]
peft = pytest.importorskip("peft")
from test_lora_engine import ALL, make_adapter  # noqa: E402 (needs peft)

PROMPT = "hello world"
N = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@pytest.fixture(scope="module")
def adapters(serving_pair, tmp_path_factory) -> dict:
    root, target = tmp_path_factory.mktemp("served_loras"), serving_pair[0]
    make_adapter(target, root / "one", 1, ["q_proj", "v_proj", "down_proj"])
    make_adapter(target, root / "two", 2, ALL, r=8, alpha=16)
    make_adapter(target, root / "three", 3, ["q_proj", "o_proj"])
    make_adapter(target, root / "wide", 4, ["q_proj"], r=16, alpha=16)  # above max_lora_rank 8
    (root / "empty").mkdir()
    return {name: str(root / name) for name in ("one", "two", "three", "wide", "empty")}


MODULES = lambda a: (LoRAModule("one", a["one"]), LoRAModule("two", a["two"], "alias"))  # noqa: E731


@pytest.fixture(scope="module")
def llm(serving_pair):
    with LLM(model=serving_pair[0], mode="ar", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        yield llm


@pytest.fixture(scope="module")
def url(llm, adapters):
    options = ServerOptions("base", model_aliases=("alias",), lora_modules=MODULES(adapters))
    with serve_on_loopback(create_app(llm, options)) as url:
        yield url


def requests_of(adapters) -> dict:
    """The ids the server hands out: --lora-modules in order from 1."""
    return {"one": LoRARequest("one", 1, adapters["one"]), "two": LoRARequest("two", 2, adapters["two"])}


def offline(llm, lora=None) -> str:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def complete(url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/completions", json={"model": model, "prompt": PROMPT, "max_tokens": N,
                                                   "temperature": 0, "ignore_eos": True, **extra}, timeout=120)


def test_an_adapter_name_runs_the_adapter(url, llm, adapters):
    loras = requests_of(adapters)
    texts = {}
    for name in ("base", "alias", "one", "two"):
        reply = complete(url, name)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == ("base" if name == "alias" else name)  # vLLM: the adapter's, or the first base
        texts[name] = reply.json()["choices"][0]["text"]
    assert texts["base"] == texts["alias"] == offline(llm)
    assert texts["one"] == offline(llm, loras["one"]) and texts["two"] == offline(llm, loras["two"])
    assert len({texts["base"], texts["one"], texts["two"]}) == 3  # the adapters change the output


def test_chat_responses_and_streams_run_the_adapter(url, llm, adapters):
    lora = requests_of(adapters)["two"]
    messages = [{"role": "user", "content": PROMPT}]
    want = llm.chat(messages, GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    body = {"model": "two", "messages": messages, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    chat = httpx.post(f"{url}/chat/completions", json=body, timeout=120).json()
    assert (chat["model"], chat["choices"][0]["message"]["content"]) == ("two", want)
    with httpx.stream("POST", f"{url}/chat/completions", json={**body, "stream": True}, timeout=120) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert {c["model"] for c in chunks} == {"two"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == want
    resp = httpx.post(f"{url}/responses", json={"model": "two", "input": PROMPT, "max_output_tokens": N,
                                                "temperature": 0}, timeout=120)
    assert resp.status_code == 200 and resp.json()["model"] == "two", resp.text


def test_base_and_adapter_requests_at_once(url, llm, adapters):
    loras = requests_of(adapters)
    names = ["base", "one", "two", "one", "base", "two"]
    with ThreadPoolExecutor(len(names)) as pool:
        replies = list(pool.map(lambda name: complete(url, name), names))
    for name, reply in zip(names, replies):
        assert reply.json()["choices"][0]["text"] == offline(llm, loras.get(name)), name


def test_beam_search_carries_the_adapter(url, llm, adapters):
    lora = requests_of(adapters)["one"]
    reply = complete(url, "one", use_beam_search=True, n=2, max_tokens=4)
    assert reply.status_code == 200, reply.text
    ids = llm.tokenizer.encode(PROMPT)
    beams = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=2, max_tokens=4),
                            lora_request=lora)[0].sequences
    assert [c["text"] for c in reply.json()["choices"]] == [llm.tokenizer.decode(b.tokens[len(ids):]) for b in beams]
    assert complete(url, "base", use_beam_search=True, n=2, max_tokens=4).json()["choices"] != reply.json()["choices"]


def test_models_lists_the_base_then_the_adapters(url, adapters):
    cards = httpx.get(f"{url}/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("base", None), ("alias", None), ("one", "base"),
                                                      ("two", "alias")]
    assert [c["root"] for c in cards[2:]] == [adapters["one"], adapters["two"]]


def test_unknown_models_are_404_and_adapters_are_served_names(url):
    for path, body in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("responses", {"input": "x"})):
        reply = httpx.post(f"{url}/{path}", json={"model": "nope", **body})
        assert reply.status_code == 404, path
        assert reply.json()["error"]["message"] == "The model `nope` does not exist."
    root = url.removesuffix("/v1")
    assert httpx.post(f"{root}/tokenize", json={"model": "one", "prompt": PROMPT}).status_code == 200
    assert httpx.post(f"{root}/detokenize", json={"model": "two", "tokens": [1, 2]}).status_code == 200
    assert httpx.post(f"{root}/tokenize", json={"model": "nope", "prompt": PROMPT}).status_code == 404


def test_runtime_routes_are_absent_without_the_variable(url):
    for route in ("load_lora_adapter", "unload_lora_adapter"):
        assert httpx.post(f"{url}/{route}", json={"lora_name": "x", "lora_path": "/x"}).status_code == 404


def test_runtime_load_and_unload(llm, adapters, monkeypatch):
    monkeypatch.setenv(RUNTIME_ENV, "true")
    options = ServerOptions("base", model_aliases=("alias",), lora_modules=MODULES(adapters))
    with serve_on_loopback(create_app(llm, options)) as url:
        load = lambda **b: httpx.post(f"{url}/load_lora_adapter", json=b, timeout=60)  # noqa: E731
        assert complete(url, "three").status_code == 404
        added = load(lora_name="three", lora_path=adapters["three"])
        assert (added.status_code, added.text) == (200, "Success: LoRA adapter 'three' added successfully.")
        assert complete(url, "three").json()["choices"][0]["text"] == offline(llm, LoRARequest("three", 3, adapters["three"]))
        assert [c["id"] for c in httpx.get(f"{url}/models").json()["data"]][-1] == "three"
        again = load(lora_name="three", lora_path=adapters["three"])
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
        assert load(lora_name="three", lora_path=adapters["three"], load_inplace=True).status_code == 200
        missing = load(lora_name="gone", lora_path="/no/such/adapter")
        assert (missing.status_code, missing.json()["error"]["message"]) == (
            404, "Loading lora gone failed: No adapter found for /no/such/adapter")
        reply = load(lora_name="wide", lora_path=adapters["wide"])
        assert reply.status_code == 400 and "LoRA adapter" in reply.json()["error"]["message"], reply.text
        empty = load(lora_name="e", lora_path=adapters["empty"])  # no adapter_config.json: vLLM's not-found too
        assert (empty.status_code, empty.json()["error"]["message"]) == (
            404, f"Loading lora e failed: No adapter found for {adapters['empty']}")
        assert load(lora_name="", lora_path=adapters["three"]).status_code == 400
        assert load(lora_name="base", lora_path=adapters["three"]).status_code == 400
        gone = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "three"})
        assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'three' removed successfully.")
        twice = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "three"})
        assert (twice.status_code, twice.json()["error"]["message"]) == (404, "The lora adapter 'three' cannot be found.")
        assert complete(url, "three").status_code == 404


def test_lora_modules_parse_as_vllm(adapters):
    given = ["a=/p/a", json.dumps({"name": "b", "path": "/p/b", "base_model_name": "m"})]
    assert lora_modules(given) == (LoRAModule("a", "/p/a"), LoRAModule("b", "/p/b", "m"))
    assert lora_modules(json.dumps([{"name": "a", "path": "/p/a"}])) == (LoRAModule("a", "/p/a"),)
    assert lora_modules("a=/p/a") == (LoRAModule("a", "/p/a"),)
    options = server_options({"enable_lora": "true", "lora_modules": given, "served_model_name": "m"}, "/t")
    assert [m.name for m in options.lora_modules] == ["a", "b"]


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "one={one}"], "need enable_lora"),
    (["--enable-lora", "--lora-modules", "one={one}", "one={two}"], "given twice"),
    (["--enable-lora", "--served-model-name", "m", "--lora-modules", "m={one}"], "is a served model name"),
    (["--enable-lora", "--lora-modules", "bad={empty}"], "no adapter_config.json"),
    (["--enable-lora", "--lora-modules", "bad=/no/such/dir"], "not a directory"),
    (["--enable-lora", "--max-lora-rank", "8", "--lora-modules", "w={wide}"], "greater than max_lora_rank 8"),
    (["--enable-lora", "--lora-modules", '{{"name": "x", "path": "{one}", "base_model_name": "other"}}'],
     "is not a served model name"),
    (["--enable-lora", "--lora-modules", "noequals"], "expected name=path"),
    (["--max-loras", "0"], "max_loras must be"),
])
def test_refused_flags_stop_the_server_before_ray(serving_pair, adapters, flags, message, capsys):
    argv = ["serve", serving_pair[0], *(f.format(**adapters) for f in flags)]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_runtime_updates_with_replicas_are_refused(serving_pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(RUNTIME_ENV, "1")
    config = tmp_path / "serve.yaml"
    config.write_text(json.dumps({"applications": [{"name": "saguaro", "import_path": "saguaro_dist.serve.app:build_app",
                                                    "args": {"model": serving_pair[0]},
                                                    "deployments": [{"name": "SaguaroServer", "num_replicas": 2}]}]}))
    assert main(["serve", "--config", str(config), "--enable-lora"]) == 2
    assert "needs one replica" in capsys.readouterr().err
