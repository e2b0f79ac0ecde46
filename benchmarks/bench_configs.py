"""Engine configurations side by side, in one process, passes alternated: the A/B behind a tuning change.

    python benchmarks/bench_configs.py [--temperature 0.7] [--batch 1] [--passes 4] sd ssd \\
        'trees=ssd:{"tree_policy": "always"}' 'k3=sd:{"k": 3}'

Each CONFIG is SYSTEM, SYSTEM:{engine kwargs as JSON} or LABEL=SYSTEM[:{...}], SYSTEM one of our bench systems
(sd, ssd, ssd-process, ...; paper placement, printed). Every engine opens at once; each pass runs every one
over the same prompts (held-out demo snippets, or random ids for another pair), the order rotating, so the
box's drift (20% from minute to minute on a shared VM) falls on all alike (saguaro_dist.bench's
measure_interleaved). Printed per config: tok/s of each pass, its per-pass ratios to the first config
(median and range), and its best pass's acceptance, rounds, tree hits and misses and time split per round
(verify, wait for drafts and trees, coordination).
`saguaro bench` is the reference grid; this is for the finer comparisons its cells are too coarse for.
"""
from __future__ import annotations

import argparse
import json
import sys

from saguaro_dist.bench.config import OURS, BenchConfig, placement
from saguaro_dist.bench.paired import format_paired, paired_ratios
from saguaro_dist.bench.prompts import bench_prompts, resolve_pair
from saguaro_dist.bench.runner import measure_interleaved, vocab_size
from saguaro_dist.bench.systems import OursSystem, Repeats


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


def report_line(label: str, passes: Repeats, baseline: Repeats) -> str:
    """Every pass's tok/s, the per-pass ratios to the baseline (median and range, as the bench's "by repeat"),
    and the best pass's acceptance, hits and round split (as the bench's cells)."""
    best = passes.best
    split = {key: best.engine.get(key, 0.0) for key in ("rounds", "verify_s", "draft_wait_s", "coordination_s", "tree_builds")}
    per_round = 1e3 / max(1, split["rounds"])
    acceptance = best.accepted / best.drafted if best.drafted else float("nan")
    return (f"{label:>12}  tok/s {' '.join(f'{r:7.1f}' for r in passes.tokens_per_s)}  x first "
            f"{format_paired(paired_ratios(passes.tokens_per_s, baseline.tokens_per_s))}  best pass: acceptance "
            f"{acceptance:.3f}, rounds {split['rounds']}, hits {best.cache_hits}, misses {best.cache_misses}, trees "
            f"{split['tree_builds']}; ms a round: verify {split['verify_s'] * per_round:.2f} wait "
            f"{split['draft_wait_s'] * per_round:.2f} coordination {split['coordination_s'] * per_round:.2f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    target, draft = resolve_pair(args.target, args.draft)
    cfg = BenchConfig(target=target, draft=draft, batch_sizes=(args.batch,), temperatures=(args.temperature,),
                      max_new_tokens=args.max_tokens, repeats=args.passes, plots=False)
    prompts, source = bench_prompts(target, args.prompts, cfg.prompt_len, cfg.seed, vocab_size(target))
    print(f"b = {args.batch}, T = {args.temperature}, {args.passes} passes of {source}", flush=True)
    systems = open_systems(args, cfg, target, draft)
    try:
        passes = measure_interleaved(systems, prompts, args.batch, args.temperature, cfg)
    finally:
        close_all(systems)
    for label, measured in passes.items():
        print(report_line(label, measured, passes[args.parsed[0][0]]))


if __name__ == "__main__":
    sys.exit(main())
