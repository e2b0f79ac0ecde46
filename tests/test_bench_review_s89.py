"""Review of `saguaro bench` (session 89): a system the bench does not pin (ssd-ray: Ray's actors are not its
children) runs on the bench's own CPUs, not on the cores of a system opened before it. With --interleave and in
serving runs every system is open at once: ar pinned the bench process to cpu0, and the Ray that ssd-ray then
started inherited it, so its target and draft actors shared one core under a placement line that read "not
pinned". Real tiny checkpoints, real engines, a real local Ray."""
from __future__ import annotations

import dataclasses
import os

import pytest

from saguaro_dist.bench import BenchConfig
from saguaro_dist.bench.affinity import host_cpus
from saguaro_dist.bench.config import placement
from saguaro_dist.bench.systems import make_system

pytestmark = pytest.mark.skipif(len(host_cpus()) < 2 or not os.path.isdir("/proc"),
                                reason="pinning needs 2 CPUs and /proc")


def _threads_cpus() -> set[tuple[int, ...]]:
    """The CPU sets of this process's threads (pinning sets every one)."""
    return {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f"/proc/{os.getpid()}/task")}


def _cfg(pair, tmp_path) -> BenchConfig:
    return BenchConfig(target=pair[0], draft=pair[1], systems=("ar", "ssd-ray"), settings=("paper",), batch_sizes=(1,),
                       temperatures=(0.0,), max_new_tokens=4, prompt_len=6, k=2, fan_out=6, out_dir=str(tmp_path))


def _opened(cfg: BenchConfig, name: str, place):
    system = make_system(name, cfg.target, cfg.draft, cfg.engine_kwargs())
    system.open(place)
    return system


def test_an_unpinned_system_runs_on_the_bench_s_cpus_after_a_pinned_one(tiny_llama_pair, tmp_path):
    """ar pinned under paper, then a system whose plan is "not pinned" (ssd-ray's, on ar's engine: no Ray here):
    its engine thread started on ar's core, and its passes ran there."""
    cfg, host = _cfg(tiny_llama_pair, tmp_path), host_cpus()
    pinned, unpinned = placement("ar", "paper"), placement("ssd-ray", "paper")  # as the runner: before any open
    assert pinned.pinning.target_cpus == host[:1] and not unpinned.pinning.target_cpus
    ar = _opened(cfg, "ar", pinned)
    other = None
    try:
        assert _threads_cpus() == {host[:1]}
        other = _opened(cfg, "ar", dataclasses.replace(pinned, pinning=unpinned.pinning))
        assert _threads_cpus() == {host}  # its engine thread too: it started on the bench's CPUs
        ar.run([[1, 2, 3, 4, 5, 6]], 0.0, 4, 0)
        assert _threads_cpus() == {host[:1]}
        other.run([[1, 2, 3, 4, 5, 6]], 0.0, 4, 0)  # an interleaved pass after ar's
        assert _threads_cpus() == {host}
    finally:
        for system in (other, ar):
            if system is not None:
                system.close()
    assert _threads_cpus() == {host}


@pytest.mark.slow
def test_ssd_ray_actors_are_not_left_on_a_pinned_system_s_core(tiny_llama_pair, tmp_path):
    """The symptom: Ray started while ar held the bench on cpu0, and ssd-ray's draft actor ran on cpu0 alone."""
    import ray
    cfg, host = _cfg(tiny_llama_pair, tmp_path), host_cpus()
    places = {name: placement(name, "paper") for name in cfg.systems}
    ar = _opened(cfg, "ar", places["ar"])
    ray_system = None
    try:
        ray_system = _opened(cfg, "ssd-ray", places["ssd-ray"])
        drafts = ray_system.llm._thread.deployment.drafts
        pids = ray.get([d.pid.remote() for d in drafts])
        assert {tuple(sorted(os.sched_getaffinity(pid))) for pid in pids} == {host}, places["ssd-ray"].where
        assert ray_system.run([[1, 2, 3, 4, 5, 6]], 0.0, 4, 0).tokens == 4
    finally:
        for system in (ray_system, ar):
            if system is not None:
                system.close()
