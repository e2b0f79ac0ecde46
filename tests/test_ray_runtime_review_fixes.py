"""The Ray runtime, reviewed: a ray.shutdown() under a running engine fails its requests (the poll thread died
silently, and every generate() in flight hung), LLM.rebuild() no longer warns of a shortfall its own old actors
made, and a tensor-parallel size that does not divide the heads fails before Ray starts anything. Real Ray
(each script's own small local Ray: a ray.shutdown() must not take the session's down), tiny checkpoints
written by transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from engine_helpers import close_pair, llama_config, save_model
from saguaro_dist import LLM

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("f6_pair")
    found = close_pair(root)
    save_model(root / "slow", llama_config(96, 384, 6), seed=3)  # its rounds take long enough to be caught mid-run
    return {**found, "slow": str(root / "slow")}


def run_script(script: str, *args, timeout=300) -> dict:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=HERE, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# A generate() on another thread, caught mid-run (its third round): what each script then shuts down under.
GENERATING = r'''
from saguaro_dist import LLM, SamplingParams
target, draft = sys.argv[1], sys.argv[2]
ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
llm = LLM(model=target, draft=draft, mode="ssd", k=3, cluster="auto", num_draft_workers=1, max_model_len=256)
params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
result = {}
def generate():
    try:
        result["out"] = llm.generate(prompt_token_ids=[[1, 2, 3]] * 3, sampling_params=params, use_tqdm=False)
    except BaseException as err:
        result["error"] = f"{type(err).__name__}: {err}"
worker = threading.Thread(target=generate, daemon=True)
worker.start()
while llm.metrics.rounds < 3:
    time.sleep(0.01)
'''

RAY_DOWN = r'''
import json, sys, threading, time
import ray
''' + GENERATING + r'''
ray.shutdown()
worker.join(timeout=60)  # only to tell a hang: it ends as soon as the poll thread sees Ray gone
try:
    llm.check_health()
    health = None
except Exception as err:
    health = f"{type(err).__name__}: {err}"
hung = worker.is_alive()
llm.shutdown()
print(json.dumps({"hung": hung, "error": result.get("error"), "finished": "out" in result, "health": health}))
'''


@pytest.mark.slow
def test_ray_shut_down_under_a_running_generate_fails_it_naming_that(pair):
    """ray.shutdown() on another thread ends the poll thread's blocked ray.get with SystemExit, which it did
    not catch: the thread died, and generate() waited until llm.shutdown()."""
    result = run_script(RAY_DOWN, pair["slow"], pair["close"])
    assert not result["hung"], "generate() hung after Ray was shut down under the engine"
    assert not result["finished"], "generation ended before Ray was shut down: nothing was tested"
    assert result["error"].startswith("EngineError: Ray was shut down under the engine"), result["error"]
    assert result["health"].startswith("EngineError") and "Ray was shut down" in result["health"], result["health"]


RAY_DOWN_AFTER_A_POLL = r"""
import json, sys, threading, time
import ray
real_wait = ray.wait
shut_down_now, ray_down, ray_up_again = threading.Event(), threading.Event(), threading.Event()
def wait_then_shut_down(refs, *args, **kwargs):
    # Ray goes down on the user's side just after a poll came back and before the poll thread fetched it: the
    # window a CI run hit by chance, opened each time (patched before saguaro_dist is imported, as its Ray calls
    # are bound then).
    ready, rest = real_wait(refs, *args, **kwargs)
    if ready and shut_down_now.is_set() and threading.current_thread().name == "saguaro-remote-poll":
        shut_down_now.clear()
        ray.shutdown()
        ray_down.set()
        if sys.argv[3] == "reinit":  # the fetch waits for the user's fresh Ray (started on the main thread)
            ray_up_again.wait(timeout=60)
    return ready, rest
ray.wait = wait_then_shut_down
""" + GENERATING + r"""
shut_down_now.set()
if sys.argv[3] == "reinit":
    # The user starts a Ray again at once: a fresh Ray, its first job's id ours. Started here, not on the poll
    # thread: Ray's daemons die with the thread that started them (PR_SET_PDEATHSIG), and the exit then waited
    # out Ray's 60 s GCS request timeout on the dead GCS.
    ray_down.wait(timeout=60)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    ray_up_again.set()
