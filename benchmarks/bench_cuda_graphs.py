"""Latency of short forwards eager against CUDA-graph replay: extend steps (decode T = 1, verify
T = K + 1) and the draft's tree (branch_start, then K - 1 branch steps, 12 branches a sequence).

    python benchmarks/bench_cuda_graphs.py [--models PATH,...] [--dtype bfloat16] [--reps 50]

Default models: the demo target and draft. Each step appends T tokens to every sequence of the batch
after a 64-token prompt, then truncates back, so every repeat sees the same length; the device is
synchronised before each clock read. Prints a markdown table: ms a step or a tree (median), eager / graph.
Without a GPU (--device cpu) the graph column runs the same static forward uncaptured: a dry run of
the script, not a measurement.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from saguaro_dist.model import ModelRunner
from saguaro_dist.model.cuda_graphs import StepGraphs


def runner_for(path: str, device: str, dtype, graphs: bool) -> ModelRunner:
    cuda = device.startswith("cuda")
    runner = ModelRunner(path, device=device, dtype=dtype, cuda_graphs=graphs and cuda, branch_depth=8)
    if graphs and not cuda:
        with torch.inference_mode():
            runner.graphs = StepGraphs(runner.model, runner.pool, runner.cos, runner.signed_sin, runner.group,
                                       max_batch=8, branch_depth=8, capture=False)
    return runner


def step_ms(runner: ModelRunner, batch: int, t: int, reps: int, prompt_len: int = 64) -> float:
    ids = list(range(batch))
    for i in ids:
        runner.add(i)
    runner.extend(ids, [[(7 * i + j) % runner.vocab_size for j in range(prompt_len)] for i in ids], [1] * batch)
    tokens = [[(3 * i + j) % runner.vocab_size for j in range(t)] for i in ids]
    times = []
    for rep in range(reps + 3):  # 3 warm-ups (the first captures the graph)
        sync(runner)
        start = time.perf_counter()
        runner.extend(ids, tokens, [t] * batch)
        sync(runner)
        times.append(time.perf_counter() - start)
        for i in ids:
            runner.truncate(i, prompt_len)
    for i in ids:
        runner.free(i)
    return 1e3 * statistics.median(times[3:])


def tree_ms(runner: ModelRunner, batch: int, k: int, reps: int, branches: int = 12, prompt_len: int = 64) -> float:
    ids = list(range(batch))
    for i in ids:
        runner.add(i)
    runner.extend(ids, [[(7 * i + j) % runner.vocab_size for j in range(prompt_len)] for i in ids], [1] * batch)
    owners = [i for i in ids for _ in range(branches)]
    prefix = [prompt_len - (j % (k + 1)) for _ in ids for j in range(branches)]  # outcomes k* = 0..K
    tokens = torch.arange(len(owners)) % runner.vocab_size
    times = []
    for rep in range(reps + 3):
        sync(runner)
        start = time.perf_counter()
        state, _ = runner.branch_start(owners, prefix, tokens)
        for _ in range(k - 1):
            runner.branch_step(state, tokens)
        sync(runner)
        times.append(time.perf_counter() - start)
    for i in ids:
        runner.free(i)
    return 1e3 * statistics.median(times[3:])


def sync(runner: ModelRunner):
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="comma-separated checkpoints (default: the demo target and draft)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", default="1,5", help="T of each step (1: decode, K + 1: verify)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--k", type=int, default=4, help="speculation length: a tree is K forwards")
    args = ap.parse_args()
    if args.models:
        models = args.models.split(",")
    else:
        from saguaro_dist.demo import demo_pair
        models = [str(p) for p in demo_pair()]
    dtype = getattr(torch, args.dtype)
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}), "
          f"{args.dtype}, median of {args.reps} steps")
    print("| model | b | T | eager ms | graph ms | eager / graph |\n|---|---|---|---|---|---|")
    for path in models:
        eager, graphed = (runner_for(path, args.device, dtype, g) for g in (False, True))
        for b in map(int, args.batch.split(",")):
            for t in map(int, args.tokens.split(",")):
                e, g = step_ms(eager, b, t, args.reps), step_ms(graphed, b, t, args.reps)
                print(f"| {name(path)} | {b} | {t} | {e:.3f} | {g:.3f} | {e / g:.2f} |", flush=True)
            e, g = tree_ms(eager, b, args.k, args.reps), tree_ms(graphed, b, args.k, args.reps)
            print(f"| {name(path)} | {b} | tree | {e:.3f} | {g:.3f} | {e / g:.2f} |", flush=True)


if __name__ == "__main__":
    main()
