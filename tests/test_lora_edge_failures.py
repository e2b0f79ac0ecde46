"""A LoRA adapter the engine fails to load leaves its lora_int_id free at the LLM's edge too (vLLM's: a failed
load registers nothing): a later request naming the id with a corrected path runs it, on one host and on Ray. A
failed reload of an adapter still in its slot keeps the id bound. And a tensor-parallel follower that cannot
decode rank 0's replayed call ends its process, so that rank 0's next call fails instead of waiting on it."""
from __future__ import annotations

import asyncio
import os
import shutil

import pytest
from engine_helpers import PROMPTS, llama_config, save_model

from saguaro_dist import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")
from test_lora_engine import make_adapter, peft_greedy  # noqa: E402 (needs peft)

N = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def target_and_adapter(tmp_path_factory):
    """A tiny target, one PEFT adapter of it (path, PEFT model for references)."""
    root = tmp_path_factory.mktemp("lora_edge")
    save_model(root / "target", llama_config(96, 64, 2), seed=0)
    model = make_adapter(str(root / "target"), root / "good", 1, ["q_proj", "v_proj", "down_proj"])
    return str(root / "target"), str(root / "good"), model


def broken_after_the_edge_check(llm: LLM, good: str, folder, lora_int_id: int) -> LoRARequest:
    """An adapter the edge reads fine (it binds its id), whose files then break before the engine loads them."""
    shutil.copytree(good, folder)
    request = LoRARequest("broken", lora_int_id, str(folder))
    llm._lora_requests(request, 1)  # the edge: read once per id, then bound
    (folder / "adapter_config.json").write_text("[]")
    return request


def generate(llm: LLM, lora: LoRARequest):
    return llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, use_tqdm=False, lora_request=lora)


async def stream_tokens(llm: LLM, lora: LoRARequest) -> list[int]:
    tokens: list[int] = []
    async for delta in llm.stream(prompt_token_ids=PROMPTS[0], sampling_params=GREEDY, lora_request=lora):
        tokens += delta.token_ids
    return tokens


