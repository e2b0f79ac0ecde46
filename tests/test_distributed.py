"""The distributed runtime on a real local Ray cluster, drafts over real gRPC on loopback."""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import ray

from engine_helpers import (BIAS, PENALTIES, PROMPTS, assert_greedy_equal, biased_reference, check_logprobs, close_pair,
                            hf_greedy, port_closed)
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config, Mode
from saguaro_dist.distributed.actors import ask_actor
from saguaro_dist.distributed import cluster
from saguaro_dist.distributed.cluster import wait_dead
from saguaro_dist.distributed.draft_pool import LATE_TREE_WAITS_BEFORE_DEAD
from saguaro_dist.distributed.placement import engine_needs, shortfall
from saguaro_dist.engine.loop_thread import EngineError
from saguaro_dist.placement import DRAFT_RESOURCE, TARGET_RESOURCE

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Long enough to be cut by a kill, a stall or a crash three rounds in: at 60 tokens a generation took ~0.5 s, and
# on a loaded box the test thread's kill could land after it had ended (no fallback, the test failed).
LONG = replace(GREEDY, max_tokens=200)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pair = close_pair(tmp_path_factory.mktemp("dist_pair"))
    pair["draft"] = pair["close"]
    pair["reference"] = [hf_greedy(pair["model"], p, GREEDY.max_tokens) for p in PROMPTS]
    return pair


@pytest.fixture(scope="module")
def long_reference(pair):
    """The target's greedy LONG.max_tokens after each prompt (the kill, stall and crash tests' requests)."""
    return [hf_greedy(pair["model"], p, LONG.max_tokens) for p in PROMPTS]


def cluster_llm(pair, **kwargs) -> LLM:
    settings = dict(mode="ssd", k=3, fan_out=12, cluster="auto", max_batch_size=4, num_draft_workers=2) | kwargs
    return LLM(model=pair["target"], draft=pair["draft"], **settings)


def check_greedy(pair, outputs):
    for prompt, out, want in zip(PROMPTS, outputs, pair["reference"]):
        assert_greedy_equal(out.token_ids, want, prompt, pair["model"])


def wait_idle_load(llm: LLM, within_s: float = 10.0):
    """The engine's load once it shows nothing running (a poll may carry the snapshot of the step before)."""
    deadline = time.time() + within_s
    while (llm.load.num_running or llm.load.kv_cache_tokens) and time.time() < deadline:
        time.sleep(0.05)
    load = llm.load
    assert (load.num_running, load.num_waiting, load.kv_cache_tokens) == (0, 0, 0)
    return load


def wait_for_load(llm: LLM, condition, within_s: float = 10.0) -> bool:
    """Whether the engine's load (as of its last poll) meets condition within within_s."""
    deadline = time.time() + within_s
    while not condition(llm.load) and time.time() < deadline:
        time.sleep(0.05)
    return condition(llm.load)


