"""The Ray runtime's resources and connections (saguaro_dist/distributed/placement.py, actors.py, cluster.py): a
CPU actor reserves a CPU per torch thread, the tensor-parallel store holds its port from the rendezvous on, and a
Ray connection the engines opened is closed by the last of them. Real Ray actors (the session's local Ray), a
real gloo group, tiny checkpoints written by transformers."""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from engine_helpers import PROMPTS, close_pair, hf_greedy
from saguaro_dist import LLM
from saguaro_dist.config import Config
from saguaro_dist.distributed.actors import TargetRank
from saguaro_dist.distributed.placement import draft_options, engine_needs, target_bundle

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("h3_pair"))


def free_cpus() -> float:
    return ray.available_resources().get("CPU", 0)


def wait_cpus(condition, within_s: float = 30.0) -> float:
    """Free CPUs once they meet condition (Ray frees and takes them asynchronously)."""
    deadline = time.time() + within_s
    while not condition(free_cpus()) and time.time() < deadline:
        time.sleep(0.1)
    return free_cpus()


# ---- CPUs per torch thread ----------------------------------------------------------------------

def test_a_cpu_actor_asks_ray_for_a_cpu_per_torch_thread():
    """A target rank on 4 torch threads asked Ray for 1 CPU, and Ray packed other actors onto its cores."""
    config = Config(model="m", draft="d", cluster="auto", tensor_parallel_size=2, num_draft_workers=2,
                    target_threads=3, draft_threads=2)
    assert target_bundle(config, {}) == {"CPU": 3}
    assert (draft_options(config, {})["num_cpus"], draft_options(config, {})["num_gpus"]) == (2, 0)
    assert engine_needs(config, {}) == {"CPU": 2 * 3 + 2 * 2}
    unset = Config(model="m", draft="d", cluster="auto")  # None: the actor runs 1 thread (actors.py), asks 1 CPU
    assert target_bundle(unset, {}) == {"CPU": 1} and draft_options(unset, {})["num_cpus"] == 1


def test_a_gpu_actor_asks_for_its_gpu_alone_and_a_cpu_draft_beside_it_for_its_threads():
    config = Config(model="m", draft="d", cluster="auto", device="cuda", draft_device="cpu", target_threads=4,
                    draft_threads=2)
    assert target_bundle(config, {}) == {"GPU": 1}
    assert (draft_options(config, {})["num_cpus"], draft_options(config, {})["num_gpus"]) == (2, 0)
    on_gpu = Config(model="m", draft="d", cluster="auto", device="cuda", draft_threads=2)
    assert (draft_options(on_gpu, {})["num_cpus"], draft_options(on_gpu, {})["num_gpus"]) == (0, 1)


def test_an_embedded_ray_has_room_for_every_thread_of_the_engine():
    """cluster="local" sized its Ray by actor count (tp + drafts + 1): a rank on more threads than that
    never got placed on a small host."""
    from saguaro_dist.distributed.placement import local_cpus_needed
    config = Config(model="m", draft="d", cluster="local", tensor_parallel_size=2, num_draft_workers=1,
                    target_threads=4, draft_threads=2)
    assert local_cpus_needed(config) == 2 * 4 + 2 + 1
    assert local_cpus_needed(Config(model="m", mode="ngram", cluster="local")) == 2


def test_a_rank_on_two_threads_holds_two_cpus_and_runs_two_threads(ray_cluster, pair):
    before = free_cpus()
    llm = LLM(model=pair["target"], mode="ngram", k=3, cluster="auto", max_batch_size=2, target_threads=2)
    try:
        # What Ray reserved and gave the rank, not the free count: an earlier file's killed actors may free CPUs
        # meanwhile, and `before` - 2 was then never seen.
        bundles = ray.util.placement_group_table(llm._thread.deployment.placement_group)["bundles"]
        assert list(bundles.values()) == [{"CPU": 2.0}]
        rank0 = llm._thread.deployment.ranks[0]
        held = ray.get(rank0.__ray_call__.remote(lambda rank: ray.get_runtime_context().get_assigned_resources()))
        assert held == {"CPU": 2.0}
        assert ray.get(rank0.__ray_call__.remote(lambda rank: torch.get_num_threads())) == 2
    finally:
        llm.shutdown()
    assert wait_cpus(lambda free: free >= before) >= before


