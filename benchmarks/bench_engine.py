"""Issue 3 speed: batch-1 greedy tokens/s of ar / sd / ssd (one host; the draft in a child process, and
on a thread as `ssd-thread`), SSD acceptance, hit rate and the round loop's coordination overhead per round. A thin wrapper over `saguaro_dist.bench`.

    python benchmarks/bench_engine.py [--target T --draft D] [--max-new-tokens 128] [--repeats 3]

Prints the placement, the bench table, Theorem 7 for the SSD run, and the goal lines:
- the one-host SSD loop adds < 0.5 ms per round beyond model forwards (coordination ms/round);
- SSD beats SD whenever drafting takes more than a fifth of an SD round (SD's draft share is printed).
"""
from __future__ import annotations

import argparse

from saguaro_dist.bench import BenchConfig, run_grid
from saguaro_dist.bench.report import render


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per measurement, one at a time (batch 1)")
    p.add_argument("--sequential", action="store_true", help="run each system's repeats together, one system after "
                                                              "another (default: interleaved, the order rotating)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--fan-out", type=int, default=12)
    return p.parse_args()


def goal_lines(cells: dict) -> list[str]:
    sd, ssd, thread = cells["sd"], cells["ssd"], cells["ssd-thread"]
    draft_share = sd["draft_wait_ms_per_round"] / sd["step_ms_per_round"]
    return [f"one-host SSD coordination: {ssd['coordination_ms_per_round']:.3f} ms/round (goal < 0.5); "
            f"draft on a thread: {thread['coordination_ms_per_round']:.3f} ms/round",
            f"SSD draft process / draft thread: {ssd['tokens_per_s'] / thread['tokens_per_s']:.2f} "
            f"(verify {ssd['verify_ms_per_round']:.2f} vs {thread['verify_ms_per_round']:.2f} ms/round)",
            f"SD round: {sd['step_ms_per_round']:.2f} ms, drafting {sd['draft_wait_ms_per_round']:.2f} ms = "
            f"{100 * draft_share:.0f}% of it; SSD/SD = {ssd['tokens_per_s'] / sd['tokens_per_s']:.2f} "
            f"(goal: SSD > SD when drafting > 20% of an SD round)"]


def main() -> None:
    args = parse_args()
    cfg = BenchConfig(target=args.target, draft=args.draft, systems=("ar", "sd", "ssd", "ssd-thread"), settings=("paper",),
                      batch_sizes=(1,), temperatures=(0.0,), max_new_tokens=args.max_new_tokens,
                      prompt_len=args.prompt_len, num_prompts=args.num_prompts, repeats=args.repeats,
                      interleave=not args.sequential, k=args.k,
                      fan_out=args.fan_out, plots=False)
    results = run_grid(cfg)
    print(render(results))
    print("\n".join([""] + goal_lines({c["system"]: c for c in results["cells"]})))


if __name__ == "__main__":
    main()
