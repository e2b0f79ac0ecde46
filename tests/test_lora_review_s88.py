"""A LoRA adapter's load puts what it read into the engine's host memory (vLLM's add_lora preloads it into the
CPU cache before answering): its requests read no files, so the folder may go (or be rewritten) after the 200,
and its requests still run the adapter loaded while it stays in the host LRU of max_cpu_loras (evictable like any
other, as vLLM's: one dropped is read again from its path, and if its files went its requests get a 500 saying so).
A load_inplace reload frees the id it replaces; a bad target_modules regex is refused naming target_modules. Real tiny checkpoint and PEFT adapters, a real engine, real HTTP on loopback."""
from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, LoRARequest, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.lora_request import ONE_ID_ONE_ADAPTER
from saguaro_dist.model.hf_config import load_config
from saguaro_dist.model.lora_adapter import load_adapter
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.lora_modules import LoRAModule
from saguaro_dist.serve.lora_models import ServedModels

pytest_plugins = ["test_serve_fixtures"]
peft = pytest.importorskip("peft")
from test_lora_engine import ALL, make_adapter  # noqa: E402 (needs peft)
from test_serve_fixtures import make_tokenizer, write_llama  # noqa: E402

PROMPT = [5, 6, 7, 8]
N = 6
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
CPU_LORAS = 4  # the engine's max_cpu_loras
# A held request's length: it runs (~10 s, ended early) while a test acts, HTTP round trips and waits on a loaded
# box included (2000, ~1 s, could end first, and a wait for the slot it held then timed out).
HOLD_TOKENS = 20_000


@pytest.fixture(scope="module")
def adapters(serving_pair, tmp_path_factory) -> dict:
    root, target = tmp_path_factory.mktemp("s88_loras"), serving_pair[0]
    make_adapter(target, root / "one", 1, ["q_proj", "v_proj", "down_proj"])
    make_adapter(target, root / "two", 2, ALL, r=8, alpha=16)
    return {name: str(root / name) for name in ("one", "two")}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """One slot (two adapters evict each other) and CPU_LORAS host copies; serving_pair's target (same seed and
    shapes) with room for HOLD_TOKENS, so a held request runs while a test acts (holding)."""
    target = write_llama(tmp_path_factory.mktemp("s88_target"), make_tokenizer(), hidden=64, layers=2, seed=1,
                         max_positions=HOLD_TOKENS + 2 * len(PROMPT))
    with LLM(model=target, mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8,
             max_cpu_loras=CPU_LORAS) as llm:
        yield llm


@pytest.fixture(scope="module")
def offline(llm, adapters) -> dict:
    """Each adapter's greedy tokens, from its own folder under ids the servers never hand out."""
    loras = {"one": LoRARequest("one", 101, adapters["one"]), "two": LoRARequest("two", 102, adapters["two"])}
    out = {name: llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, use_tqdm=False,
                              lora_request=lora)[0].outputs[0].token_ids for name, lora in loras.items()}
    assert out["one"] != out["two"]
    return {name: list(ids) for name, ids in out.items()}


@pytest.fixture(scope="module")
def served(llm, adapters, offline, tmp_path_factory):
    """(url, its ServedModels): one server on the engine (its ids are the engine's), with runtime updates and one
    --lora-modules adapter "s" (adapter two), whose folder is removed once the app was built."""
    folder = copy(adapters["two"], tmp_path_factory.mktemp("s88_static"), "static")
    models = ServedModels(("base",), llm.config, (LoRAModule("s", folder),))
    app = create_app(llm, ServerOptions("base", runtime_lora_updating=True), models=models)
    shutil.rmtree(folder)
    with serve_on_loopback(app) as url:
        yield url, models


