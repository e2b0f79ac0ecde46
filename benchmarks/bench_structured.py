"""What structured outputs cost and what telling the draft buys: greedy tokens/s and acceptance of ar / sd /
ssd on the demo pair, each plain and under a JSON schema, the draft told the grammar and not told.

    python benchmarks/bench_structured.py [--max-new-tokens 48] [--num-prompts 8] [--repeats 3]

One torch thread for the target and one for the draft (SSD's draft in its own process, SD's on the
target's thread); the cells of a repeat run in a rotating order (the box drifts minute to minute), and
the ratios printed are of medians within this one run.
"""
from __future__ import annotations

import argparse
import statistics

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import demo_pair, demo_prompts
from saguaro_dist.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "size": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "size", "tags"], "additionalProperties": False}
MODES = ("ar", "sd", "ssd")
KINDS = ("plain", "json", "json-untold")  # json-untold: the draft is not told the grammar


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=4)
    return p.parse_args()


def engines(k: int) -> dict[str, LLM]:
    target, draft = demo_pair()
    common = dict(model=target, k=k, target_threads=1, draft_threads=1)
    return {"ar": LLM(mode="ar", **common),
            "sd": LLM(mode="sd", draft=draft, draft_executor="thread", **common),
            "ssd": LLM(mode="ssd", draft=draft, draft_executor="process", **common)}


def measure(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, float]:
    """(decode tokens/s, acceptance) of the prompts one at a time (batch 1). Decode only (after the first
    token): a JSON answer ends sooner than plain text, and the prefill would weigh more on its tokens/s."""
    seconds, tokens, accepted, drafted = 0.0, 0, 0, 0
    for prompt in prompts:
        m = llm.generate([prompt], params)[0].metrics
        seconds += m.total_time_s - m.time_to_first_token_s
        tokens += m.num_generated_tokens - 1
        accepted, drafted = accepted + m.accepted_tokens, drafted + m.drafted_tokens
    return tokens / seconds, accepted / drafted if drafted else float("nan")


def main() -> None:
    args = parse_args()
    prompts = demo_prompts(args.num_prompts)
    plain = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    json_params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llms = engines(args.k)
    print("placement: target 1 torch thread (this process); sd's draft on the target's thread; ssd's draft in a "
          "child process, 1 torch thread; demo pair, batch 1, greedy")
    from saguaro_dist.engine.draft_constraints import DraftConstraints
    told_state = DraftConstraints.grammar_state
    cells = {(m, kind): [] for m in MODES for kind in KINDS}
    order = [(m, kind) for m in MODES for kind in KINDS if not (kind == "json-untold" and m != "sd")]
    for repeat in range(args.repeats):
        for m, kind in order[repeat % len(order):] + order[:repeat % len(order)]:
            # untold: sd's draft is on this process's thread, so patching the class blinds it
            DraftConstraints.grammar_state = (lambda self, g, o: None) if kind == "json-untold" else told_state
            cells[(m, kind)].append(measure(llms[m], prompts, plain if kind == "plain" else json_params))
    DraftConstraints.grammar_state = told_state
    for llm in llms.values():
        llm.shutdown()
    median = {key: (statistics.median(v[0] for v in runs), statistics.median(v[1] for v in runs))
              for key, runs in cells.items() if runs}
    print("\n| system | output | tok/s | acceptance |\n|---|---|---|---|")
    for (m, kind), (tps, acc) in median.items():
        print(f"| {m} | {kind} | {tps:.1f} | {acc:.3f} |")
    print()
    for m in MODES:
        print(f"{m}: json / plain tok/s {median[(m, 'json')][0] / median[(m, 'plain')][0]:.2f}")
    print(f"json: sd / ar {median[('sd', 'json')][0] / median[('ar', 'json')][0]:.2f}, "
          f"ssd / sd {median[('ssd', 'json')][0] / median[('sd', 'json')][0]:.2f}; sd told / untold tok/s "
          f"{median[('sd', 'json')][0] / median[('sd', 'json-untold')][0]:.2f}")


if __name__ == "__main__":
    main()
