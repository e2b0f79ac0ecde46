"""The tree gate against its ideal: replay measured rounds of both kinds through spec.tree_gate.TreeGate.

    python benchmarks/bench_tree_gate.py record [--temperature 0] [--batch 1] [--out rounds.json]
    python benchmarks/bench_tree_gate.py replay rounds.json [--trials 200]

`record` runs one-host SSD on the demo pair (8 held-out prompts, 128 tokens, 3 passes) with every
round forced to trees, then to just-in-time drafts, and saves each round's (tokens, seconds).
`replay` runs the gate over that data: at every round it picks a kind, and the round of that kind
recorded at the same point of the same text (greedy: both kinds generate the same tokens) is what
it gets. It prints the gate's tok/s over the better kind's (mean, p10, min over random passes):
what the gate's choices cost or gain, without the box's minute-to-minute drift.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics


def record(temperature: float, batch: int, out: str) -> None:
    from transformers import AutoTokenizer

    from saguaro_dist import LLM, SamplingParams
    from saguaro_dist.demo import demo_pair, demo_prompts
    import saguaro_dist.engine.rounds as rounds
    from saguaro_dist.spec.tree_gate import RoundMode

    target, draft = demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer(p)["input_ids"][:64] for p in demo_prompts(8)]
    forced, log = {"mode": RoundMode.TREES}, []

    class ForcedGate:  # what the engine's gate sees, kept; what it chooses, forced
        def mode(self, batch_size):
            return forced["mode"]

        def record(self, batch_size, mode, tokens, seconds):
            log.append((tokens, seconds))

    rounds.TreeGate = ForcedGate  # the SSD loop builds its gate from this name
    llm = LLM(model=target, draft=draft, mode="ssd", k=4, fan_out=12, target_threads=1, draft_threads=1)
    params = SamplingParams(temperature=temperature, max_tokens=128, ignore_eos=True, seed=0)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=temperature, max_tokens=16))
    data = {m.value: [] for m in RoundMode}  # mode -> [pass][group] -> [(tokens, seconds)]
    for _ in range(3):
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
        print(f"{mode}: {len(rounds_)} rounds, {sum(t for t, _ in rounds_) / sum(s for _, s in rounds_):.1f} tok/s")


def _replay_once(data: dict, rng: random.Random, passes: int = 3) -> float:
    """One engine's life: `passes` times over every prompt group, each kind's pass drawn at random."""
    from saguaro_dist.spec.tree_gate import TreeGate
    gate, tokens, seconds = TreeGate(), 0.0, 0.0
    for _ in range(passes):
        for g in range(len(data["trees"][0])):
            runs = {m: data[m][rng.randrange(len(data[m]))][g] for m in data}
            starts = {m: _starts(r) for m, r in runs.items()}
            pos, end, idx = 0, sum(t for t, _ in runs["trees"]), {m: 0 for m in runs}
            while pos < end:
                mode = gate.mode(1)
                m, i = mode.value, idx[mode.value]
                while i < len(starts[m]) - 1 and starts[m][i + 1] <= pos:
                    i += 1
                idx[m] = i
                t, s = runs[m][i]
                gate.record(1, mode, t, s)
                tokens, seconds, pos = tokens + t, seconds + s, pos + t
    return tokens / seconds


def _starts(rounds: list) -> list[int]:
    out, pos = [], 0
    for t, _ in rounds:
        out.append(pos)
        pos += t
    return out


def replay(path: str, trials: int) -> None:
    with open(path) as f:
        saved = json.load(f)
    data = saved["rounds"]
    fixed = {m: sum(t for p in v for g in p for t, _ in g) / sum(s for p in v for g in p for _, s in g) for m, v in data.items()}
    rng = random.Random(0)
    rel = sorted(_replay_once(data, rng) / max(fixed.values()) for _ in range(trials))
    print(f"T {saved['temperature']} b {saved['batch']}: trees {fixed['trees']:.0f}, just-in-time "
          f"{fixed['just_in_time']:.0f} tok/s; gate / better: mean {statistics.mean(rel):.3f}, "
          f"p10 {rel[len(rel) // 10]:.3f}, min {rel[0]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--temperature", type=float, default=0.0)
    rec.add_argument("--batch", type=int, default=1)
    rec.add_argument("--out", default="rounds.json")
    rep = sub.add_parser("replay")
    rep.add_argument("path")
    rep.add_argument("--trials", type=int, default=200)
    args = ap.parse_args()
    if args.command == "record":
        record(args.temperature, args.batch, args.out)
    else:
        replay(args.path, args.trials)


if __name__ == "__main__":
    main()