def test_tp2_with_two_drafts_is_exact_and_shuts_down_clean(ray_cluster, pair):
    before = ray.available_resources().get("CPU")
    llm = cluster_llm(pair, tensor_parallel_size=2)
    remote = llm._thread
    addresses = ray.get([d.address.remote() for d in remote.deployment.drafts])
    if sys.platform == "linux":  # one node: rank 0 dials the drafts' local sockets, not TCP
        assert all(a.startswith("unix-abstract:") for a in remote.draft_addresses), remote.draft_addresses
    check_greedy(pair, llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
    assert llm.metrics.cache_hits > 0
    assert wait_idle_load(llm).kv_cache_capacity_tokens >= 4 * llm.max_model_len  # rank 0's, through its polls
    # Logit bias, allowed tokens and penalties: the drafts are told over gRPC, the sharded target
    # verifies with them.
    constrained = replace(GREEDY, **BIAS, **PENALTIES)
    for prompt, out in zip(PROMPTS, llm.generate(prompt_token_ids=PROMPTS, sampling_params=constrained)):
        want, adjust = biased_reference(pair["model"], prompt, GREEDY.max_tokens, penalties=True)
        assert_greedy_equal(out.token_ids, want, prompt, pair["model"], adjust=adjust)
    # Prefix caching on the sharded target (every rank renames and copies the same rows) and the drafts:
    # a repeated long prompt, then a next turn holding its reply, reuse what they hold and stay exact.
    long = PROMPTS[2] * 3
    first = llm.generate(prompt_token_ids=[long], sampling_params=GREEDY)[0]
    held = len(long) + len(first.token_ids)  # the last token is in the KV only if a round ran past max_tokens
    for prompt, reused in ((long, {len(long) - 1}), (long + first.token_ids + [5], {held - 1, held})):
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
        assert_greedy_equal(out.token_ids, hf_greedy(pair["model"], prompt, GREEDY.max_tokens), prompt, pair["model"])
        assert out.metrics.num_cached_tokens in reused
    # Log-probabilities from the sharded target's gathered logits, carried back by the Ray updates.
    params = replace(GREEDY, max_tokens=8, logprobs=2, prompt_logprobs=0)
    scored = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params)
    for prompt, out in zip(PROMPTS, scored):
        check_logprobs(pair["model"], prompt, out, 2)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    actors = remote.deployment.ranks + remote.deployment.drafts
    # Each actor froze its startup heap once its model loaded (engine/heap.py): rank 0, rank 1, the drafts.
    assert all(n > 10_000 for n in ray.get([a.__ray_call__.remote(lambda _: gc.get_freeze_count()) for a in actors]))
    llm.shutdown()
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.node_id.remote(), timeout=30)
    assert all(port_closed(a) for a in addresses)
    deadline = time.time() + 30
    while ray.available_resources().get("CPU") != before and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == before, "actors or placement groups were left behind"


def test_ngram_on_ray_matches_ar_and_starts_no_draft_actor(ray_cluster, pair):
    with LLM(model=pair["target"], mode="ngram", k=3, cluster="auto", max_batch_size=4) as llm:
        check_greedy(pair, llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
        assert llm._thread.deployment.drafts == [] and llm.metrics.accepted_tokens > 0


@pytest.fixture(scope="module")
def one_draft_llm(ray_cluster, pair):
    """One engine (rank 0 and a draft actor: two actor start-ups, each importing torch) for the test of
    concurrent calls, then the test that kills its target and rebuilds it (and shuts it down)."""
    llm = cluster_llm(pair, num_draft_workers=1)
    yield llm
    llm.shutdown()  # (a second shutdown does nothing)


def test_concurrent_generate_calls_share_the_engine(one_draft_llm, pair, monkeypatch):
    llm = one_draft_llm
    results = [None] * len(PROMPTS)

    def one(i):
        results[i] = llm.generate(prompt_token_ids=[PROMPTS[i]], sampling_params=GREEDY)[0]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    check_greedy(pair, results)
    # what ended a request crosses from the target actor too (vLLM's stop_reason)
    tokens = results[0].token_ids
    stopped = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=replace(GREEDY, stop_token_ids=[tokens[2]]))[0]
    assert stopped.stop_reason == tokens[2] and stopped.token_ids == tokens[:tokens.index(tokens[2]) + 1]
    # a prefix-cache reset goes through rank 0's engine thread and the draft server's stream
    long = [PROMPTS[2] * 2]  # over the prefix cache's 16-token minimum
    first = llm.generate(prompt_token_ids=long, sampling_params=GREEDY)[0]
    assert llm.generate(prompt_token_ids=long, sampling_params=GREEDY)[0].metrics.num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    cold = llm.generate(prompt_token_ids=long, sampling_params=GREEDY)[0]
    assert cold.metrics.num_cached_tokens == 0 and cold.token_ids == first.token_ids
    asyncio.run(abandon_a_stream(llm))
    asyncio.run(asyncio.wait_for(check_streams(llm, pair), 60))
    interrupt_a_submit(llm, monkeypatch)


