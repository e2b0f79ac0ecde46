"""The Ray runtime's edges (saguaro_dist/distributed/cluster.py, placement.py): shutdown, a dead target, start-up
that cannot finish, a draft actor killed mid-generation, and the Ray a process starts for cluster="local".
Real Ray actors and real gRPC; tiny checkpoints written by transformers."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from engine_helpers import PROMPTS, assert_greedy_equal, close_pair, hf_greedy, llama_config, port_closed, save_model
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.distributed import cluster
from saguaro_dist.distributed.cluster import wait_dead
from saguaro_dist.distributed.deployment import _LastingThread
from saguaro_dist.distributed.placement import target_placement
from saguaro_dist.engine.loop_thread import EngineError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("review_pair"))


def ngram_llm(pair, **kwargs) -> LLM:
    """A target alone (no draft actors): the quickest engine on Ray to start."""
    return LLM(model=pair["target"], mode="ngram", k=3, cluster="auto", max_batch_size=2, **kwargs)


def free_cpus() -> float:
    return ray.available_resources().get("CPU", 0)


def wait_cpus(at_least: float, within_s: float = 30.0) -> float:
    """Free CPUs once they reach at_least (Ray frees a killed actor's, and a removed group's, asynchronously)."""
    deadline = time.time() + within_s
    while free_cpus() < at_least and time.time() < deadline:
        time.sleep(0.2)
    return free_cpus()


def settled_cpus(quiet_s: float = 2.0, within_s: float = 30.0) -> float:
    """Free CPUs before a test: all of the cluster's, or a count unchanged for quiet_s. Other files' session
    fixtures (the Serve app of test_serve_fixtures) hold CPUs for the whole session: waiting for every CPU
    waited out within_s in each test that ran after them on the same xdist worker."""
    total, deadline = ray.cluster_resources()["CPU"], time.time() + within_s
    free, since = free_cpus(), time.time()
    while free < total and time.time() - since < quiet_s and time.time() < deadline:
        time.sleep(0.2)
        if (now := free_cpus()) != free:
            free, since = now, time.time()
    return free


def stream_in_thread(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[threading.Thread, list]:
    """llm.stream(prompt) consumed on a thread of its own (its own event loop); result: [tokens] or [error]."""
    result: list = []

    async def consume():
        tokens = []
        async for delta in llm.stream(prompt_token_ids=prompt, sampling_params=params):
            tokens += delta.token_ids
        return tokens

    def run():
        try:
            result.append(asyncio.run(consume()))
        except BaseException as err:  # noqa: BLE001 - the test reads it
            result.append(err)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def wait_running(llm: LLM, within_s: float = 30.0) -> None:
    deadline = time.time() + within_s
    while llm.load.num_running == 0 and time.time() < deadline:
        time.sleep(0.02)
    assert llm.load.num_running > 0, "the request never ran"


def test_a_placement_group_that_fits_is_waited_for_fractional_seconds(ray_cluster):
    """pg.wait takes whole seconds: 0.9 s became 0, and a group that fits failed at once, said to be one no
    node could host."""
    pg = target_placement(Config(model="m", mode="ar", cluster="auto"), {}, 0.9)
    ray.util.remove_placement_group(pg)


@pytest.fixture(scope="module")
def slow_target(tmp_path_factory) -> str:
    """A target whose 240 sampled tokens take ~1.5 s here, not the pair's ~0.1 s: a request still in flight when
    the test shuts the engine down (with the pair's, a loaded CI box finished it first, and the test failed)."""
    path = tmp_path_factory.mktemp("slow_target") / "slow"
    save_model(path, llama_config(96, 384, 6), seed=3)
    return str(path)


def test_shutdown_fails_the_requests_in_flight_and_a_second_one_does_nothing(ray_cluster, slow_target, caplog,
                                                                             monkeypatch):
    """A stream running on another thread when the engine shuts down fails with EngineError, as on one host
    (it waited forever: its updates stopped with the poll thread, unless a poll in flight happened to catch
    rank 0's failing it). Calling shutdown again does nothing (it called the killed rank 0, logged a warning
    and killed every actor again); the engine then refuses work as shut down (a submit reported the target
    dead and advised LLM.rebuild()), and keeps its metrics."""
    before = settled_cpus()
    llm = ngram_llm({"target": slow_target}, max_model_len=256)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=240, ignore_eos=True)  # ~1 token a round
    thread, result = stream_in_thread(llm, PROMPTS[0], params)
    wait_running(llm)
    # Polls that never wait on rank 0: no poll in flight can catch the failures rank 0 sends as it stops (a
    # race the old code lost or won by luck; here it always loses it).
    monkeypatch.setattr(cluster, "POLL_S", 0.0)
    llm.shutdown()
    thread.join(timeout=20)
    assert not thread.is_alive(), "a stream in flight at shutdown waited forever"
    assert isinstance(result[0], EngineError) and "shut down" in str(result[0])
    with caplog.at_level(logging.DEBUG, logger="saguaro_dist.distributed.cluster"):
        start = time.monotonic()
        llm.shutdown()
        # The warnings checked below catch the old second shutdown; this, that it waits on nothing (5 s, not
        # 1: a loaded box can stall any step a second).
        assert time.monotonic() - start < 5.0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with pytest.raises(EngineError, match="shut down"):
        llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(EngineError, match="shut down"):
        llm.check_health()
    llm.abort("nothing")  # a no-op, no actor call
    assert llm.metrics.rounds > 0  # the last ones rank 0 had, as a one-host engine's stay readable
    assert wait_cpus(before) >= before, "actors or the placement group were left behind"