def completion(url: str, model: str) -> list[int]:
    reply = httpx.post(f"{url}/completions", json={"model": model, "prompt": PROMPT, "max_tokens": N,
                                                    "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                                    "return_tokens_as_token_ids": True}, timeout=120)
    assert reply.status_code == 200, reply.text
    return [int(t.removeprefix("token_id:")) for t in reply.json()["choices"][0]["logprobs"]["tokens"]]


def load(url: str, name: str, path: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra}, timeout=60)


def copy(path: str, tmp_path, name: str) -> str:
    return str(shutil.copytree(path, tmp_path / name))


def unload(url: str, name: str) -> None:
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": name}, timeout=60).status_code == 200


def test_a_runtime_load_serves_its_adapter_after_the_folder_is_gone(served, adapters, offline, tmp_path):
    """Two adapters loaded, both folders removed, then each asked for in turn: with one slot each request evicts
    the other adapter (and the static one) from it, whose files are gone; all run what host memory kept."""
    url = served[0]
    for name in ("one", "two"):
        assert load(url, name, copy(adapters[name], tmp_path, name)).status_code == 200
    shutil.rmtree(tmp_path / "one")
    shutil.rmtree(tmp_path / "two")
    for name in ("one", "s", "two", "one"):
        assert completion(url, name) == offline["two" if name == "s" else name]
    unload(url, "one")
    unload(url, "two")


def test_a_runtime_load_runs_what_it_read_not_the_files_rewritten_after(served, adapters, offline, tmp_path):
    url, folder = served[0], copy(adapters["one"], tmp_path, "rewritten")
    assert load(url, "r", folder).status_code == 200
    shutil.rmtree(folder)
    shutil.copytree(adapters["two"], folder)
    assert completion(url, "r") == offline["one"]
    unload(url, "r")


def test_a_lora_module_is_read_at_start_up_and_serves_after_its_folder_is_gone(served, offline):
    assert completion(served[0], "s") == offline["two"]


def test_llm_add_lora_preloads_the_adapter(llm, adapters, offline, tmp_path):
    folder = copy(adapters["two"], tmp_path, "added")
    request = LoRARequest("added", 201, folder)
    assert llm.add_lora(request) is True
    shutil.rmtree(folder)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, use_tqdm=False, lora_request=request)
    assert list(out[0].outputs[0].token_ids) == offline["two"]
    assert llm.remove_lora(201) is True
    with pytest.raises(ValueError, match="not a directory"):  # removed: nothing of it is kept, and its files are gone
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, use_tqdm=False, lora_request=request)


def test_llm_add_lora_refuses_an_unreadable_adapter_and_binds_nothing(llm, adapters, tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        llm.add_lora(LoRARequest("none", 202, str(tmp_path / "none")))
    assert llm.add_lora(LoRARequest("none", 202, adapters["one"])) is True  # the id was left free
    assert llm.remove_lora(202) is True


def test_a_load_inplace_reload_frees_the_id_it_replaces(llm, served, adapters, offline, tmp_path):
    (url, models), slots = served, llm._thread.engine.target.loras
    assert load(url, "rl", copy(adapters["one"], tmp_path, "step0")).status_code == 200
    first = models.adapters["rl"].lora_int_id
    assert completion(url, "rl") == offline["one"]
    for step, name in ((1, "two"), (2, "one")):
        reply = load(url, "rl", copy(adapters[name], tmp_path, f"step{step}"), load_inplace=True)
        assert reply.status_code == 200, reply.text
        assert completion(url, "rl") == offline[name]
    last = models.adapters["rl"].lora_int_id
    assert last == first + 2
    kept = [i for i in range(first, last) if slots.ids.current(i) is not None or slots.host.get(i) is not None]
    assert kept == [] and slots.host.get(last) is not None and last in slots.added
    assert not slots.added & {first, first + 1}
    unload(url, "rl")


def test_a_failed_runtime_load_hands_out_no_id(serving_pair, adapters):
    served = ServedModels(("base",), Config(model=serving_pair[0], mode="ar", enable_lora=True, max_lora_rank=8))
    with pytest.raises(APIError):
        asyncio.run(served.load("x", "/no/such/adapter"))
    asyncio.run(served.load("x", adapters["one"]))
    assert served.adapters["x"].lora_int_id == 1


def test_a_bad_target_modules_regex_is_refused_naming_it(serving_pair, adapters, tmp_path):
    folder = copy(adapters["one"], tmp_path, "regex")
    config_file = tmp_path / "regex" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "target_modules": "(q_proj"}))
    with pytest.raises(ValueError) as err:
        load_adapter(folder, load_config(serving_pair[0]), 8)
    message = str(err.value)
    assert "target_modules '(q_proj'" in message and "adapter_config.json" in message
    assert "cannot be read" not in message


def test_max_cpu_loras_bounds_the_host_copies_of_runtime_loads(llm, served, adapters, offline):
    """Each load preloads its adapter (the most recent) into the LRU, which drops the oldest past max_cpu_loras;
    one dropped whose files are there is read again at its next request (vLLM's)."""
    url, slots = served[0], llm._thread.engine.target.loras
    names = [f"b{i}" for i in range(2 * CPU_LORAS)]
    for name in names:
        assert load(url, name, adapters["one"]).status_code == 200
        assert len(slots.host) <= CPU_LORAS
    assert slots.host.get(served[1].adapters[names[-1]].lora_int_id) is not None
    assert completion(url, names[0]) == offline["one"]
    for name in names:
        unload(url, name)


