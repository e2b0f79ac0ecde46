"""What a dead draft actor costs SSD on Ray, and how soon a restarted one brings the trees back.

    python benchmarks/bench_draft_recovery.py [--target T --draft D] [--executors split,process] [--temperatures 0,0.7]

One draft actor, batch 1, the demo pair by default, on a local Ray instance. Per executor and temperature:
tokens/s with the pool, then with its only actor killed for good (split: the draft copy in the target's
actor drafts; process: the fast backup proposes), their ratio; then a fresh engine (a tree every round)
whose actor is killed as in a crash, and the seconds until a round hits a tree again (Ray restarts the
actor at a new port; the pool takes it back).
"""
from __future__ import annotations

import argparse
import time

import ray
import torch

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.bench.prompts import bench_prompts, resolve_pair
from saguaro_dist.bench.runner import vocab_size
from saguaro_dist.distributed.cluster import LOCAL_RAY_SYSTEM_CONFIG, wait_dead


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--executors", default="split,process")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    return p.parse_args()


def tokens_per_s(llm: LLM, prompts, temperature: float, max_tokens: int) -> float:
    """One prompt at a time (batch 1), every prompt once."""
    start, tokens = time.perf_counter(), 0
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i)
        tokens += len(llm.generate(prompt_token_ids=[prompt], sampling_params=[params])[0].token_ids)
    return tokens / (time.perf_counter() - start)


def open_llm(target: str, draft: str, executor: str, **kwargs) -> LLM:
    return LLM(model=target, draft=draft, mode="ssd", cluster="auto", draft_executor=executor, target_threads=1,
               draft_threads=1, enable_prefix_caching=False, **kwargs)


def dead_pool_ratio(target, draft, executor, prompts, temperature, max_tokens) -> tuple[float, float]:
    """tok/s with the pool, then with its only actor dead for good."""
    llm = open_llm(target, draft, executor)
    try:
        tokens_per_s(llm, prompts[:2], temperature, max_tokens)  # warm-up
        alive = tokens_per_s(llm, prompts, temperature, max_tokens)
        actor = llm._thread.deployment.drafts[0]
        ray.kill(actor, no_restart=True)
        wait_dead([actor])
        tokens_per_s(llm, prompts[:1], temperature, max_tokens)  # the round that finds it dead
        return alive, tokens_per_s(llm, prompts, temperature, max_tokens)
    finally:
        llm.shutdown()


def seconds_to_trees_again(target, draft, executor, prompts, temperature, within_s: float = 120.0) -> float | None:
    """Kill the only actor as a crash would (Ray restarts it); seconds until a round hits a tree again."""
    llm = open_llm(target, draft, executor, tree_policy="always")
    try:
        tokens_per_s(llm, prompts[:2], temperature, 32)
        start = time.perf_counter()
        ray.kill(llm._thread.deployment.drafts[0], no_restart=False)
        time.sleep(0.5)  # ray.kill is asynchronous: a hit in the first moment may still be the old process's
        while time.perf_counter() - start < within_s:
            hits = llm.metrics.cache_hits
            tokens_per_s(llm, prompts[:1], temperature, 16)
            if llm.metrics.cache_hits > hits:
                return time.perf_counter() - start
        return None
    finally:
        llm.shutdown()


def main() -> None:
    args = parse_args()
    target, draft = resolve_pair(args.target, args.draft)
    prompts, source = bench_prompts(target, args.num_prompts, 64, 0, vocab_size(target))
    torch.set_num_threads(1)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    print(f"placement: target actor 1 torch thread (with split: the draft copy on it), draft actor 1 torch thread; "
          f"prompts: {source}, batch 1, {args.max_new_tokens} new tokens")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for executor in args.executors.split(","):
            alive, dead = dead_pool_ratio(target, draft, executor, prompts, temperature, args.max_new_tokens)
            back = seconds_to_trees_again(target, draft, executor, prompts, temperature)
            back_text = f"{back:.2f} s" if back is not None else "not within 120 s"
            print(f"T = {temperature} {executor:8s} tok/s with the pool {alive:7.1f}, its actor dead {dead:7.1f} "
                  f"({dead / alive:.2f}); restarted actor: trees again {back_text} after the kill", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
