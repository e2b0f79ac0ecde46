"""A runtime LoRA unload removes the adapter from the engine (vLLM's remove_lora): its slot and host copy are freed,
so adapters loaded after it take the slot instead of evicting live ones; a sequence running it when it is removed
finishes on its weights (token for token a run with it) and its slot is freed after; its id may then name another
path; an unknown name is a 404 that changes nothing; on Ray (tensor parallel 2) every rank's slot is freed.
Real tiny checkpoint, real PEFT adapters, real HTTP, a real local Ray cluster."""
from __future__ import annotations

import httpx
import pytest
import ray

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, LoRARequest, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_local_engine
from saguaro_dist.engine.sequence import Sequence, SeqStatus
from saguaro_dist.serve.api import ServerOptions, create_app

pytest_plugins = ["test_serve_fixtures"]
peft = pytest.importorskip("peft")
from test_lora_engine import make_adapter  # noqa: E402 (needs peft)

PROMPT = "hello world"
N = 12
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def adapters(serving_pair, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("unload_loras")
    for seed, name in enumerate(NAMES, start=11):
        make_adapter(serving_pair[0], root / name, seed, ["q_proj", "v_proj"])
    return {name: str(root / name) for name in NAMES}


@pytest.fixture(scope="module")
def llm(serving_pair):
    with LLM(model=serving_pair[0], mode="ar", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        yield llm


@pytest.fixture(scope="module")
def refs(llm, adapters) -> dict:
    """Each adapter's greedy output (text, token ids) offline; each then removed, leaving every slot empty."""
    out = {}
    for i, name in enumerate(NAMES):
        got = llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=LoRARequest(name, 100 + i, adapters[name]))
        out[name] = (got[0].outputs[0].text, list(got[0].outputs[0].token_ids))
        assert llm.remove_lora(100 + i) is True
    assert llm.remove_lora(100) is False  # gone already: nothing held
    assert len({tokens for tokens in (tuple(t) for _, t in out.values())}) == 3  # the adapters change the output
    return out


def held_names(llm) -> set[str]:
    return {r.lora_name for r in llm._thread.engine.target.loras.held if r is not None}


def test_offline_remove_frees_slots_and_host_copies(llm, refs):
    slots = llm._thread.engine.target.loras
    assert slots.held == [None, None] and slots.host.get(100) is None and slots.ids.current(100) is None


def test_unload_frees_the_slot_and_keeps_live_adapters(llm, adapters, refs):
    with serve_on_loopback(create_app(llm, ServerOptions("base", runtime_lora_updating=True))) as url:
        post = lambda route, **body: httpx.post(f"{url}/{route}", json=body, timeout=60)  # noqa: E731

        def complete(model: str) -> str:
            reply = httpx.post(f"{url}/completions", json={"model": model, "prompt": PROMPT, "max_tokens": N,
                                                           "temperature": 0, "ignore_eos": True}, timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        for name in ("a", "b"):
            assert post("load_lora_adapter", lora_name=name, lora_path=adapters[name]).status_code == 200
        assert (complete("b"), complete("a")) == (refs["b"][0], refs["a"][0])  # "a" the most recently used
        assert post("unload_lora_adapter", lora_name="a").status_code == 200
        assert held_names(llm) == {"b"}  # its slot free at once (nothing runs it)
        assert post("load_lora_adapter", lora_name="c", lora_path=adapters["c"]).status_code == 200
        assert complete("c") == refs["c"][0]
        assert held_names(llm) == {"b", "c"}  # "c" took a's slot: the live "b" was not evicted for it
        unknown = post("unload_lora_adapter", lora_name="nope")
        assert (unknown.status_code, unknown.json()["error"]["message"]) == (
            404, "The lora adapter 'nope' cannot be found.")
        assert held_names(llm) == {"b", "c"} and complete("b") == refs["b"][0]
        for i in range(3):  # more loads and unloads than max_loras: each serves its adapter, none leaks a slot
            assert post("load_lora_adapter", lora_name=f"cycle{i}", lora_path=adapters["a"]).status_code == 200
            assert complete(f"cycle{i}") == refs["a"][0]
            assert post("unload_lora_adapter", lora_name=f"cycle{i}").status_code == 200
            assert not any(name.startswith("cycle") for name in held_names(llm))
        for name in ("b", "c"):
            assert post("unload_lora_adapter", lora_name=name).status_code == 200
        assert held_names(llm) == set() and not llm._thread.engine.target.loras.host._adapters
        assert [card["id"] for card in httpx.get(f"{url}/models").json()["data"]] == ["base"]


def test_a_running_sequence_finishes_on_a_removed_adapter(serving_pair, adapters, refs):
    engine, tokenizer = build_local_engine(Config(model=serving_pair[0], mode="ar", enable_lora=True, max_loras=1,
                                                  max_lora_rank=8))
    prompt, slots = tokenizer.encode(PROMPT), engine.target.loras
    a, b = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])
    seq = lambda i, lora: Sequence(i, f"r{i}", list(prompt), GREEDY, lora_request=lora)  # noqa: E731
    try:
        running, waiting = seq(0, a), seq(1, b)
        engine.add(running)
        engine.step()
        engine.step()
        assert running.status is SeqStatus.RUNNING and not running.finished
        assert engine.remove_lora(1) is True
        assert slots.removed == {1} and slots.slot_of(1) == 0  # kept while it runs
        engine.add(waiting)
        engine.step()
        assert waiting.status is SeqStatus.WAITING  # max_loras 1: the slot is still a's
        while engine.has_work():
            engine.step()
        assert running.output_token_ids == refs["a"][1] and waiting.output_token_ids == refs["b"][1]
        assert slots.removed == set() and slots.held == [b]
        again = seq(2, LoRARequest("again", 1, adapters["c"]))  # id 1 is free: it may name another path
        engine.add(again)
        aborted = seq(3, b)
        engine.add(aborted)
        while engine.has_work():
            engine.step()
            if aborted.status is SeqStatus.RUNNING and not aborted.finished:
                assert engine.remove_lora(2) is True and slots.removed == {2}
                engine.abort("r3")
                assert slots.removed == set() and slots.slot_of(2) is None  # freed with its last sequence
        assert again.output_token_ids == refs["c"][1] and aborted.finished and len(aborted.output_token_ids) < N
        assert engine.remove_lora(77) is False and slots.removed == set()
    finally:
        engine.close()


