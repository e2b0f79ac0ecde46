"""Issue 4 speed: the distributed path against one-host SSD on the same checkpoints, batch 1 greedy.

    python benchmarks/bench_distributed.py [--target T --draft D] [--pools 1,2,3] [--repeats 3] [--batch 1,8]
                                           [--request-probes 40]

Prints the placement, then: tokens/s and per-round coordination overhead (round wall time minus model
forwards and draft waits, as the engine accounts it) of one-host SSD and SSD on local Ray (target actor
+ draft actor, gRPC over loopback), the distributed/one-host ratio, the hit rate vs draft pool size
(cache-parallel: a pool of n workers builds n x the fan-out budget for the one sequence), and the cost
of a request outside its rounds: one-token requests timed from generate() to the engine, in the
engine, and back (the engine's clock and this process's are the host's wall clock).
Goals: >= 95% of one-host SSD throughput; <= 1 ms overhead per round; hit rate rising with pool size.
"""
from __future__ import annotations

import argparse
import statistics
import time

import ray
from tqdm import tqdm

from saguaro_dist.bench import BenchConfig, run_grid
from saguaro_dist.bench.config import placement
from saguaro_dist.bench.paired import format_paired, paired_ratios
from saguaro_dist.bench.prompts import bench_prompts, resolve_pair
from saguaro_dist.bench.report import markdown_table, render, round_mix
from saguaro_dist.bench.runner import cell_record, measure, vocab_size
from saguaro_dist.bench.systems import OursSystem
from saguaro_dist.distributed.cluster import LOCAL_RAY_SYSTEM_CONFIG

REQUEST_WARM_UP = 8  # probes not counted
REQUEST_COLUMNS = [("system", "system", "{}"), ("into", "to the engine ms", "{:.2f}"), ("engine", "in it ms", "{:.2f}"),
                   ("back", "back to generate() ms", "{:.2f}")]
POOL_COLUMNS = [("pool", "draft workers", "{}"), ("tokens_per_s", "tok/s", "{:.1f}"), ("cache_hit_rate", "hit", "{:.3f}"),
                ("acceptance_rate", "accept", "{:.2f}"), ("coordination_ms_per_round", "coord ms/rd", "{:.2f}"),
                ("draft_wait_ms_per_round", "wait ms/rd", "{:.2f}")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per measurement, b at a time (at least b)")
    p.add_argument("--sequential", action="store_true", help="run each system's repeats together, one system after "
                                                              "another (default: interleaved, the order rotating)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--pools", default="1,2,3", help="draft pool sizes for the hit-rate sweep")
    p.add_argument("--batch", default="1", help="batch sizes of the Ray vs one-host comparison (the goals are "
                                                 "at 1; above it the gates may run two cohorts)")
    p.add_argument("--no-ngram-rounds", action="store_true",
                   help="SSD without rounds of n-gram proposals alone (Config.ngram_rounds): the draft's path only")
    p.add_argument("--request-probes", type=int, default=40,
                   help="one-token requests timed per system for the per-request overhead (0: skip; the first 8 warm up)")
    p.add_argument("--ray-systems", default="ssd-ray", help="the Ray systems set against one-host ssd: ssd-ray (the "
                   "split default on the CPU) and/or ssd-ray-process (the whole draft in the draft actors)")
    return p.parse_args()


def pool_sweep(cfg: BenchConfig, pools: list[int], temperature: float) -> list[dict]:
    target, draft = resolve_pair(cfg.target, cfg.draft)
    prompts, _ = bench_prompts(target, cfg.prompt_count, cfg.prompt_len, cfg.seed, vocab_size(target))
    place, rows = placement("ssd-ray", "paper", cfg.cores), []
    for n in tqdm(pools, desc="draft pool sweep", unit="pool"):
        # A tree every round: the sweep measures the cache (the tree gate could run rounds without one).
        system = OursSystem("ssd-ray", target, draft, {**cfg.engine_kwargs(), "num_draft_workers": n, "tree_policy": "always"})
        system.open(place)
        try:
            timed = measure(system, prompts, 1, temperature, cfg)
        finally:
            system.close()
        row = cell_record("ssd-ray", "paper", place, 1, temperature, timed)
        rows.append({"pool": n, **{k: v for k, v in row.items() if k not in ("_measurement", "outputs")}})
    return rows


def request_overhead(cfg: BenchConfig, system: str, probes: int) -> dict:
    """Median ms of a one-token request (b = 1, greedy): into the engine, in it, and back to generate()."""
    target, draft = resolve_pair(cfg.target, cfg.draft)
    prompts, _ = bench_prompts(target, cfg.prompt_count, cfg.prompt_len, cfg.seed, vocab_size(target))
    runner = OursSystem(system, target, draft, cfg.engine_kwargs())
    runner.open(placement(system, "paper", cfg.cores))
    try:
        timed = [one_token_request(runner.llm, prompts[i % len(prompts)]) for i in range(probes)][REQUEST_WARM_UP:]
    finally:
        runner.close()
    return {"system": system, **{k: 1e3 * statistics.median(v) for k, v in zip(("into", "engine", "back"), zip(*timed))}}


def one_token_request(llm, prompt: list[int]) -> tuple[float, float, float]:
    """Seconds from generate() to the engine's arrival, in the engine, and from its finish back, by the
    host's wall clock (the engine stamps first_token_time with it; on Ray it runs in the target actor)."""
    from saguaro_dist import SamplingParams
    start = time.time()
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0.0, max_tokens=1,
                                                                               ignore_eos=True), use_tqdm=False)[0]
    done, m = time.time(), out.metrics
    arrival = m.first_token_time - m.time_to_first_token_s
    return arrival - start, m.total_time_s, done - arrival - m.total_time_s


