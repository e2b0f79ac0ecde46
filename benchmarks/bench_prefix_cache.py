"""What automatic prefix caching buys: time to first token and request time with the cache on and off,
for ar and ssd on the demo pair, on three workloads:

  system  a long shared prefix (held-out stdlib text) + a different short question each time, one by one
  chat    each turn's prompt is the previous prompt and reply plus a new line (a conversation growing)
  batch   the system workload's prompts submitted at once (one generate call: admitted in one step)

    python benchmarks/bench_prefix_cache.py [--prefix-tokens 256] [--requests 5] [--max-new-tokens 32] [--repeats 3]

One torch thread for the target and one for the draft (ssd's in its own process). Cells run in a
rotating order; the ratios printed are of medians within this one run (off / on: above 1 is faster with
the cache). The first request of each workload finds nothing cached (it is in the medians: that is the
workload).
"""
from __future__ import annotations

import argparse
import statistics
import time

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import demo_pair, demo_prompts

WORKLOADS = ("system", "chat", "batch")
MODES = ("ar", "ssd")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix-tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=5, help="requests per workload (chat: turns)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


def engines() -> dict[tuple[str, bool], LLM]:
    target, draft = demo_pair()
    common = dict(model=target, k=4, target_threads=1, draft_threads=1)
    return {(mode, cache): LLM(mode=mode, draft=None if mode == "ar" else draft, enable_prefix_caching=cache, **common)
            for mode in MODES for cache in (False, True)}


def run(llm: LLM, workload: str, prefix: list[int], questions: list[list[int]], params: SamplingParams) -> tuple[float, float, int]:
    """(median time to first token, median request time, tokens reused) over the workload's requests;
    batch: the call's wall time as its request time."""
    if workload == "batch":
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=[prefix + q for q in questions], sampling_params=params)
        return (statistics.median(o.metrics.time_to_first_token_s for o in outs), time.perf_counter() - start,
                sum(o.metrics.num_cached_tokens for o in outs))
    ttft, total, reused, prompt = [], [], 0, list(prefix)
    for question in questions:
        prompt = (prefix if workload == "system" else prompt) + question
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        ttft.append(out.metrics.time_to_first_token_s)
        total.append(out.metrics.total_time_s)
        reused += out.metrics.num_cached_tokens
        if workload == "chat":
            prompt = prompt + out.token_ids
    return statistics.median(ttft), statistics.median(total), reused


def main() -> None:
    args = parse_args()
    llms = engines()
    tokenizer = next(iter(llms.values())).tokenizer
    texts = demo_prompts(64)
    corpus = tokenizer.encode("\n".join(texts[args.requests:]))
    questions = [tokenizer.encode("\n# " + text.splitlines()[0])[:12] + tokenizer.encode(f" {i}")  # never two alike
                 for i, text in enumerate(texts[:args.requests])]
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=True)
    print(f"placement: target 1 torch thread (this process); ssd's draft in a child process, 1 torch thread; "
          f"demo pair, batch 1, greedy; shared prefix {args.prefix_tokens} tokens, {args.requests} requests a workload")
    cells = {key: [] for key in ((w, m, c) for w in WORKLOADS for m in MODES for c in (False, True))}
    order = list(cells)
    for repeat in range(args.repeats):
        # A prefix of its own per cell and repeat: every run starts with nothing of it cached.
        for i, (workload, mode, cache) in enumerate(order[repeat % len(order):] + order[:repeat % len(order)]):
            start = (repeat * len(order) + i) * args.prefix_tokens
            prefix = corpus[start:start + args.prefix_tokens]
            if len(prefix) < args.prefix_tokens:
                raise SystemExit(f"the corpus holds {len(corpus)} tokens: fewer repeats or a shorter --prefix-tokens")
            cells[(workload, mode, cache)].append(run(llms[(mode, cache)], workload, prefix, questions, params))
    for llm in llms.values():
        llm.shutdown()
    median = {key: tuple(statistics.median(r[i] for r in runs) for i in range(3)) for key, runs in cells.items()}
    print("\n| workload | system | prefix cache | TTFT ms | request ms | tokens reused a run |\n|---|---|---|---|---|---|")
    for (workload, mode, cache), (ttft, total, reused) in median.items():
        print(f"| {workload} | {mode} | {'on' if cache else 'off'} | {ttft * 1e3:.1f} | {total * 1e3:.1f} | {reused:.0f} |")
    print()
    for workload in WORKLOADS:
        for mode in MODES:
            off, on = median[(workload, mode, False)], median[(workload, mode, True)]
            print(f"{workload} {mode}: off / on TTFT {off[0] / on[0]:.2f}, request time {off[1] / on[1]:.2f}")


if __name__ == "__main__":
    main()
