"""The tree gate against its ideal: replay measured rounds of both kinds through spec.tree_gate.TreeGate.

    python benchmarks/bench_tree_gate.py record [--temperature 0] [--batch 1] [--out rounds.json]
                                                [--passes 3] [--prompts 8] [--max-tokens 128]
    python benchmarks/bench_tree_gate.py replay rounds.json [--trials 200] [--paired]

`record` runs one-host SSD on the demo pair (8 held-out prompts, 128 tokens, 3 passes) with every
round forced to each mode in turn (trees, just-in-time drafts, n-gram rounds), and saves each round's
(tokens, seconds, rows, fast-backup rows, their tokens, rows that took their n-gram proposal, their tokens).
`replay` runs the gate over that data, offered every kind recorded (older recordings hold trees and
just-in-time rounds only): at every round it picks a kind, and the round of that kind
recorded at the same point of the same text (greedy: both kinds generate the same tokens) is what
it gets. It prints the gate's tok/s over the best fixed kind's on the same drawn passes (mean, p10,
min over random lives): what the gate's choices cost or gain. Passes are drawn per kind (the box's drift
hits one kind and not the other) or, with --paired, once for both.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics


def record(temperature: float, batch: int, out: str, passes: int = 3, num_prompts: int = 8, max_tokens: int = 128) -> None:
    from transformers import AutoTokenizer

    from saguaro_dist import LLM, SamplingParams
    from saguaro_dist.demo import demo_pair, demo_prompts
    import saguaro_dist.engine.ssd_loop as ssd_loop
    from saguaro_dist.spec.tree_gate import RoundMode, TreeGate

    target, draft = demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer(p)["input_ids"][:64] for p in demo_prompts(num_prompts)]
    forced, log = {"mode": RoundMode.TREES}, []

    class ForcedGate(TreeGate):  # what the engine's gate measures, kept and logged; the mode it chooses, forced
        def mode(self, batch_size, sampled=False, fast_estimate=None):
            super().mode(batch_size, sampled, fast_estimate)
            return forced["mode"]

        def record(self, batch_size, mode, gained, seconds, sampled=False):
            log.append((gained.tokens, seconds, gained.rows, gained.fast_rows, gained.fast_tokens,
                        gained.lookup_rows, gained.lookup_tokens))
            super().record(batch_size, mode, gained, seconds, sampled)

    ssd_loop.TreeGate = ForcedGate  # the SSD loop builds its gate from this name
    llm = LLM(model=target, draft=draft, mode="ssd", k=4, fan_out=12, target_threads=1, draft_threads=1)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=temperature, max_tokens=16))
    data = {m.value: [] for m in RoundMode}  # mode -> [pass][group] -> [the 7-tuple ForcedGate.record logs]
    for _ in range(passes):
        for mode in RoundMode:
            forced["mode"], groups = mode, []
            for i in range(0, len(prompts), batch):
                log.clear()
                llm.generate(prompt_token_ids=prompts[i:i + batch], sampling_params=params)
                groups.append(list(log))
            data[mode.value].append(groups)
    with open(out, "w") as f:
        json.dump({"temperature": temperature, "batch": batch, "rounds": data}, f)
    for mode, passes in data.items():
        rounds_ = [r for p in passes for g in p for r in g]
        print(f"{mode}: {len(rounds_)} rounds, {sum(r[0] for r in rounds_) / sum(r[1] for r in rounds_):.1f} tok/s")


LABELS = {"trees": "trees", "just_in_time": "just-in-time", "fast": "n-gram rounds"}


def _replay_once(data: dict, rng: random.Random, paired: bool, passes: int = 3) -> tuple[float, float]:
    """One engine's life: `passes` times over every prompt group, each kind's pass drawn at random (with
    `paired`, one pass for both kinds: recorded a few seconds apart, they share the box's drift). Returns
    the gate's tok/s over the best fixed kind's on the same draws, and the share of tree rounds."""
    from saguaro_dist.spec.tree_gate import RoundMode, RoundYield, TreeGate
    gate, tokens, seconds, trees = TreeGate(tuple(m for m in RoundMode if m.value in data)), 0.0, 0.0, 0
    fixed = {m: [0.0, 0.0] for m in data}  # kind -> [tokens, seconds] of running it every round
    for _ in range(passes):
        for g in range(len(data["trees"][0])):
            shared = rng.randrange(len(data["trees"]))
            runs = {m: data[m][shared if paired else rng.randrange(len(data[m]))][g] for m in data}
            for m, r in runs.items():
                fixed[m][0] += sum(x[0] for x in r)
                fixed[m][1] += sum(x[1] for x in r)
            starts = {m: _starts(r) for m, r in runs.items()}
            pos, end, idx = 0, sum(x[0] for x in runs["trees"]), {m: 0 for m in runs}
            while pos < end:
                mode = gate.mode(1)
                m, i = mode.value, idx[mode.value]
                while i < len(starts[m]) - 1 and starts[m][i + 1] <= pos:
                    i += 1
                idx[m] = i
                # (tokens, seconds, rows, fast rows, their tokens, lookup rows, their tokens); older recordings
                # hold the first two, or five
                t, s, rows, fast_rows, fast_tokens, lookup_rows, lookup_tokens = (*runs[m][i], 1, 0, 0, 0, 0)[:7]
                gate.record(1, mode, RoundYield(rows, t, fast_rows, fast_tokens, lookup_rows, lookup_tokens), s)
                tokens, seconds, pos, trees = tokens + t, seconds + s, pos + t, trees + (mode is RoundMode.TREES)
    rounds = sum(len(r) for p in data["trees"] for r in p) * passes / len(data["trees"])
    return tokens / seconds / max(t / x for t, x in fixed.values()), trees / rounds


def _starts(rounds: list) -> list[int]:
    out, pos = [], 0
    for r in rounds:
        out.append(pos)
        pos += r[0]
    return out


def replay(path: str, trials: int, paired: bool) -> None:
    with open(path) as f:
        saved = json.load(f)
    data = saved["rounds"]
    fixed = {m: sum(r[0] for p in v for g in p for r in g) / sum(r[1] for p in v for g in p for r in g) for m, v in data.items()}
    rng = random.Random(0)
    runs = [_replay_once(data, rng, paired) for _ in range(trials)]
    rel, share = sorted(r for r, _ in runs), statistics.mean(s for _, s in runs)
    kinds = ", ".join(f"{LABELS[m]} {rate:.0f}" for m, rate in fixed.items())
    print(f"T {saved['temperature']} b {saved['batch']}{' paired' if paired else ''}: {kinds} tok/s; gate / better on the same draws: mean "
          f"{statistics.mean(rel):.3f}, p10 {rel[len(rel) // 10]:.3f}, min {rel[0]:.3f}; tree rounds {share:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--temperature", type=float, default=0.0)
    rec.add_argument("--batch", type=int, default=1)
    rec.add_argument("--out", default="rounds.json")
    rec.add_argument("--passes", type=int, default=3)
    rec.add_argument("--prompts", type=int, default=8)
    rec.add_argument("--max-tokens", type=int, default=128)
    rep = sub.add_parser("replay")
    rep.add_argument("path")
    rep.add_argument("--trials", type=int, default=200)
    rep.add_argument("--paired", action="store_true", help="one recorded pass for both kinds per prompt group")
    args = ap.parse_args()
    if args.command == "record":
        record(args.temperature, args.batch, args.out, args.passes, args.prompts, args.max_tokens)
    else:
        replay(args.path, args.trials, args.paired)


if __name__ == "__main__":
    main()