def slots_of_each_rank(llm) -> list[list[bool]]:
    """Each tensor-parallel rank's runner: which LoRA slots hold weights (asked in its actor; rank 1's runner is
    the one its follower thread replays rank 0's calls on)."""
    rank0, rank1 = llm._thread.deployment.ranks
    held = lambda runner: [a is not None for a in runner.lora.adapters]  # noqa: E731
    return ray.get([rank0.__ray_call__.remote(lambda rank: held(rank.thread.engine.target.runner)),
                    rank1.__ray_call__.remote(lambda rank: held(rank._follower._args[0]))])


@pytest.mark.slow
def test_on_ray_remove_frees_the_slot_on_every_rank(ray_cluster, serving_pair, adapters, refs):
    """On Ray (tensor parallel 2) remove_lora reaches rank 0's engine: it says whether the engine held the
    adapter, every rank's slot is emptied, and the id may then name another path there."""
    with LLM(model=serving_pair[0], mode="ar", cluster="auto", tensor_parallel_size=2, enable_lora=True,
             max_loras=1, max_lora_rank=8, max_batch_size=2) as ray_llm:
        run = lambda lora: ray_llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=lora)  # noqa: E731
        assert run(LoRARequest("a", 1, adapters["a"]))[0].outputs[0].text == refs["a"][0]
        assert slots_of_each_rank(ray_llm) == [[True], [True]]
        assert ray_llm.remove_lora(1) is True
        assert slots_of_each_rank(ray_llm) == [[False], [False]]
        assert ray_llm.remove_lora(1) is False  # gone already: nothing held
        # the id is free on rank 0 too: it names c's path now, and runs c's weights
        assert run(LoRARequest("again", 1, adapters["c"]))[0].outputs[0].text == refs["c"][0]