def test_a_dropped_served_adapter_whose_files_went_fails_server_side(served, adapters, offline, tmp_path):
    """Loaded, its folder removed, then dropped from host memory by CPU_LORAS later loads: its request is the
    server's 500 naming the adapter, max_cpu_loras and the path (not a 400 blaming the request), streamed or not;
    a load_inplace reload serves it again. (Last of the server's tests: static "s", whose folder went, is dropped.)"""
    url, folder = served[0], copy(adapters["one"], tmp_path, "gone")
    assert load(url, "gone", folder).status_code == 200
    shutil.rmtree(folder)
    fillers = [f"f{i}" for i in range(CPU_LORAS)]
    for name in fillers:
        assert load(url, name, adapters["two"]).status_code == 200
    body = {"model": "gone", "prompt": PROMPT, "max_tokens": N}
    reply = httpx.post(f"{url}/completions", json=body, timeout=120)
    assert reply.status_code == 500, reply.text
    error = reply.json()["error"]
    assert error["type"] == "server_error" and error["code"] == 500
    for part in ("'gone'", "dropped from host memory past max_cpu_loras", f"files at {folder}", "load it again"):
        assert part in error["message"]
    streamed = httpx.post(f"{url}/completions", json={**body, "stream": True}, timeout=120)
    assert "past max_cpu_loras" in streamed.text and '"code":500' in streamed.text.replace(" ", "")
    assert load(url, "gone", adapters["one"], load_inplace=True).status_code == 200
    assert completion(url, "gone") == offline["one"]
    for name in ("gone", *fillers):
        unload(url, name)


@pytest.mark.slow
def test_add_lora_on_ray_preloads_on_rank_0(serving_pair, adapters, offline, ray_cluster, tmp_path):
    """On a Ray engine add_lora reads on rank 0 and keeps the copy there: the folder may go before the request."""
    folder = copy(adapters["one"], tmp_path, "ray")
    with LLM(model=serving_pair[0], mode="ar", cluster="auto", enable_lora=True, max_loras=1,
             max_lora_rank=8) as ray_llm:
        request = LoRARequest("ray", 1, folder)
        assert ray_llm.add_lora(request) is True
        shutil.rmtree(folder)
        out = ray_llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, use_tqdm=False, lora_request=request)
        assert list(out[0].outputs[0].token_ids) == offline["one"]
        with pytest.raises(ValueError, match="node of the target's rank 0"):
            ray_llm.add_lora(LoRARequest("gone", 2, folder))
        # rank 0's refusal of an id it holds under another path read nothing there: no node named (the LLM's edge
        # refuses it first, so asked of the actor itself)
        added, error = ray.get(ray_llm._thread.rank0.add_lora.remote(LoRARequest("other", 1, adapters["two"])))
        assert not added and error.endswith(ONE_ID_ONE_ADAPTER), error


def generate(llm, lora: LoRARequest) -> list[int]:
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, use_tqdm=False, lora_request=lora)
    return list(out[0].outputs[0].token_ids)


@contextlib.contextmanager
def holding(llm, lora: LoRARequest, request_id: str):
    """A long greedy request of `lora` running (its first tokens out) while the block runs, aborted at its end:
    yields the list its tokens go to. One that ended before the block did fails it (the block acted with the
    slot free, or its wait for a queued request timed out): HOLD_TOKENS is too short then."""
    tokens, started = [], threading.Event()
    params = SamplingParams(temperature=0, max_tokens=HOLD_TOKENS, ignore_eos=True)

    async def run():
        async for delta in llm.stream(prompt_token_ids=PROMPT, sampling_params=params, request_id=request_id,
                                      lora_request=lora):
            tokens.extend(delta.token_ids)
            started.set()

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(asyncio.run, run())
        while not started.wait(0.05):
            assert not done.done(), done.result()
        ended = "the held request ended before the block did: raise HOLD_TOKENS"
        try:
            yield tokens
        except Exception:
            assert not done.done(), ended  # why the block failed, its own error chained
            raise
        else:
            assert not done.done(), ended
        finally:
            llm.abort(request_id)
            done.result(timeout=120)


def wait_until(check, timeout_s: float = 60) -> None:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if check():
            return
        done.wait(0.01)
    raise AssertionError("timed out")


def test_add_lora_again_of_an_id_it_holds_keeps_its_weights(llm, adapters, offline, tmp_path):
    """vLLM's add_lora of an adapter it holds only marks it recently used: a second read (of files rewritten since)
    would have become the id's weights, silently, once the slot was evicted."""
    folder = copy(adapters["one"], tmp_path, "again")
    request = LoRARequest("again", 302, folder)
    assert llm.add_lora(request) is True
    assert generate(llm, request) == offline["one"]
    shutil.rmtree(folder)
    shutil.copytree(adapters["two"], folder)
    assert llm.add_lora(request) is True
    assert generate(llm, LoRARequest("two", 102, adapters["two"])) == offline["two"]  # evicts it from the one slot
    assert generate(llm, request) == offline["one"]
    assert llm.remove_lora(302) is True