def interrupt_a_submit(llm: LLM, monkeypatch) -> None:
    """Ctrl-C in generate() while its submit call to rank 0 is in flight (the interrupt lands in the driver's
    wait for it): the aborts go once the call has landed, in one call, so none overtakes its request on
    the threaded actor and leaves it running on."""
    remote, calls, aborts = llm._thread, [], []

    def interrupted(call) -> None:
        calls.append(call)
        raise KeyboardInterrupt
    real_abort = remote.abort_many

    def abort_many(request_ids: list[str]) -> None:
        aborts.append((len(request_ids), bool(ray.wait(calls, timeout=0)[0])))
        real_abort(request_ids)
    monkeypatch.setattr(remote, "_wait_submitted", interrupted)
    monkeypatch.setattr(remote, "abort_many", abort_many)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_token_ids=PROMPTS * 2, sampling_params=replace(GREEDY, max_tokens=200), use_tqdm=False)
    assert aborts == [(2 * len(PROMPTS), True)]  # every request, in one call, after the submit had landed
    monkeypatch.undo()
    wait_idle_load(llm)
    wait_unregistered(llm)


def wait_unregistered(llm: LLM, within_s: float = 10.0) -> None:
    """Nothing registered on the driver: each aborted request's last update unregisters it, and rank 0 may
    publish its idle load before that update reaches the driver."""
    deadline = time.time() + within_s
    while llm._thread._requests and time.time() < deadline:
        time.sleep(0.05)
    assert not llm._thread._requests


async def abandon_a_stream(llm: LLM) -> None:
    """A stream whose event loop closes under its running request: the updates still due to it fail to
    reach it (once they killed the driver's poll thread, and every later request waited forever)."""
    abandoned = llm.stream(prompt_token_ids=PROMPTS[0], sampling_params=replace(GREEDY, max_tokens=200))
    assert (await anext(abandoned)).token_ids


async def check_streams(llm: LLM, pair) -> None:
    """LLM.stream on Ray (its submit awaited, not blocking the loop): concurrent streams give the greedy
    tokens; one closed after its first delta and one cancelled while its submit is in flight are aborted
    on rank 0 (the abort sent once the submit is done), and the engine ends idle with nothing registered."""
    async def tokens(prompt: list[int]) -> list[int]:
        return [t async for d in llm.stream(prompt_token_ids=prompt, sampling_params=GREEDY) for t in d.token_ids]
    got = await asyncio.gather(*(tokens(p) for p in PROMPTS))
    for prompt, out, want in zip(PROMPTS, got, pair["reference"]):
        assert_greedy_equal(out, want, prompt, pair["model"])
    endless = replace(GREEDY, max_tokens=200)
    closed = llm.stream(prompt_token_ids=PROMPTS[0], sampling_params=endless)
    assert (await anext(closed)).token_ids
    await closed.aclose()
    cancelled = asyncio.ensure_future(anext(llm.stream(prompt_token_ids=PROMPTS[1], sampling_params=endless)))
    await asyncio.sleep(0)  # its submit call is on its way to rank 0
    cancelled.cancel()
    await asyncio.sleep(0.5)
    wait_idle_load(llm)
    wait_unregistered(llm)


def test_a_dead_target_fails_requests_retriably_and_rebuilds(one_draft_llm, pair, monkeypatch):
    llm = one_draft_llm  # (idle, or fresh where this test runs alone: its target is killed first thing)
    try:
        ray.kill(llm._thread.deployment.ranks[0], no_restart=True)
        with pytest.raises(EngineError) as err:
            llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY)
        assert err.value.retriable
        with pytest.raises(EngineError, match="target is gone"):
            llm.check_health()  # what a serving replica reports to Ray Serve, which then replaces it
        llm.rebuild()
        llm.check_health()
        check_greedy(pair, llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
        fail_a_poll(llm, monkeypatch)
    finally:
        llm.shutdown()


def fail_a_poll(llm: LLM, monkeypatch) -> None:
    """A poll of rank 0 that fails with its actor alive (here rank 0 refuses a negative timeout) fails the
    requests in flight retriably, as the actor's death does; it once ended the poll thread in silence,
    and every request waited forever."""
    failed: list[BaseException] = []

    def generate() -> None:  # 8 waves of max_batch_size: a fast box had finished one wave before the next poll
        try:
            llm.generate(prompt_token_ids=PROMPTS * 8, sampling_params=replace(GREEDY, max_tokens=200), use_tqdm=False)
        except EngineError as err:
            failed.append(err)
    worker = threading.Thread(target=generate)
    worker.start()
    assert wait_for_load(llm, lambda load: load.num_running > 0)
    monkeypatch.setattr(cluster, "POLL_S", -1.0)
    worker.join(timeout=60)
    assert not worker.is_alive() and len(failed) == 1 and failed[0].retriable
    assert "polling the target failed" in str(failed[0])
    with pytest.raises(EngineError, match="polling the target failed"):
        llm.check_health()


def generate_through_a_kill(llm: LLM, params: SamplingParams, kill) -> list:
    """generate(PROMPTS), kill() called once three rounds of it have run; every output, checked to be there."""
    outputs, rounds = [], llm.metrics.rounds  # (the engine may have run rounds before: the stall, then the crash)
    worker = threading.Thread(target=lambda: outputs.extend(llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)))
    worker.start()
    deadline = time.time() + 60
    while llm.metrics.rounds < rounds + 3 and time.time() < deadline:
        time.sleep(0.01)
    kill()
    worker.join(timeout=180)
    assert len(outputs) == len(PROMPTS), "generation did not complete after a draft worker died"
    return outputs