# ---- the tensor-parallel rendezvous ---------------------------------------------------------------

def test_the_rendezvous_holds_its_port_until_the_group_forms(ray_cluster):
    """Rank 0 found a free port by binding and closing a socket, and every rank's init_process_group bound it
    again later: another process could take it in between. The port stays taken from the rendezvous on, and
    the ranks form their group on it."""
    def join_and_sum(rank: TargetRank, master) -> float:  # (nested: Ray pickles it by value, not by module)
        """In the actor: join the group as setup does, and all-reduce the rank's number (+ 1)."""
        group = rank._join_group(master)
        value = torch.tensor([rank.rank + 1.0])
        torch.distributed.all_reduce(value, group=group)
        return value.item()

    config = Config(model="m", mode="ngram", cluster="auto", tensor_parallel_size=2)
    actor = ray.remote(TargetRank).options(num_cpus=0, max_concurrency=2)
    ranks = [actor.remote(config, r) for r in range(2)]
    try:
        master = ray.get(ranks[0].rendezvous.remote())
        with socket.socket() as intruder, pytest.raises(OSError) as taken:
            intruder.bind(("", master[1]))
        assert taken.value.errno == errno.EADDRINUSE
        assert ray.get([r.__ray_call__.remote(join_and_sum, master) for r in ranks], timeout=120) == [3.0, 3.0]
        # One rank: no group, no port held. Asked of a TargetRank made in rank 1's process: an actor of its own
        # would cost a process start (torch imported) for a call that returns at once.
        one = Config(model="m", mode="ngram", cluster="auto")
        assert ray.get(ranks[1].__ray_call__.remote(lambda _: TargetRank(one, 0).rendezvous())) is None
    finally:
        for r in ranks:
            ray.kill(r, no_restart=True)


# ---- the Ray connection an engine opened ---------------------------------------------------------

JOINS = r'''
import json, sys
import ray
from saguaro_dist import LLM, SamplingParams
target, prompt = sys.argv[1], json.loads(sys.argv[2])
def engine():
    return LLM(model=target, mode="ngram", k=3, cluster="auto", max_batch_size=2)
first, second = engine(), engine()
first.shutdown()
after_first = ray.is_initialized()
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
tokens = second.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].token_ids
second.shutdown()
after_last = ray.is_initialized()
if after_last:
    ray.shutdown()  # (left connected: the test fails on after_last; close it to go on)
ray.init(address="auto", log_to_driver=False)  # the user's own connection: the engine's shutdown leaves it
users_job = ray.get_runtime_context().get_job_id()
third = engine()
third.shutdown()
users_kept = ray.is_initialized() and ray.get_runtime_context().get_job_id() == users_job
ray.shutdown()
print(json.dumps({"after_first": after_first, "tokens": tokens, "after_last": after_last, "users_kept": users_kept}))
'''


@pytest.mark.slow
def test_engines_that_joined_a_cluster_disconnect_with_the_last_and_leave_a_users_connection(ray_cluster, pair):
    """cluster="auto" joined a Ray with ray.init and shutdown never disconnected: the process stayed a driver
    of that cluster after its engines stopped. Now the connection the engines opened closes with the last of
    them (the cluster runs on), as a Ray of their own does; one the user opened before stays open. The
    process joins the session's Ray through RAY_ADDRESS, as a pod or a shell after `ray start` would."""
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    done = subprocess.run([sys.executable, "-c", JOINS, pair["target"], json.dumps(PROMPTS[0])], capture_output=True,
                          text=True, timeout=600, cwd=HERE, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["after_first"], "the first engine's shutdown closed the connection the second runs on"
    assert result["tokens"] == hf_greedy(pair["model"], PROMPTS[0], 8)
    assert not result["after_last"], "the process stayed connected to the cluster after its last engine stopped"
    assert result["users_kept"], "the engine closed a connection the user opened"
    assert ray.is_initialized() and ray.cluster_resources().get("CPU", 0) > 0  # the cluster itself runs on
