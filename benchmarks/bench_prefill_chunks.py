"""One long prefill by max_num_batched_tokens: seconds and peak memory (each setting in a fresh process,
so one setting's peak does not hide the next's).

    python benchmarks/bench_prefill_chunks.py [--tokens 4000,8000] [--budgets 8192,2048,512]
        [--device cuda --dtype bfloat16 --model PATH]

Default model: a 4-layer Llama (hidden 256, 8 heads, 2 KV heads, vocab 4096) written by transformers;
one sequence, one torch thread. Prints a markdown table with time and peak memory (the process's RSS
on the CPU, torch's peak allocation on CUDA) relative to one forward.
Then the engine (ar): a long prompt arrives while one sequence decodes; the running sequence's longest
pause between tokens and the long prompt's time to first token, by max_num_batched_tokens.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

CHILD = r"""
import resource, sys, time, torch
from saguaro_dist.model import ModelRunner
torch.set_num_threads(1)
path, budget, n, device, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
cuda = device.startswith("cuda")
runner = ModelRunner(path, device=device, dtype=getattr(torch, dtype), max_num_batched_tokens=budget)
runner.add(0)
prompt = [(7 * i) % runner.vocab_size for i in range(n)]
if cuda:  # the same prefill once first: kernels load lazily on their first launch, outside the clock
    runner.add(1)
    runner.extend([1], [prompt], [1])
    runner.free(1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
start = time.perf_counter()
[logits] = runner.extend([0], [prompt], [1])
checksum = float(logits.float().sum())  # also waits for the device
peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(time.perf_counter() - start, peak, checksum)
"""


def checkpoint(path: str, max_len: int, layers: int) -> str:
    """A random Llama checkpoint written into `path` (the run's temporary directory, removed with it)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_len,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def measure(path: str, budget: int, tokens: int, device: str, dtype: str) -> tuple[float, float, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(budget), str(tokens), device, dtype],
                         check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1]), float(out[2])


def engine_pause(path: str, budget: int, tokens: int, device: str, dtype: str) -> tuple[float, float]:
    """(longest step while the long prompt prefills, its time to first token), in ms."""
    import time

    from saguaro_dist import SamplingParams
    from saguaro_dist.config import Config
    from saguaro_dist.engine.build import build_local_engine
    from saguaro_dist.engine.sequence import Sequence, SeqStatus
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine, _ = build_local_engine(Config(model=path, mode="ar", max_num_batched_tokens=budget, target_threads=1,
                                          device=device, dtype=dtype, enable_prefix_caching=False))  # repeats prefill for real

    def once(first_id: int) -> tuple[float, float]:
        running = Sequence(first_id, "running", list(range(1, 33)), params)
        engine.add(running)
        engine.step()
        long = Sequence(first_id + 1, "long", [(7 * i) % engine.vocab_size for i in range(tokens)], params)
        engine.add(long)
        steps = []
        while long.status is not SeqStatus.RUNNING:
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        for seq in (running, long):
            engine.abort(seq.request_id)
        return 1e3 * max(steps), 1e3 * sum(steps)
    try:
        if device.startswith("cuda"):  # a first pass loads the kernels (lazily, on first launch)
            once(10)
        return once(1)
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4000,8000")
    ap.add_argument("--budgets", default="8192,2048,512", help="max_num_batched_tokens; the first should fit a prompt whole")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model", help="a checkpoint to prefill instead (its max_position_embeddings must fit --tokens)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefill-chunks-") as scratch:
        run(args, scratch)


def run(args, scratch: str) -> None:
    lengths, budgets = [int(x) for x in args.tokens.split(",")], [int(x) for x in args.budgets.split(",")]
    path = args.model or checkpoint(scratch, max(lengths) + 256, args.layers)  # room to decode after the longest prompt
    memory = "peak CUDA MB" if args.device.startswith("cuda") else "peak RSS MB"
    print(f"model {path}, {args.device}, {args.dtype}\n")
    print(f"| prompt tokens | max_num_batched_tokens | seconds | {memory} | x time | x peak | same logits |")
    print("|---|---|---|---|---|---|---|")
    for n in lengths:
        base = None
        for budget in budgets:
            secs, peak, checksum = measure(path, budget, n, args.device, args.dtype)
            base = base or (secs, peak, checksum)
            print(f"| {n} | {budget} | {secs:.2f} | {peak:.0f} | {secs / base[0]:.2f} | {peak / base[1]:.2f} | "
                  f"{abs(checksum - base[2]) <= 1e-3 * abs(base[2])} |", flush=True)
    print("\n| prompt tokens | max_num_batched_tokens | running sequence's longest pause ms | long prompt's TTFT ms |")
    print("|---|---|---|---|")
    for n in lengths:
        for budget in budgets:
            pause, ttft = engine_pause(path, budget, n, args.device, args.dtype)
            print(f"| {n} | {budget} | {pause:.0f} | {ttft:.0f} |", flush=True)


if __name__ == "__main__":
    main()
