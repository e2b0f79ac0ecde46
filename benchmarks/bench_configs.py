"""Engine configurations side by side, in one process, passes alternated: the A/B behind a tuning change.

    python benchmarks/bench_configs.py [--temperature 0.7] [--batch 1] [--passes 4] sd ssd \\
        'trees=ssd:{"tree_policy": "always"}' 'k3=sd:{"k": 3}'

Each CONFIG is SYSTEM, SYSTEM:{engine kwargs as JSON} or LABEL=SYSTEM[:{...}], SYSTEM one of our bench systems
(sd, ssd, ssd-process, ...; paper placement, printed). Every engine opens at once; each pass runs every one
over the same prompts (held-out demo snippets, or random ids for another pair), the order rotating, so the
box's drift (20% from minute to minute on a shared VM) falls on all alike. Printed per config: tok/s of each
pass, the geometric mean of its per-pass ratios to the first config, acceptance, rounds, tree hits and
misses, and the round loop's time split per round (verify, wait for drafts and trees, coordination).
`saguaro bench` is the reference grid; this is for the finer comparisons its cells are too coarse for.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from saguaro_dist.bench.config import OURS, BenchConfig, placement
from saguaro_dist.bench.prompts import bench_prompts, resolve_pair
from saguaro_dist.bench.runner import run_batches, vocab_size, warm_up
from saguaro_dist.bench.systems import Measurement, OursSystem


def parse_config(spec: str) -> tuple[str, str, dict]:
    """'LABEL=SYSTEM:{json}' -> (label, system, engine kwargs); LABEL defaults to the spec before the JSON."""
    label, _, rest = spec.partition("=") if "=" in spec.split(":", 1)[0] else ("", "", spec)
    system, _, kwargs = rest.partition(":")
    if system not in OURS:
        raise ValueError(f"{spec!r}: system must be one of {', '.join(OURS)}, got {system!r}")
    try:
        overrides = json.loads(kwargs) if kwargs else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"{spec!r}: the engine kwargs are not JSON ({err})") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"{spec!r}: the engine kwargs must be a JSON object, got {kwargs!r}")
    return label or system, system, overrides


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", help="SYSTEM, SYSTEM:{json} or LABEL=SYSTEM:{json}; the first is the baseline")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--passes", type=int, default=4, help="timed passes per config (after one untimed warm-up)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--target")
    p.add_argument("--draft")
    args = p.parse_args(argv)
    try:
        args.parsed = [parse_config(c) for c in args.configs]
    except ValueError as err:
        p.error(str(err))
    if len({label for label, _, _ in args.parsed}) < len(args.parsed):
        p.error("two configs share a label: name them LABEL=SYSTEM:{...}")
    return args


def open_systems(args, cfg: BenchConfig, target: str, draft: str) -> dict[str, OursSystem]:
    """Every config's engine, opened (paper placement, printed); a config the engine refuses closes those
    already open and ends the run with the engine's reason."""
    systems = {}
    for label, system, overrides in args.parsed:
        place = placement(system, "paper")
        print(f"{label}: {system} {json.dumps(overrides)}; {place.where}", flush=True)
        systems[label] = OursSystem(system, target, draft, {**cfg.engine_kwargs(), **overrides})
        try:
            systems[label].open(place)
        except (TypeError, ValueError) as err:  # an unknown or invalid engine kwarg
            close_all(systems)
            raise SystemExit(f"bench_configs.py: error: {label}: {err}") from None
    return systems


def close_all(systems: dict[str, OursSystem]) -> None:
    for system in systems.values():
        system.close()


def run_passes(systems: dict, prompts, cfg: BenchConfig, args) -> dict[str, list[Measurement]]:
    for system in systems.values():
        warm_up(system, prompts, args.batch, args.temperature, cfg)
    runs = {label: [] for label in systems}
    labels = list(systems)
    for r in range(args.passes):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            runs[label].append(run_batches(systems[label], prompts, args.batch, args.temperature, cfg, repeat=r))
    return runs


def report_line(label: str, runs: list[Measurement], baseline: list[Measurement]) -> str:
    ratio = math.exp(sum(math.log(a.tokens_per_s / b.tokens_per_s) for a, b in zip(runs, baseline)) / len(runs))
    drafted = sum(m.drafted for m in runs)
    acceptance = sum(m.accepted for m in runs) / drafted if drafted else float("nan")
    split = {key: sum(m.engine.get(key, 0.0) for m in runs) for key in
             ("rounds", "verify_s", "draft_wait_s", "coordination_s", "tree_builds")}
    per_round = 1e3 / max(1, split["rounds"])
    return (f"{label:>12}  tok/s {' '.join(f'{m.tokens_per_s:7.1f}' for m in runs)}  x first {ratio:.3f}  "
            f"acceptance {acceptance:.3f}  rounds {split['rounds']}  hits {sum(m.cache_hits for m in runs)} "
            f"misses {sum(m.cache_misses for m in runs)} trees {split['tree_builds']}  ms a round: verify "
            f"{split['verify_s'] * per_round:.2f} wait {split['draft_wait_s'] * per_round:.2f} "
            f"coordination {split['coordination_s'] * per_round:.2f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    target, draft = resolve_pair(args.target, args.draft)
    cfg = BenchConfig(target=target, draft=draft, batch_sizes=(args.batch,), temperatures=(args.temperature,),
                      max_new_tokens=args.max_tokens, plots=False)
    prompts, source = bench_prompts(target, args.prompts, cfg.prompt_len, cfg.seed, vocab_size(target))
    print(f"b = {args.batch}, T = {args.temperature}, {args.passes} passes of {source}", flush=True)
    systems = open_systems(args, cfg, target, draft)
    try:
        runs = run_passes(systems, prompts, cfg, args)
    finally:
        close_all(systems)
    baseline = runs[args.parsed[0][0]]
    for label, measured in runs.items():
        print(report_line(label, measured, baseline))


if __name__ == "__main__":
    sys.exit(main())
