"""What one long request used to cost every later graphed step, and what the pool's narrowing gives back.

The static forwards that CUDA graphs capture attend over the KV pool's whole capacity (model/cuda_graphs.py).
The script times a batch's decode step on that path three times: before a long request, beside the long
request's wide pool (what every later step paid before the pool narrowed), and once the long request has
finished and the pool narrowed (ModelRunner._fit_capacity). The model has the demo target's shape, with room
for --long positions. On the CPU the static path runs uncaptured (the same forward); on CUDA it is captured.

    python benchmarks/bench_kv_narrowing.py                      # CPU, one torch thread
    python benchmarks/bench_kv_narrowing.py --device cuda --long 8000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from saguaro_dist.demo import demo_pair
from saguaro_dist.model import ModelRunner
from saguaro_dist.model.cuda_graphs import StepGraphs


def checkpoint(max_positions: int, folder: str) -> str:
    """The demo target's shape (random weights: speed only), with room for max_positions."""
    with open(os.path.join(demo_pair()[0], "config.json")) as f:
        cfg = json.load(f)
    LlamaForCausalLM(LlamaConfig(**{**cfg, "max_position_embeddings": max_positions})).save_pretrained(folder)
    return folder


def static_runner(path: str, device: str, max_model_len: int) -> ModelRunner:
    runner = ModelRunner(path, device=device, max_model_len=max_model_len)
    with torch.inference_mode():  # graphs on CUDA; on the CPU the same static forward, uncaptured
        runner.graphs = StepGraphs(runner.model, runner.pool, runner.cos, runner.signed_sin, runner.group,
                                   max_batch=8, capture=runner.device.type == "cuda")
    return runner


def decode_ms(runner: ModelRunner, seqs: list[str], steps: int) -> float:
    """Median wall time of one decode step of `seqs` (each step undone after, so lengths stay put)."""
    times = []
    for _ in range(steps + 2):  # the first two capture (CUDA) or warm up
        start = time.perf_counter()
        runner.extend(seqs, [[7]] * len(seqs), [1] * len(seqs))
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        for s in seqs:
            runner.truncate(s, runner.length(s) - 1)
    return 1e3 * statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--long", type=int, default=1900,
                    help="the long request's length (over NARROW_ABOVE = 1024, or the pool stays wide)")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    seqs = [f"s{i}" for i in range(args.batch)]
    with tempfile.TemporaryDirectory() as folder:
        runner = static_runner(checkpoint(args.long + 64, folder), args.device, args.long + 64)
        for s in seqs + ["long"]:
            runner.add(s)
        runner.extend(seqs, [[5] * 40] * args.batch, [1] * args.batch)
        before = decode_ms(runner, seqs, args.steps)
        runner.extend(["long"], [[3] * args.long], [1])
        wide, capacity = decode_ms(runner, seqs, args.steps), runner.pool.capacity
        runner.rename("long", ("prefix", 0))  # finished; the prefix cache keeps its row
        narrowed = decode_ms(runner, seqs, args.steps)
        print(f"device {runner.device}, b = {args.batch} decode on the static path, median of {args.steps} steps:")
        print(f"  before the long request:                      {before:.2f} ms (KV capacity 128)")
        print(f"  beside its wide pool (every step, before):   {wide:.2f} ms (KV capacity {capacity})")
        print(f"  after it finished, the pool narrowed:         {narrowed:.2f} ms (KV capacity {runner.pool.capacity})")
        print(f"  wide / narrowed: {wide / narrowed:.2f}x")


if __name__ == "__main__":
    main()
