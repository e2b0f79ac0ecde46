"""Per-forward latency of the model runtime at 1 thread, next to transformers' own forward (DynamicCache).

    python benchmarks/bench_runtime.py [--prefix 128] [--k 7] [--reps 30]

Prints a markdown table: ms per call (median) for decode(1), extend(K+1), and branch decode
(branch_start, then each branch_step) with N branches, for a ~1M and a ~60M parameter Llama; then
the sampling distribution with top-p (what AR, the verifier and the draft compute every round) with
our sort against torch's stable sort, on logits that vary from call to call (a fixed row would let the
CPU's branch predictor learn torch's sort and flatter it ~4x).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from saguaro_dist.demo.evaluate import cache_arg
from saguaro_dist.model import ModelRunner, set_torch_threads
from saguaro_dist.spec import sampling

CONFIGS = {
    "llama-1M": dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2),
    "llama-60M": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4),
}


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def ours_rows(runner: ModelRunner, prompt: list[int], k: int, reps: int) -> dict[str, float]:
    runner.add(0)
    runner.extend([0], [prompt], [1])
    n = len(prompt)

    def extend(m):
        def go():
            runner.extend([0], [prompt[:m]], [m])
            runner.truncate(0, n)
        return go
    rows = {"decode(1)": median_ms(extend(1), reps)}
    rows.update({f"extend(K+1={j + 1})": median_ms(extend(j + 1), reps) for j in range(3, k + 1)})
    for branches in (8, 21, 42):
        plens = [n - (i % (k + 1)) for i in range(branches)]  # depth-0..K outcomes, like a fan-out
        toks = torch.tensor(prompt[:branches] * (branches // len(prompt[:branches]) + 1))[:branches]
        start = lambda: runner.branch_start([0] * branches, plens, toks)  # noqa: E731
        state = start()[0]
        rows[f"branch_start N={branches}"] = median_ms(start, reps)

        def step():
            nonlocal state
            if state.depth >= k:
                state = start()[0]
            runner.branch_step(state, toks)
        rows[f"branch_step N={branches}"] = median_ms(step, reps)
    runner.free(0)
    return rows


def hf_rows(model: LlamaForCausalLM, prompt: list[int], k: int, reps: int) -> dict[str, float]:
    kv = cache_arg(model)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([prompt]), use_cache=True, **{kv: cache})

        def extend(m):
            def go():
                model(torch.tensor([prompt[:m]]), use_cache=True, **{kv: cache})
                cache.crop(-m)  # transformers 5: a negative count drops that many positions
            return go
        rows = {"decode(1)": median_ms(extend(1), reps)}
        rows.update({f"extend(K+1={j + 1})": median_ms(extend(j + 1), reps) for j in range(3, k + 1)})
        for branches in (8, 21, 42):  # transformers has no shared-prefix branches: a batch of N copied caches
            batch = DynamicCache(config=model.config)
            model(torch.tensor([prompt] * branches), use_cache=True, **{kv: batch})
            ids = torch.tensor([[t] for t in (prompt * 8)[:branches]])

            def step():
                model(ids, use_cache=True, **{kv: batch})
                batch.crop(-1)
            rows[f"branch_step N={branches}"] = median_ms(step, reps)
    return rows


def sampling_rows(reps: int, vocab: int = 2048) -> list[str]:
    """target_probs at T 0.7, top-p 0.95 for 1..40 rows: ms per call with our sort and with torch's."""
    pool = [torch.randn(40, vocab, generator=torch.Generator().manual_seed(i)) * 3 for i in range(16)]
    ours = sampling.sort_descending
    torch_sort = lambda x: x.sort(dim=-1, descending=True, stable=True)  # noqa: E731
    lines = []
    for rows in (1, 5, 12, 40):
        calls = iter(range(10 ** 9))
        probs = lambda: sampling.target_probs(pool[next(calls) % 16][:rows], 0.7, 0, 0.95)  # noqa: E731
        times = {}
        for name, sort in (("ours", ours), ("torch", torch_sort)):
            sampling.sort_descending = sort
            times[name] = median_ms(probs, reps)
        sampling.sort_descending = ours
        lines.append(f"| {rows} | {times['ours']:.3f} | {times['torch']:.3f} | {times['torch'] / times['ours']:.1f} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=128, help="tokens already stored when timing")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    set_torch_threads(1)
    prompt = torch.randint(0, 2000, (args.prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    print("| model | params | call | ours ms | transformers ms | ours / decode(1) |")
    print("|---|---|---|---|---|---|")
    for name, fields in CONFIGS.items():
        torch.manual_seed(0)
        cfg = LlamaConfig(**fields, max_position_embeddings=2048, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg).eval()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            ours = ours_rows(ModelRunner(tmp), prompt, args.k, args.reps)
        theirs = hf_rows(model, prompt, args.k, args.reps)
        for call, ms in ours.items():
            hf = f"{theirs[call]:.3f}" if call in theirs else "-"
            print(f"| {name} | {params:.1f}M | {call} | {ms:.3f} | {hf} | {ms / ours['decode(1)']:.2f} |")
    print("\n| rows (V = 2048, T 0.7, top-p 0.95) | target_probs ms | with torch's stable sort ms | ratio |")
    print("|---|---|---|---|")
    print("\n".join(sampling_rows(args.reps * 4)))


if __name__ == "__main__":
    main()