def test_a_dead_target_is_an_engine_error_caused_by_the_actor_death_everywhere(ray_cluster, pair):
    """Requests, metrics and reset_prefix_cache after rank 0 died raise the retriable EngineError with Ray's
    RayActorError as its cause (metrics and reset_prefix_cache raised the bare RayActorError, the requests'
    error dropped its cause: `from None`); shutdown then frees the rest without waiting on the dead."""
    before = settled_cpus()
    llm = ngram_llm(pair)
    rank0 = llm._thread.deployment.ranks[0]
    ray.kill(rank0, no_restart=True)
    wait_dead([rank0])
    with pytest.raises(EngineError) as metrics_err:
        _ = llm.metrics
    with pytest.raises(EngineError) as request_err:
        llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(EngineError) as reset_err:
        llm.reset_prefix_cache()
    for err in (metrics_err, request_err, reset_err):
        assert err.value.retriable
        assert isinstance(err.value.__cause__, ray.exceptions.RayActorError), repr(err.value.__cause__)
    start = time.monotonic()
    llm.shutdown()
    # A shutdown that waited on the dead rank 0 would run out its shutdown call's 30 s timeout; what it waits on
    # now is bounded by 15 s (the poll thread's join, wait_dead): 30 tells them apart on a loaded box.
    assert time.monotonic() - start < 30
    assert wait_cpus(before) >= before


def test_start_up_without_the_gpus_asked_for_fails_by_its_timeout_and_frees_everything(ray_cluster, pair, caplog):
    """A CUDA target and draft on a cluster without GPUs: a warning at once, then an error naming the target's
    bundle by startup_timeout_s. The draft actors, never placed, were asked to stop their gRPC servers
    anyway, which waited 10 s more for actors that could never answer."""
    before = settled_cpus()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.distributed.cluster"), \
            pytest.raises(RuntimeError, match=r"no node can host 1 target ranks with \{'GPU': 1\}"):
        LLM(model=pair["target"], draft=pair["close"], mode="ssd", k=3, cluster="auto", device="cuda",
            num_draft_workers=1, startup_timeout_s=3)
    elapsed = time.monotonic() - start
    assert "lacks {'GPU'" in caplog.text
    # The old stop of the never-placed drafts waited 10 s more (>= 13 s in all); 9 s over the timeout leaves a
    # loaded box room for the tokenizer, the pair check, the actors' start and their kill.
    assert elapsed < 3 + 9, f"start-up failed after {elapsed:.1f} s, startup_timeout_s is 3"
    assert wait_cpus(before) >= before
    assert not any(k.startswith("bundle_group") for k in ray.available_resources()), "the placement group was left"