@pytest.mark.parametrize("executor", ["split", "process"])
def test_killing_a_draft_worker_costs_speed_never_tokens(ray_cluster, pair, long_reference, executor):
    with cluster_llm(pair, num_draft_workers=2, draft_executor=executor) as llm:
        outputs = generate_through_a_kill(llm, LONG, lambda: ray.kill(llm._thread.deployment.drafts[0], no_restart=True))
        for prompt, out, want in zip(PROMPTS, outputs, long_reference):
            assert_greedy_equal(out.token_ids, want, prompt, pair["model"])
        assert sum(llm.metrics.fallbacks.values()) > 0
        # the pool recovered: the survivor serves the re-prefilled sequences, hits come back
        again = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        check_greedy(pair, again)


def wait_for_trees_again(llm: LLM, pair, within_s: float) -> None:
    """Greedy generations (each checked exact) until one hits the speculation cache: the pool's worker is
    back; then the engine's load shows it live."""
    deadline = time.time() + within_s
    while True:
        hits = llm.metrics.cache_hits
        check_greedy(pair, llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
        if llm.metrics.cache_hits > hits:
            break
        assert time.time() < deadline, "no tree came back from the draft actor"
        time.sleep(0.2)
    # the gauge follows the engine's periodic load poll: 30 s, not 10 (it ran out once on a loaded box)
    assert wait_for_load(llm, lambda load: (load.draft_workers_live, load.draft_workers) == (1, 1), within_s=30.0)


@pytest.mark.parametrize("executor", ["split", "process"])
def test_a_stalled_then_restarted_draft_actor_is_taken_back_each_time(ray_cluster, pair, long_reference, executor):
    """The only draft actor stalls, then crashes and is restarted by Ray, in one engine (one start-up for both):
    generation stays exact through each, and each time the pool takes the actor back, so trees come back."""
    with cluster_llm(pair, num_draft_workers=1, draft_executor=executor, tree_policy="always",
                     draft_deadline_s=0.5, tree_timeout_s=0.5) as llm:
        stall_and_resume(llm, pair, long_reference, executor)
        crash_and_restart(llm, pair, long_reference)


def stall_and_resume(llm: LLM, pair, reference, executor: str) -> None:
    """The only draft actor's process stops for seconds (SIGSTOP: a real stall, as a long GC pause or
    an overloaded node): its drafts miss draft_deadline_s (process), or its trees tree_timeout_s twice in a
    row (split: the drafts are made beside the target), the pool takes it for dead and generation goes on
    exactly. Once it runs again it answers at its old address, still holding its old sequences; the pool
    releases them there and takes it back, so trees come back."""
    draft = llm._thread.deployment.drafts[0]
    pid, before = ray.get(draft.pid.remote()), ray.get(draft.endpoint.remote())
    late_trees: list[int] = []  # as the stall starts and as it ends

    def cont():
        try:
            late_trees.append(llm.metrics.late_trees)
        finally:
            os.kill(pid, signal.SIGCONT)
    resume = threading.Timer(3.0, cont)

    def stall():
        late_trees.append(llm.metrics.late_trees)
        os.kill(pid, signal.SIGSTOP)
        resume.start()
    try:
        outputs = generate_through_a_kill(llm, LONG, stall)
    finally:
        resume.join()
    for prompt, out, want in zip(PROMPTS, outputs, reference):
        assert_greedy_equal(out.token_ids, want, prompt, pair["model"])
    assert sum(llm.metrics.fallbacks.values()) > 0
    if executor == "split":  # marked dead after two late waits, not waited for again all through the 3 s stall
        # Counted over the stall alone: on a loaded box a tree can be late before it, or once the actor is back.
        stalled_late = late_trees[1] - late_trees[0]
        assert 0 < stalled_late <= (LATE_TREE_WAITS_BEFORE_DEAD + 1) * len(PROMPTS), late_trees
    assert ray.get(draft.endpoint.remote()) == before and ray.get(draft.pid.remote()) == pid  # never restarted
    wait_for_trees_again(llm, pair, 60)


def crash_and_restart(llm: LLM, pair, reference) -> None:
    """The only draft actor dies as in a crash and Ray restarts it: generation stays exact throughout, and
    the pool takes the actor back at its new address, so the trees come back."""
    draft = llm._thread.deployment.drafts[0]
    before, fallbacks = ray.get(draft.endpoint.remote()), sum(llm.metrics.fallbacks.values())
    outputs = generate_through_a_kill(llm, LONG, lambda: ray.kill(draft, no_restart=False))  # Ray restarts it
    for prompt, out, want in zip(PROMPTS, outputs, reference):
        assert_greedy_equal(out.token_ids, want, prompt, pair["model"])
    assert sum(llm.metrics.fallbacks.values()) > fallbacks  # the crash met generation in flight
    assert ask_actor(draft.endpoint, 120).address != before.address  # restarted: the old process is gone
    wait_for_trees_again(llm, pair, 120)


def test_with_its_pool_gone_for_good_the_split_drafts_beside_the_target(ray_cluster, pair):
    """The draft copy in the target's actor drafts the new sequences the dead pool cannot take: SD's
    rounds, no fast backup."""
    with cluster_llm(pair, num_draft_workers=1, draft_executor="split", tree_policy="never") as llm:
        check_greedy(pair, llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
        draft = llm._thread.deployment.drafts[0]
        address = ray.get(draft.endpoint.remote()).address
        ray.kill(draft, no_restart=True)
        wait_dead([draft])
        # Ray refuses calls before the process is gone: a prefill could still reach its gRPC server, and the
        # first draft after it then meet the death (a fast-backup round, which is right, but not this test's)
        assert port_closed(address)
        fallbacks = sum(llm.metrics.fallbacks.values())
        check_greedy(pair, llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
        # At most the one fast-backup draft of the round that met the death (seen once in a CI run with two
        # workers busy: 1 of 28 rounds; which call met it is not pinned down). Drafting every round by the
        # fast backup, not beside the target, would show one per sequence and round.
        assert sum(llm.metrics.fallbacks.values()) <= fallbacks + 1
        assert wait_for_load(llm, lambda load: (load.draft_workers_live, load.draft_workers) == (0, 1))


MULTI_NODE = r'''
import json, sys
import ray
from ray.cluster_utils import Cluster
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.distributed.deployment import LOCAL_RAY_SYSTEM_CONFIG
from saguaro_dist.placement import DRAFT_RESOURCE, TARGET_RESOURCE
target, draft, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
# No dashboard, no idle workers prestarted (the embedded Ray's settings): neither is what is tested, and each
# cost CPU seconds on a 2-core box.
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                        "_system_config": LOCAL_RAY_SYSTEM_CONFIG})
target_node = cluster.add_node(num_cpus=2, resources={TARGET_RESOURCE: 2})
draft_node = cluster.add_node(num_cpus=2, resources={DRAFT_RESOURCE: 2})
ray.init(address=cluster.address, log_to_driver=False)
# Two ranks (one placement group, its bundles on the target node); one draft: each draft actor is placed alike.
llm = LLM(model=target, draft=draft, mode="ssd", k=3, fan_out=12, cluster="auto",
          tensor_parallel_size=2, num_draft_workers=1)
out = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
print(json.dumps({"tokens": [o.token_ids for o in out], "target_nodes": llm._thread.target_node_ids(),
                  "draft_nodes": llm._thread.draft_node_ids(), "target_node": target_node.node_id,
                  "draft_node": draft_node.node_id, "dialed": llm._thread.draft_addresses}))
llm.shutdown(); ray.shutdown(); cluster.shutdown()
'''


def test_multi_node_placement_by_custom_resources(pair, tmp_path):
    """Head, a 'target' node and a 'draft' node: three real raylets (in a fresh process)."""
    script = tmp_path / "multi_node.py"
    script.write_text(MULTI_NODE)
    done = subprocess.run([sys.executable, str(script), pair["target"], pair["draft"], json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=400, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["target_nodes"]) == {result["target_node"]}
    assert set(result["draft_nodes"]) == {result["draft_node"]}
    assert not any(a.startswith("unix") for a in result["dialed"])  # drafts on another node: over TCP
    for prompt, got, want in zip(PROMPTS, result["tokens"], pair["reference"]):
        assert_greedy_equal(got, want, prompt, pair["model"])


def test_cache_parallel_pool_grows_the_cache_at_batch_1(ray_cluster, pair):
    """At batch 1 a pool of 3 splits one sequence's tree over 3 workers: 3x the branches, more hits."""
    hit_rates = {}
    for workers in (1, 3):
        with cluster_llm(pair, fan_out=4, adaptive_fan_out=False, num_draft_workers=workers, max_batch_size=1,
                         tree_policy="always") as llm:
            outs = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=GREEDY)
            check_greedy(pair, outs)
            m = llm.metrics
            hit_rates[workers] = m.cache_hits / max(1, m.cache_hits + m.cache_misses)
    assert hit_rates[3] > hit_rates[1], hit_rates


@pytest.mark.parametrize("executor", ["split", "process"])
def test_rounds_without_trees_are_exact_over_grpc(ray_cluster, pair, executor):
    """The tree gate's schedule is fixed for its first rounds at a batch size (a burst with trees, then one
    without), so one 60-token request takes both kinds of round, and skip_tree travels over gRPC (split:
    the rounds without trees as one catch_up)."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = hf_greedy(pair["model"], PROMPTS[0], params.max_tokens)
    with cluster_llm(pair, num_draft_workers=1, max_batch_size=1, draft_executor=executor) as llm:
        out = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0]
        m = llm.metrics
    assert_greedy_equal(out.token_ids, want, PROMPTS[0], pair["model"])
    assert m.just_in_time_rounds > 0 and m.cache_hits > 0, m
    assert m.tree_builds > 0 and m.tree_build_s > 0, m  # the draft's build time crossed gRPC


def test_two_cohorts_over_grpc_are_exact_and_outlive_a_killed_draft(ray_cluster, pair, long_reference):
    """Rounds without trees as two cohorts, each's drafts on the Speculate stream while the other
    verifies: exact with requests of different lengths (no fallback taken), and exact when a draft
    worker dies with drafts in flight."""
    lengths = [40, 12, 27, 5]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    with cluster_llm(pair, tree_policy="never", num_draft_workers=2) as llm:
        for prompt, out, n in zip(PROMPTS, llm.generate(prompt_token_ids=PROMPTS, sampling_params=params), lengths):
            assert_greedy_equal(out.token_ids, hf_greedy(pair["model"], prompt, n), prompt, pair["model"])
        m = llm.metrics
        assert m.cohort_rounds > 0 and sum(m.fallbacks.values()) == 0, m
        outputs = []
        worker = threading.Thread(target=lambda: outputs.extend(llm.generate(prompt_token_ids=PROMPTS, sampling_params=LONG)))
        worker.start()
        rounds = llm.metrics.cohort_rounds
        deadline = time.time() + 60
        while llm.metrics.cohort_rounds < rounds + 3 and time.time() < deadline:
            time.sleep(0.01)
        ray.kill(llm._thread.deployment.drafts[0], no_restart=True)
        worker.join(timeout=180)
        assert len(outputs) == len(PROMPTS), "generation did not complete after a draft worker died"
        for prompt, out, want in zip(PROMPTS, outputs, long_reference):
            assert_greedy_equal(out.token_ids, want, prompt, pair["model"])
        assert sum(llm.metrics.fallbacks.values()) > 0


def test_drafts_no_node_can_host_fail_start_up_clearly_and_leave_nothing(ray_cluster, pair, caplog):
    """A draft worker asking for a resource no node has would wait for it forever: start-up says so at
    once, gives up after startup_timeout_s with an error that says what could not be placed, and frees
    what it took."""
    before = ray.available_resources().get("CPU", 0)  # an earlier test's actors may still be freeing theirs
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.distributed.cluster"), \
            pytest.raises(RuntimeError, match=r"draft worker\(s\) asking .*no_such_node.*not started within startup_timeout_s"):
        # The timeout covers the target's placement too: 3 s ran out there on a loaded box (another error).
        cluster_llm(pair, num_draft_workers=1, draft_resources={"no_such_node": 1}, startup_timeout_s=10)
    assert "lacks {'no_such_node': 1" in caplog.text and "waits up to startup_timeout_s (10 s)" in caplog.text
    assert time.monotonic() - start < 60
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < before and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) >= before, "actors or placement groups were left behind"


def test_engine_needs_count_every_actor_and_the_shortfall_names_what_is_missing():
    """What start-up compares with the free resources before it waits: tp target bundles, the draft pool
    (none for AR), the pools' labels when the cluster advertises them."""
    config = Config(model="m", draft="d", cluster="auto", tensor_parallel_size=2, num_draft_workers=3,
                    draft_resources={"fast_cpu": 1})
    assert engine_needs(config, {}) == {"CPU": 5, "fast_cpu": 3}
    labelled = engine_needs(config, {TARGET_RESOURCE: 8, DRAFT_RESOURCE: 8})
    assert labelled == {"CPU": 5, "fast_cpu": 3, TARGET_RESOURCE: 2, DRAFT_RESOURCE: 3}
    assert engine_needs(replace(config, mode=Mode.AR, draft=None), {}) == {"CPU": 2}
    assert shortfall({"CPU": 5, "fast_cpu": 3}, {"CPU": 4.0}) == {"CPU": 1.0, "fast_cpu": 3}
    assert shortfall({"CPU": 5}, {"CPU": 16.0, "GPU": 1.0}) == {}


def test_timeouts_are_checked(pair):
    for bad in (0, -1.0, float("nan"), True, "5"):
        with pytest.raises(ValueError, match="startup_timeout_s"):
            LLM(model=pair["target"], draft=pair["draft"], mode="ssd", cluster="auto", startup_timeout_s=bad)
    with pytest.raises(ValueError, match="tree_timeout_s"):
        LLM(model=pair["target"], draft=pair["draft"], mode="ssd", tree_timeout_s=-1)
    for bad in (0, -2.0, "10"):
        with pytest.raises(ValueError, match="draft_deadline_s"):
            LLM(model=pair["target"], draft=pair["draft"], mode="ssd", cluster="auto", draft_deadline_s=bad)


def test_structured_outputs_on_ray_equal_the_one_host_engine(ray_cluster):
    """The grammar travels in the request to rank 0, whose engine masks what it verifies (tp = 2 here):
    greedy text equal to the one-host engine's on the demo pair (whose tokenizer llguidance reads)."""
    from saguaro_dist.demo import demo_pair
    from saguaro_dist.sampling_params import StructuredOutputsParams

    target, draft = demo_pair()
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(**spec))
              for spec in ({"regex": r"[a-z_]{1,12}\([a-z, ]{0,20}\)"}, {"choice": ["pass", "return None"]})]
    prompts = ["def add(a, b):\n    ", "class Stack:\n    "]
    with LLM(model=target, draft=draft, mode="sd", k=4) as local:
        want = [o.text for o in local.generate(prompts, params)]
    with LLM(model=target, draft=draft, mode="ssd", k=4, cluster="auto", tensor_parallel_size=2,
             num_draft_workers=1, max_batch_size=4) as remote:
        assert [o.text for o in remote.generate(prompts, params)] == want
