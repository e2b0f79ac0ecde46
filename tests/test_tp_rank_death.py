"""A tensor-parallel follower rank that dies (its process killed, its actor killed) is fatal for the cluster engine,
as rank 0's death is: the requests in flight fail retriably naming the lost rank, check_health raises (what Ray
Serve's replica health check reports), and LLM.rebuild() brings back a working engine. A torch process group with
a dead member never works again; the driver once watched rank 0 alone, so every later request failed while
check_health said the engine was healthy."""
from __future__ import annotations

import os
import signal
import threading
from dataclasses import replace

import pytest
import ray
from engine_helpers import PROMPTS, assert_greedy_equal, hf_greedy, llama_config, save_model, wait_for

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.engine.loop_thread import EngineError

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BOUND_S = 60  # the old code could answer late or never: every wait here is bounded


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_death") / "target"
    model = save_model(path, llama_config(96, 64, 2), seed=0)
    return str(path), model


def tp2_llm(path: str) -> LLM:
    return LLM(model=path, mode="ar", cluster="auto", tensor_parallel_size=2, max_batch_size=4)


def start_generate(llm: LLM, params: SamplingParams, prompts) -> tuple[threading.Thread, list]:
    """generate() on a thread (a request the engine forgot would wait forever: the test joins it, bounded); the
    list gets what it raised (None: it returned)."""
    raised: list[BaseException | None] = [None]

    def run() -> None:
        try:
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            raised[0] = err
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, raised


def follower_pid(llm: LLM) -> int:
    return ray.get(llm._thread.deployment.ranks[1].__ray_call__.remote(lambda _: os.getpid()))


def assert_rank_1_lost(err: BaseException | None) -> None:
    assert isinstance(err, EngineError) and err.retriable, repr(err)
    assert "tensor-parallel rank 1" in str(err), str(err)


def unhealthy(llm: LLM) -> bool:
    try:
        llm.check_health()
    except EngineError:
        return True
    return False


@pytest.fixture(scope="module")
def tp2_engine(ray_cluster, target):
    """One tp = 2 engine for both tests (each start-up: two ranks, each importing torch and loading its shard):
    the first leaves it rebuilt, the second kills a follower of that rebuilt group."""
    llm = tp2_llm(target[0])
    yield llm
    llm.shutdown()


def test_a_follower_killed_mid_generation_fails_the_engine_and_rebuild_restores_it(tp2_engine, target):
    _, model = target
    llm = tp2_engine
    pid = follower_pid(llm)
    worker, raised = start_generate(llm, replace(GREEDY, max_tokens=400), PROMPTS * 4)
    wait_for(lambda: llm.load.num_running > 0, within_s=BOUND_S)
    os.kill(pid, signal.SIGKILL)  # as the OOM killer would
    worker.join(timeout=BOUND_S)
    assert not worker.is_alive(), "the generate() in flight never learned of the dead rank"
    assert_rank_1_lost(raised[0])
    with pytest.raises(EngineError, match="target is gone .*tensor-parallel rank 1"):
        llm.check_health()
    worker, raised = start_generate(llm, GREEDY, PROMPTS[:1])  # refused at once, naming the rank
    worker.join(timeout=BOUND_S)
    assert_rank_1_lost(raised[0])
    llm.rebuild()
    llm.check_health()
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert_greedy_equal(out.outputs[0].token_ids, hf_greedy(model, prompt, GREEDY.max_tokens), prompt, model)


def test_a_follower_killed_between_requests_makes_check_health_raise(tp2_engine):
    """No request runs: only the driver's watch on the follower can tell (Serve's health check asks it)."""
    llm = tp2_engine
    if unhealthy(llm):  # left broken by a failure of the test before
        llm.rebuild()
    try:
        worker, raised = start_generate(llm, GREEDY, PROMPTS[:1])  # bounded: a group left broken could hang it
        worker.join(timeout=BOUND_S)
        assert not worker.is_alive() and raised[0] is None, raised[0]
        ray.kill(llm._thread.deployment.ranks[1], no_restart=True)
        wait_for(lambda: unhealthy(llm), within_s=BOUND_S)
        with pytest.raises(EngineError, match="target is gone .*tensor-parallel rank 1 of the target died"):
            llm.check_health()
        worker, raised = start_generate(llm, GREEDY, PROMPTS[:1])
        worker.join(timeout=BOUND_S)
        assert_rank_1_lost(raised[0])
    finally:
        llm.shutdown()