def test_a_draft_that_cannot_load_fails_start_up_at_once_with_its_cause(ray_cluster, pair, tmp_path):
    """A draft whose config reads (the driver checks the pair) but whose weights cannot load: its actor's
    constructor raises. Start-up says which actors failed, with Ray's ActorDiedError (and the remote
    traceback) as the cause, well before startup_timeout_s, and frees what it took; it raised the bare
    ActorDiedError."""
    draft = tmp_path / "broken_draft"
    draft.mkdir()
    for f in Path(pair["close"]).iterdir():
        (draft / f.name).write_bytes(f.read_bytes())
    (draft / "model.safetensors").write_bytes(b"not a safetensors file")
    before = settled_cpus()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"1 draft worker\(s\) .*an actor died while starting") as err:
        LLM(model=pair["target"], draft=str(draft), mode="ssd", k=3, cluster="auto", num_draft_workers=1,
            startup_timeout_s=120)
    assert isinstance(err.value.__cause__, ray.exceptions.ActorDiedError)
    # The match above already rules out the timeout's error; this, a wait close to startup_timeout_s (Ray may
    # take a minute to start the actors on a loaded box).
    assert time.monotonic() - start < 110
    assert wait_cpus(before) >= before


@pytest.mark.slow
def test_a_draft_killed_mid_generation_costs_no_token_and_frees_its_cpu(ray_cluster, pair):
    """Target and draft actors run torch on one thread each (the 2-core box's pinning); ray.kill of a draft
    mid-generation: outputs identical to plain greedy decoding, its CPU back in the cluster while the
    engine runs on, and shutdown closes the survivor's gRPC port and frees the rest."""
    reference = [hf_greedy(pair["model"], p, LONG.max_tokens) for p in PROMPTS]
    before = settled_cpus()
    llm = LLM(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=12, cluster="auto",
              max_batch_size=4, num_draft_workers=2, draft_executor="process")
    try:
        remote = llm._thread
        actors = remote.deployment.ranks + remote.deployment.drafts
        assert ray.get([a.__ray_call__.remote(lambda _: __import__("torch").get_num_threads()) for a in actors]) == [1, 1, 1]
        survivor = ray.get(remote.deployment.drafts[1].address.remote())
        running = free_cpus()
        outputs: list = []
        worker = threading.Thread(target=lambda: outputs.extend(
            llm.generate(prompt_token_ids=PROMPTS, sampling_params=LONG, use_tqdm=False)))
        worker.start()
        deadline = time.time() + 60
        while llm.metrics.rounds < 3 and time.time() < deadline:
            time.sleep(0.01)
        ray.kill(remote.deployment.drafts[0], no_restart=True)
        worker.join(timeout=180)
        assert len(outputs) == len(PROMPTS), "generation did not complete after a draft worker died"
        for prompt, out, want in zip(PROMPTS, outputs, reference):
            assert_greedy_equal(out.token_ids, want, prompt, pair["model"])
        assert wait_cpus(running + 1) >= running + 1, "the dead draft actor's CPU was not freed"
        llm.check_health()
    finally:
        llm.shutdown()
    assert port_closed(survivor)
    assert wait_cpus(before) >= before


def run_script(script: str, *args, env=None, timeout=300) -> dict:
    env = {**os.environ, **(env or {})}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=HERE, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


TWO_ENGINES = r'''
import json, os, sys, threading, time
import ray
from saguaro_dist import LLM, SamplingParams
target, prompt = sys.argv[1], json.loads(sys.argv[2])
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
def engine():
    return LLM(model=target, mode="ngram", k=3, cluster="local", max_batch_size=2)
built = []
starter = threading.Thread(target=lambda: built.append(engine()))
starter.start()
starter.join()
first = built[0]  # started with RAY_ADDRESS set, on a thread that has ended since
time.sleep(1)  # a daemon tied to that thread gets its SIGKILL as the thread exits
dead = [kind for kind, _ in ray._private.worker._global_node.dead_processes()]
if dead:  # the rest would wait a minute on the gone GCS, and Ray would then end this process
    print(json.dumps({"dead_with_the_starting_thread": dead}))
    os._exit(0)
own_ray = {"started": first._thread.deployment.started_ray, "gcs": ray.get_runtime_context().gcs_address}
del os.environ["RAY_ADDRESS"]  # the rest as before: a Ray call's auto-init would start a fresh Ray, not join it
second = engine()
first.shutdown()
alive_after_first = ray.is_initialized()
tokens = second.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].token_ids
second.shutdown()
stopped_with_last = not ray.is_initialized()
second.shutdown()  # again: no Ray call (ray.kill, ray.get) that would start a fresh Ray
third = engine()
ray.shutdown()     # the user stops Ray under the engine
third.shutdown()
print(json.dumps({"own_ray": own_ray, "alive_after_first": alive_after_first, "tokens": tokens,
                  "stopped_with_last": stopped_with_last, "restarted": ray.is_initialized(),
                  "dead_with_the_starting_thread": dead}))
'''


