"""A tensor-parallel engine left idle longer than its group's timeout keeps its group: rank 0 pings the followers,
which wait for its next call inside a collective. A follower once outwaited the timeout (30 min on gloo), ended its
process (FOLLOWER_LOST_EXIT) and the idle engine's next request failed (RankLost) until a rebuild. A dead rank is
still noticed: a killed follower fails rank 0's next ping while the engine idles, a hung rank 0 (no pings) ends its
followers at the timeout. Real TargetRanks (and BroadcastRunner) on real gloo groups, one process a rank (no Ray:
TargetRank is the plain class Ray wraps), the group's timeout seconds instead of minutes."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from datetime import timedelta

import pytest

pytestmark = pytest.mark.slow
# Pings every 2.5 s. A follower dies once rank 0 sends nothing for the timeout: 4 s (pings every second) left a
# loaded CI host 3 s for a stalled pinger, or for rank 0 building its runner after rank 1 began to follow.
GROUP_TIMEOUT = timedelta(seconds=10)
IDLE_S = 1.5 * GROUP_TIMEOUT.total_seconds()  # past the timeout: without pings the follower would end meanwhile
MAX_TOKENS = 6
BOUND_S = 120  # a safety net only: every wait is bounded


def ask(rank0, seq_id: int, prompt: list[int], bound_s: float = BOUND_S) -> tuple[list[int], str | None]:
    """One greedy request through rank 0's front door: its tokens, and its error (None: it finished; "no answer"
    after bound_s)."""
    from saguaro_dist import SamplingParams
    from saguaro_dist.distributed.remote import RemoteRequest
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rank0.submit([RemoteRequest(seq_id, f"r{seq_id}", prompt, params)])
    tokens: list[int] = []
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        for update in rank0.poll(0.5).updates:
            tokens += update.token_delta
            if update.finished:
                return tokens, update.error
    return tokens, "no answer"


def grouped_rank(path: str, rank: int, masters, group_timeout: timedelta, start_s: float):
    """A TargetRank of a tp = 2 ar engine on `path`, set up in its group: rank 0 hands the others its rendezvous
    address through `masters` (they wait start_s for it). One torch thread: the ranks share this box's cores."""
    import torch

    from saguaro_dist.config import Config
    from saguaro_dist.distributed.actors import TargetRank
    torch.set_num_threads(1)
    config = Config(model=path, mode="ar", cluster="local", tensor_parallel_size=2, max_batch_size=4)
    target = TargetRank(config, rank, group_timeout=group_timeout)
    master = target.rendezvous() if rank == 0 else masters.get(timeout=start_s)
    if rank == 0:
        masters.put(master)
    target.setup(master, [], None)
    return target


def target_rank(rank: int, path: str, masters, results, killed, prompt: list[int]) -> None:
    """One rank's process (it imports this module: engine_helpers, ~5 s of CPU a process loading transformers'
    models, is imported by the test alone). Rank 0: a request, idle for longer than the group's timeout, a
    request; then, once the test killed rank 1, it idles until a ping finds the group broken, and a request fails."""
    target = grouped_rank(path, rank, masters, GROUP_TIMEOUT, BOUND_S)
    if rank == 1:
        target.followed()
        return
    first = ask(target, 1, prompt)
    time.sleep(IDLE_S)  # no request: only pings keep the followers' collective alive
    results.put(("answers", first, ask(target, 2, prompt)))
    killed.get(timeout=BOUND_S)
    deadline = time.monotonic() + BOUND_S
    while (lost := target.poll(0.2).lost) is None and time.monotonic() < deadline:
        pass
    results.put(("lost", lost, ask(target, 3, prompt)))
    results.close()
    results.join_thread()  # (the queue's feeder thread sends it: os._exit would not wait)
    os._exit(0)  # (a broken gloo group's teardown may wait on its dead peer)


def test_an_idle_tp_engine_keeps_its_group_and_still_notices_a_killed_follower(tmp_path):
    from engine_helpers import PROMPTS, hf_greedy, llama_config, save_model
    path = tmp_path / "target"
    model = save_model(path, llama_config(96, 64, 2), seed=0)
    spawn = multiprocessing.get_context("spawn")
    masters, results, killed = spawn.Queue(), spawn.Queue(), spawn.Queue()
    ranks = [spawn.Process(target=target_rank, args=(r, str(path), masters, results, killed, PROMPTS[0]))
             for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        _, first, after_idle = results.get(timeout=BOUND_S + 4 * GROUP_TIMEOUT.total_seconds())
        assert ranks[1].is_alive(), f"the follower ended while the engine was idle (exit {ranks[1].exitcode})"
        os.kill(ranks[1].pid, signal.SIGKILL)  # as the OOM killer would, the engine idle
        killed.put(True)
        _, lost, after_kill = results.get(timeout=3 * BOUND_S)
    finally:
        for p in ranks:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    expected = hf_greedy(model, PROMPTS[0], MAX_TOKENS)
    assert first == (expected, None)
    assert after_idle == (expected, None)
    assert lost is not None and "__ping__" in lost, lost  # noticed by a ping, no request in flight
    assert after_kill[1] is not None, after_kill


class Echo:
    """A runner whose one replayed call does nothing: the follower's loop is what is tested."""

    def free(self, seq_id) -> None:
        pass


def pinging_rank(rank: int, port: int, called) -> None:
    """Rank 1 follows; rank 0 makes one call, then idles (the test then stops it: a hung rank, no more pings)."""
    import torch.distributed as dist

    from saguaro_dist.distributed.tp_runner import BroadcastRunner, run_follower
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=GROUP_TIMEOUT)
    if rank == 1:
        run_follower(Echo(), dist.group.WORLD)
        return
    BroadcastRunner(Echo(), dist.group.WORLD, GROUP_TIMEOUT).free(1)
    called.set()
    time.sleep(BOUND_S)


def test_a_hung_rank_0_sends_no_pings_and_its_follower_ends_at_the_timeout():
    from saguaro_dist.distributed.tp_runner import FOLLOWER_LOST_EXIT
    from saguaro_dist.serve.ingress import free_port
    spawn, port = multiprocessing.get_context("spawn"), free_port()
    called = spawn.Event()
    ranks = [spawn.Process(target=pinging_rank, args=(r, port, called)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        assert called.wait(timeout=BOUND_S)
        time.sleep(IDLE_S)  # the pings keep the follower while rank 0 idles
        assert ranks[1].is_alive(), f"the follower ended while rank 0 was idle (exit {ranks[1].exitcode})"
        os.kill(ranks[0].pid, signal.SIGSTOP)  # hung: alive, its connections open, silent
        ranks[1].join(timeout=BOUND_S)
        assert ranks[1].exitcode == FOLLOWER_LOST_EXIT
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