def test_an_id_removed_while_it_runs_takes_a_new_path(llm, adapters, offline):
    """LLM.remove_lora, then add_lora of the id with another path while a request still runs it (vLLM loads it):
    the running request ends on the old weights, later ones run the new."""
    first, second = LoRARequest("first", 311, adapters["one"]), LoRARequest("second", 311, adapters["two"])
    with ThreadPoolExecutor(1) as pool:
        with holding(llm, first, "held-311") as tokens:
            assert llm.remove_lora(311) is True
            assert llm.add_lora(second) is True
            later = pool.submit(generate, llm, second)  # waits for the slot's old weights to be free
            wait_until(lambda: len(tokens) >= N)
        assert tokens[:N] == offline["one"]
        assert later.result(timeout=120) == offline["two"]
    assert llm.remove_lora(311) is True


def test_a_request_queued_under_a_name_reloaded_in_place_runs_the_weights_it_named(llm, served, adapters, offline,
                                                                                     tmp_path):
    """A request waiting for the one slot when a load_inplace reload of its name answered and the old folder was
    deleted (RL weight sync): the old id's host copy stayed for it (its removal waits for queued requests too)."""
    url, step0 = served[0], copy(adapters["one"], tmp_path, "q0")
    assert load(url, "rlq", step0).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        with holding(llm, LoRARequest("hold", 401, adapters["two"]), "held-401"):
            queued = pool.submit(completion, url, "rlq")
            wait_until(lambda: "rlq" in llm.load.waiting_lora_adapters)
            assert load(url, "rlq", copy(adapters["two"], tmp_path, "q1"), load_inplace=True).status_code == 200
            shutil.rmtree(step0)
        assert queued.result(timeout=120) == offline["one"]
    assert completion(url, "rlq") == offline["two"]
    unload(url, "rlq")
    assert llm.remove_lora(401) is True


def test_a_load_whose_wait_for_the_engine_timed_out_spends_its_id(llm, served, adapters, offline):
    """The add's chore queued on the engine's thread runs after its wait timed out (a 500), binding the id: later
    loads get fresh ids (vLLM's counter moves before add_lora), not that one for another path (a 400 for good)."""
    url, thread = served[0], llm._thread
    saved = vars(thread).get("chore_timeout_s")
    thread.chore_timeout_s = 0  # one long step: the chore cannot have run when the wait ends
    try:
        reply = load(url, "late", adapters["one"])
    finally:
        thread.chore_timeout_s = saved
    assert reply.status_code == 500, reply.text
    llm.reset_prefix_cache()  # a chore queued after the late one: that one ran
    for name, path in (("late", adapters["two"]), ("next", adapters["one"])):
        assert load(url, name, path).status_code == 200
    assert completion(url, "late") == offline["two"] and completion(url, "next") == offline["one"]
    unload(url, "late")
    unload(url, "next")


def test_a_removed_adapters_queued_request_keeps_its_host_copy_past_the_lru(adapters, offline, tmp_path):
    """max_cpu_loras at its default (max_loras, 1): a removed adapter's queued request waited behind another
    adapter's, which took the slot and dropped the removed one's host copy from the LRU; its folder gone, the
    queued request then failed (a reviewer's reproduction). Removed ids still named are kept like held ones."""
    target = write_llama(tmp_path / "target", make_tokenizer(), hidden=64, layers=2, seed=1,
                         max_positions=HOLD_TOKENS + 2 * len(PROMPT))
    first, other = LoRARequest("a", 1, copy(adapters["one"], tmp_path, "a")), LoRARequest("b", 2, adapters["two"])
    with LLM(model=target, mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8, max_batch_size=1) as small:
        assert small.add_lora(first) is True
        with ThreadPoolExecutor(2) as pool:
            with holding(small, first, "held-a"):
                queued_other = pool.submit(generate, small, other)  # waits: the one slot runs "a"
                wait_until(lambda: len(small.load.waiting_lora_adapters) == 1)
                queued_first = pool.submit(generate, small, first)  # waits behind it, naming "a"
                wait_until(lambda: len(small.load.waiting_lora_adapters) == 2)
                assert small.remove_lora(1) is True
                shutil.rmtree(first.lora_path)  # an RL loop deletes the checkpoint it replaced
            assert queued_other.result(timeout=120) == offline["two"]
            assert queued_first.result(timeout=120) == offline["one"]