@pytest.fixture(scope="module")
def engines_on_a_ray_of_their_own(pair) -> dict:
    """TWO_ENGINES run once (a Ray start costs ~10 s on the CI box) for the three tests below that read it."""
    return run_script(TWO_ENGINES, pair["target"], json.dumps(PROMPTS[0]), env={"RAY_ADDRESS": "127.0.0.1:1"})


def test_cluster_local_starts_a_ray_of_its_own_where_RAY_ADDRESS_is_set(engines_on_a_ray_of_their_own):
    """cluster="local" is an embedded Ray: with RAY_ADDRESS set (a KubeRay pod, a shell after `ray start`),
    ray.init without address="local" joined that cluster instead, and refused the num_cpus and system
    config it was given (a ValueError)."""
    result = engines_on_a_ray_of_their_own["own_ray"]
    assert result["started"] and not result["gcs"].endswith(":1")


def test_an_embedded_ray_outlives_the_thread_that_started_it(engines_on_a_ray_of_their_own):
    """TWO_ENGINES builds its first engine on a thread that ends at once. Ray's daemons die with the thread
    that started them (PR_SET_PDEATHSIG follows the thread): its GCS and raylet were SIGKILLed as the thread
    ended, the second engine's actors then waited a minute on the gone GCS, and Ray ended the process.
    cluster="local" starts Ray from a thread that lasts (deployment._LastingThread)."""
    assert engines_on_a_ray_of_their_own["dead_with_the_starting_thread"] == []


def test_the_lasting_thread_runs_calls_off_the_main_thread_on_one_thread_that_outlives_their_callers():
    """What cluster="local" starts Ray on (above): inline on the main thread; from other threads, on one thread
    that outlives them, errors raised to the caller; in a child forked since, on a new thread (the parent's
    did not survive the fork: a call queued for it waited forever)."""
    lasting = _LastingThread()
    where = lambda: threading.get_ident()
    assert lasting.run(where) == threading.get_ident()
    seen, errors = [], []

    def caller():
        seen.append(lasting.run(where))
        try:
            lasting.run(lambda: {}["missing"])
        except KeyError as err:
            errors.append(err)
    for _ in range(2):
        thread = threading.Thread(target=caller)
        thread.start()
        thread.join()
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident() and len(errors) == 2
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if a call from a thread returns within 10 s
        answers = []
        thread = threading.Thread(target=lambda: answers.append(lasting.run(lambda: 7)), daemon=True)
        thread.start()
        thread.join(10)
        os._exit(0 if answers == [7] else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.slow
def test_engines_sharing_the_ray_one_started_stop_it_with_the_last(pair, engines_on_a_ray_of_their_own):
    """Two cluster="local" engines of one process share the Ray the first started: the first one's shutdown
    stopped that Ray, and the second engine with it. Shutting down again, or after the user's ray.shutdown(),
    made Ray calls that started a fresh Ray of Ray's defaults (auto-init), and raised."""
    result = engines_on_a_ray_of_their_own
    assert result["alive_after_first"], "the first engine's shutdown stopped the Ray the second runs on"
    assert result["tokens"] == hf_greedy(pair["model"], PROMPTS[0], 8)
    assert result["stopped_with_last"]
    assert not result["restarted"], "a shutdown after Ray stopped started a fresh Ray"