def print_ratio(batch_size: int, cells: dict, ray: str) -> None:
    ratio = cells[ray]["tokens_per_s"] / cells["ssd"]["tokens_per_s"]
    by_repeat = format_paired(paired_ratios(cells[ray]["repeat_tokens_per_s"], cells["ssd"]["repeat_tokens_per_s"]))
    print(f"\nb={batch_size}: {ray} / one-host SSD tokens/s: {ratio:.2f} (goal >= 0.95 at b=1; best passes), "
          f"by repeat {by_repeat} (median, range); coordination ms/round: one-host "
          f"{cells['ssd']['coordination_ms_per_round']:.3f}, Ray {cells[ray]['coordination_ms_per_round']:.3f} (goal <= 1); "
          f"rounds one-host {round_mix(cells['ssd']['engine'])}, Ray {round_mix(cells[ray]['engine'])}")


def main() -> None:
    args = parse_args()
    batch_sizes = tuple(int(b) for b in args.batch.split(","))
    ray_systems = tuple(args.ray_systems.split(","))
    cfg = BenchConfig(target=args.target, draft=args.draft, systems=("ssd", *ray_systems), settings=("paper",),
                      batch_sizes=batch_sizes, temperatures=(args.temperature,), max_new_tokens=args.max_new_tokens,
                      prompt_len=args.prompt_len, num_prompts=max(args.num_prompts, *batch_sizes), repeats=args.repeats,
                      interleave=not args.sequential, plots=False, ngram_rounds=not args.no_ngram_rounds)
    if len(ray_systems) > 1:  # open at once (interleaved): logical room for every engine's actors on this host
        ray.init(num_cpus=2 * len(ray_systems), include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    results = run_grid(cfg)
    print(render(results))
    for b in cfg.batch_sizes:
        for system in ray_systems:
            print_ratio(b, {c["system"]: c for c in results["cells"] if c["batch"] == b}, system)
    if args.request_probes > REQUEST_WARM_UP:
        print("\na one-token request, b = 1 greedy (median ms; the engine's part is prefill and the first token):\n")
        print(markdown_table([request_overhead(cfg, s, args.request_probes) for s in ("ssd", *ray_systems)], REQUEST_COLUMNS))
    pools = [int(x) for x in args.pools.split(",")]
    print("\nhit rate vs draft pool size (batch 1, cache-parallel shards):\n")
    print(markdown_table(pool_sweep(cfg, pools, args.temperature), POOL_COLUMNS))


if __name__ == "__main__":
    main()
