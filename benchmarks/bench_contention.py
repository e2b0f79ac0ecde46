"""Does a busy draft slow the target on this machine? A 5-token verify of the target, alone and beside a
draft process that builds speculation trees non-stop on another core (each process pinned, 1 torch thread).

    python benchmarks/bench_contention.py [--target T --draft D] [--reps 200]

SSD's speed-up assumes the draft's work is free while the target verifies (the paper runs it on other
GPUs). Two cores of one machine can share execution units, caches and memory bandwidth: this prints how
much of that assumption holds here. The ratio bounds every SSD figure taken on the machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

DRAFT_LOOP = """
import os, sys, torch
os.sched_setaffinity(0, {int(sys.argv[3])}); torch.set_num_threads(1)
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest, Release
worker = build_draft_worker(Config(model=sys.argv[1], draft=sys.argv[2], mode="ssd", k=4, fan_out=12))
greedy = DraftSampling(temperature=0.0, top_k=0, top_p=1.0, seed=1)
while True:  # 100 rounds of tree + just-in-time draft, then start over (stay inside the context)
    worker.prefill([PrefillRequest(0, list(range(5, 69)), greedy)])
    worker.jit_draft([JitDraftRequest(0, 0, 0, 7)])
    for r in range(1, 100):
        worker.build_trees()
        worker.jit_draft([JitDraftRequest(0, r, 2, 9)])
    worker.release([Release(0)])
"""


def verify_ms(runner, reps: int) -> float:
    """Median time of a 5-token extend after a 64-token prefix (what a K = 4 verify runs)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        runner.extend([0], [[5, 6, 7, 8, 9]], [5])
        times.append(time.perf_counter() - start)
        runner.truncate(0, 64)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target"), p.add_argument("--draft")
    p.add_argument("--reps", type=int, default=200)
    ns = p.parse_args()
    import torch

    from saguaro_dist.bench.prompts import resolve_pair
    from saguaro_dist.config import Config
    from saguaro_dist.engine.build import make_runner

    target, draft = resolve_pair(ns.target, ns.draft)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("needs two cores")
    os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
    runner = make_runner(target, Config(model=target, mode="ar"))
    runner.add(0)
    runner.extend([0], [list(range(5, 69))], [1])
    alone = verify_ms(runner, ns.reps)
    busy = subprocess.Popen([sys.executable, "-c", DRAFT_LOOP, target, draft, str(cores[1])])
    try:
        time.sleep(5.0)  # the draft loads and starts building
        beside = verify_ms(runner, ns.reps)
        if busy.poll() is not None:
            sys.exit(f"the draft loop died (exit {busy.returncode}): no measurement")
    finally:
        busy.kill()
    print(f"placement: target on core {cores[0]}, draft loop on core {cores[1]} (1 torch thread each)")
    print(f"5-token verify: alone {alone:.2f} ms, beside a busy draft {beside:.2f} ms ({beside / alone:.2f}x)")


if __name__ == "__main__":
    main()