worker.join(timeout=60)
fresh_ray = ray.is_initialized() and sys.argv[3] != "reinit"
llm.shutdown()
print(json.dumps({"hung": worker.is_alive(), "error": result.get("error"), "fresh_ray": fresh_ray}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("then", ["nothing", "reinit"])
def test_ray_shut_down_between_a_poll_and_its_fetch_starts_no_fresh_ray(pair, then):
    """The poll thread's ray.get of a poll that came back just before ray.shutdown() auto-started a fresh, empty
    Ray: the fetch failed "owner unknown", the request was failed as a polling error, and the process died a
    minute later waiting for that Ray's GCS (session 85's CI). Ray calls of the engine never start a Ray now.
    reinit: the user starts Ray again at once; that Ray's first job has the engine's job id, which alone took it
    for the engine's Ray (the failure was named "target actor died")."""
    result = run_script(RAY_DOWN_AFTER_A_POLL, pair["slow"], pair["close"], then)
    assert not result["hung"], "generate() hung after Ray was shut down under the engine"
    assert not result["fresh_ray"], "a Ray call of the engine started a fresh Ray after ray.shutdown()"
    assert result["error"].startswith("EngineError: Ray was shut down under the engine"), result["error"]

RAY_DOWN_BEFORE_AN_ACTOR_CALL = r"""
import json, sys, threading, time
import ray
from ray.actor import ActorMethod
shut_down_now = threading.Event()
def shutting_down_first(actor_call):
    # Ray goes down on the user's side just before the poll thread's next actor call, ahead of Ray's auto-init
    # as the race lands: patched on Ray's decorated call and on the call under it (what ray_calls.call makes).
    def call(method, *args, **kwargs):
        if shut_down_now.is_set() and threading.current_thread().name == "saguaro-remote-poll":
            shut_down_now.clear()
            ray.shutdown()
        return actor_call(method, *args, **kwargs)
    return call
real_remote = ActorMethod._remote
ActorMethod._remote = shutting_down_first(real_remote)
ActorMethod._remote.__wrapped__ = shutting_down_first(real_remote.__wrapped__)
""" + GENERATING + r"""
shut_down_now.set()
worker.join(timeout=60)
fresh_ray = ray.is_initialized()
llm.shutdown()
print(json.dumps({"hung": worker.is_alive(), "error": result.get("error"), "fresh_ray": fresh_ray,
                  "shut_down": not shut_down_now.is_set()}))
"""


@pytest.mark.slow
def test_ray_shut_down_right_before_an_actor_call_of_the_engine_starts_no_fresh_ray(pair):
    """An actor call (handle.method.remote) goes through Ray's auto-init as ray.get does: the poll thread's next
    poll, made as the user's ray.shutdown() landed, started a fresh, empty Ray where rank 0 is not. The engine's
    actor calls after start-up never start a Ray now; the request fails naming the shutdown."""
    result = run_script(RAY_DOWN_BEFORE_AN_ACTOR_CALL, pair["slow"], pair["close"])
    assert result["shut_down"], "the poll thread made no actor call after the shutdown was armed: nothing was tested"
    assert not result["hung"], "generate() hung after Ray was shut down under the engine"
    assert not result["fresh_ray"], "an actor call of the engine started a fresh Ray after ray.shutdown()"
    assert result["error"].startswith("EngineError: Ray was shut down under the engine"), result["error"]

REBUILD = r'''
import json, logging, sys
import ray
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.distributed import deployment
from saguaro_dist.distributed.deployment import warn_if_short
target, draft = sys.argv[1], sys.argv[2]
warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("saguaro_dist.distributed").addHandler(Keep(logging.WARNING))
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
llm = LLM(model=target, draft=draft, mode="ssd", k=3, cluster="auto", num_draft_workers=1, max_model_len=256)
llm.rebuild()  # its old actors' CPUs come back only a moment after ray.kill: what warned
params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
tokens = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)[0].token_ids
after_rebuilds = list(warnings)
deployment.FREED_RESOURCES_WAIT_S = 0.3  # the CPUs stay held (by this engine): any wait ends in the warning
warn_if_short(llm.config, ray.cluster_resources())  # a second engine beside this one: it does lack them
llm.shutdown()
ray.shutdown()
print(json.dumps({"after_rebuilds": after_rebuilds, "beside": warnings[len(after_rebuilds):], "tokens": tokens}))
'''


@pytest.mark.slow
def test_rebuild_on_a_cluster_the_engine_fills_warns_of_no_shortfall(pair):
    """Ray gives a killed actor's resources back a moment after ray.kill: every LLM.rebuild() on a cluster
    the engine fills logged "the cluster lacks {'CPU': 2} free", then started at once. A real shortfall (the
    engine's CPUs held by another) is still told."""
    result = run_script(REBUILD, pair["target"], pair["close"])
    assert len(result["tokens"]) == 5
    assert not [w for w in result["after_rebuilds"] if "lacks" in w], result["after_rebuilds"]
    assert any("the cluster lacks {'CPU'" in w for w in result["beside"]), result["beside"]


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_fails_before_ray_starts(pair):
    """TP = 3 on a model of 4 heads (2 KV heads): start-up failed ~9 s in, as the ranks built the model, with a
    RayTaskError and a remote traceback. vLLM checks the heads up front; so does the driver now, from
    config.json, before it connects to Ray or starts an actor."""
    ray_was_up = ray.is_initialized()
    with pytest.raises(ValueError, match=r"tensor_parallel_size = 3 must divide the model's attention heads "
                                         r"\(num_attention_heads = 4, num_key_value_heads = 2 in "):
        LLM(model=pair["target"], mode="ar", cluster="local", tensor_parallel_size=3, max_model_len=256)
    assert ray.is_initialized() == ray_was_up
    # (TP = 4 on its 2 KV heads is no longer refused: each is replicated on 2 ranks; test_model_tp_kv_replicas.py)