def test_an_id_whose_adapter_failed_to_load_can_name_a_corrected_path(target_and_adapter, tmp_path):
    """generate and stream: the failed request's error says why; the same id with a good path then runs PEFT's
    greedy tokens (it was refused "one id, one adapter" before)."""
    target, good, model = target_and_adapter
    want = peft_greedy(model, PROMPTS[0], N)
    with LLM(model=target, mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        broken = broken_after_the_edge_check(llm, good, tmp_path / "a", 7)
        with pytest.raises(ValueError, match=r"'broken'.*\(not loaded: lora_int_id 7 may name a corrected"):
            generate(llm, broken)
        assert list(generate(llm, LoRARequest("fixed", 7, good))[0].outputs[0].token_ids) == want

        broken = broken_after_the_edge_check(llm, good, tmp_path / "b", 8)
        with pytest.raises(ValueError, match="lora_int_id 8 may name a corrected"):
            asyncio.run(stream_tokens(llm, broken))
        assert asyncio.run(stream_tokens(llm, LoRARequest("fixed", 8, good))) == want


def test_a_failed_reload_of_a_loaded_adapter_keeps_its_id_bound(target_and_adapter, tmp_path):
    """load_inplace on files that broke: that request fails, but the slot still holds the id's adapter, so the
    id keeps its path (another path is still refused); once its files are back, the id runs them again."""
    target, good, model = target_and_adapter
    folder = tmp_path / "kept"
    shutil.copytree(good, folder)
    loaded = LoRARequest("kept", 5, str(folder))
    with LLM(model=target, mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        generate(llm, loaded)
        (folder / "adapter_config.json").write_text("[]")
        with pytest.raises(ValueError, match="'kept'") as failed:
            generate(llm, LoRARequest("kept", 5, str(folder), load_inplace=True))
        assert "not loaded" not in str(failed.value)
        with pytest.raises(ValueError, match="one id, one adapter"):
            generate(llm, LoRARequest("other", 5, good))
        shutil.rmtree(folder)
        shutil.copytree(good, folder)
        assert list(generate(llm, loaded)[0].outputs[0].token_ids) == peft_greedy(model, PROMPTS[0], N)


@pytest.mark.slow
def test_on_ray_a_failed_load_frees_the_id_at_the_driver(ray_cluster, target_and_adapter, tmp_path):
    """On Ray only the error's text reaches the driver: it still frees the id (tensor parallel 2: rank 0 reads
    the adapter, every rank loads it)."""
    target, good, model = target_and_adapter
    with LLM(model=target, mode="ar", cluster="auto", tensor_parallel_size=2, enable_lora=True, max_loras=1,
             max_lora_rank=8, max_batch_size=2) as llm:
        broken = broken_after_the_edge_check(llm, good, tmp_path / "a", 7)
        with pytest.raises(ValueError, match="lora_int_id 7 may name a corrected"):
            generate(llm, broken)
        assert list(generate(llm, LoRARequest("fixed", 7, good))[0].outputs[0].token_ids) == \
            peft_greedy(model, PROMPTS[0], N)


# -- tensor parallel: a follower that cannot decode rank 0's call ------------------------------------------

class Undecodable:
    """A replayed call's argument that pickles on rank 0 but cannot be rebuilt on a follower (as tensors that
    do not fit its device would)."""

    def __reduce__(self):
        return refuse_to_decode, ()


def refuse_to_decode():
    raise RuntimeError("this payload does not decode on a follower")


def tp_rank(rank: int, port: int, target: str, out: str) -> None:
    """Rank 0 drives a BroadcastRunner; rank 1 follows on a daemon thread as the TargetRank actor does, its main
    thread then living on (an actor's would serve Ray calls): it records that it outlived the follower."""
    import threading

    import torch
    import torch.distributed as dist

    from saguaro_dist.distributed.tp_runner import BroadcastRunner, run_follower
    from saguaro_dist.model import ModelRunner
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    runner = ModelRunner(target, tp_group=dist.group.WORLD)
    if rank == 1:
        follower = threading.Thread(target=run_follower, args=(runner, dist.group.WORLD), daemon=True)
        follower.start()
        follower.join()
        with open(out, "w") as f:
            f.write("the follower's process outlived its loop")
        return
    leader = BroadcastRunner(runner, dist.group.WORLD)
    leader.add("a")
    leader.extend(["a"], [[1, 2, 3]], [1])  # in lock-step so far
    leader.add(Undecodable())  # rank 0 holds a sequence the follower never heard of
    try:
        leader.extend(["a"], [[4]], [1])
        outcome = "no error"
    except RuntimeError as err:
        outcome = f"RuntimeError: {err}"
    with open(out, "w") as f:
        f.write(outcome)
    os._exit(0)  # (a broken gloo group's teardown may wait on its dead peer)


@pytest.mark.slow
def test_a_follower_that_cannot_decode_a_call_ends_and_rank_0_fails_at_once(target_and_adapter, tmp_path):
    """The follower's thread died of the undecodable call while its process lived on, so rank 0 waited in its
    next collective for the group's timeout (30 min). Now the follower ends its process (FOLLOWER_LOST_EXIT,
    after logging why) and rank 0's next replayed call raises (gloo: the peer closed)."""
    import multiprocessing

    from saguaro_dist.distributed.tp_runner import FOLLOWER_LOST_EXIT
    from saguaro_dist.serve.ingress import free_port
    target, _, _ = target_and_adapter
    spawn, port = multiprocessing.get_context("spawn"), free_port()
    ranks = [spawn.Process(target=tp_rank, args=(r, port, target, str(tmp_path / f"rank{r}"))) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)  # a safety net only: either side hanging is the bug
        if p.is_alive():
            p.kill()
    assert not (tmp_path / "rank1").exists(), (tmp_path / "rank1").read_text()
    assert ranks[1].exitcode == FOLLOWER_LOST_EXIT
    assert ranks[0].exitcode == 0 and (tmp_path / "rank0").read_text().startswith("RuntimeError: ")


def test_a_load_after_the_id_was_freed_and_bound_elsewhere_fails_alone(target_and_adapter, tmp_path):
    """Two requests of id 7 (path A) queued; the first's load fails, which frees the id; a request binds 7 to path
    B; the second A request's load must then fail ("one id, one adapter"), not put A's weights under an id bound to
    B (the slot table re-binds at each load; before, A loaded and a later B request would have run A's weights)."""
    target, good, _ = target_and_adapter
    shutil.copytree(good, tmp_path / "a")
    shutil.copytree(good, tmp_path / "b")
    first, second = (LoRARequest("a", 7, str(tmp_path / "a")) for _ in range(2))
    with LLM(model=target, mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        slots = llm._thread.engine.target.loras
        slots.note(first)
        slots.note(second)
        (tmp_path / "a" / "adapter_config.json").write_text("[]")
        with pytest.raises(ValueError, match="not loaded"):
            slots.acquire(first, set())
        (tmp_path / "a" / "adapter_config.json").write_text((tmp_path / "b" / "adapter_config.json").read_text())
        slots.note(LoRARequest("b", 7, str(tmp_path / "b")))
        with pytest.raises(ValueError, match="one id, one adapter"):
            slots.acquire(second, set())
        assert slots.slot_of(7) is None


def test_an_id_freed_at_the_edge_while_the_engine_loaded_it_heals(target_and_adapter, tmp_path, monkeypatch):
    """Two prompts of (7, P) in one batch, the first engine-side read failing once (a transient error): the
    second loads P, but the edge heard "not loaded" and forgot 7. A request of (7, Q) then passes the edge and
    is refused by the engine (it holds P); the edge must forget Q's binding again, so (7, P) runs (before, P was
    refused at the edge and Q at the engine for good)."""
    import saguaro_dist.engine.lora_slots as lora_slots
    target, good, model = target_and_adapter
    shutil.copytree(good, tmp_path / "q")
    real, calls = lora_slots.load_adapter, []

    def fails_once(*args, **kwargs):  # fault injection: the first engine-side read fails
        calls.append(1)
        if len(calls) == 1:
            raise OSError("transient read failure")
        return real(*args, **kwargs)
    monkeypatch.setattr(lora_slots, "load_adapter", fails_once)
    p, q = LoRARequest("p", 7, good), LoRARequest("q", 7, str(tmp_path / "q"))
    with LLM(model=target, mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        with pytest.raises(ValueError, match="transient"):
            llm.generate(prompt_token_ids=[PROMPTS[0], PROMPTS[1]], sampling_params=GREEDY, use_tqdm=False,
                         lora_request=p)
        with pytest.raises(ValueError, match="one id, one adapter"):
            generate(llm, q)
        assert generate(llm, p)[0].outputs[0].token_ids == peft_greedy(model, PROMPTS[0], N)
