"""What spawned tensor-parallel test ranks run. Each spawned rank imports the module of its function: this one
imports torch and the runner only (a rank importing model_checks or a test module pulled in transformers and the
engine, seconds of CPU a rank)."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.multiprocessing as mp
from test_model_tp import gloo_world, rendezvous

from saguaro_dist.model.runner import ModelRunner


def runner_logits(runner: ModelRunner, seq: list[int]) -> torch.Tensor:
    """Logits of seq: its first half prefilled, then one token a step (the decode path's positions)."""
    runner.add("s")
    half = len(seq) // 2
    got = [runner.extend(["s"], [seq[:half]], [half])[0]]
    got += [runner.extend(["s"], [[t]], [1])[0] for t in seq[half:]]
    runner.free("s")
    return torch.cat(got)


def greedy_tokens(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    runner.add("g")
    logits, out = runner.extend(["g"], [prompt], [1])[0], []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = runner.extend(["g"], [[out[-1]]], [1])[0]
    runner.free("g")
    return out


def tp_rank_logits(rank: int, init_method: str, path: str, result_file: str, seq: list[int]) -> None:
    """One rank's runner_logits of seq (or its ValueError's message), saved to result_file.<rank>."""
    torch.set_num_threads(1)
    with gloo_world(rank, 2, init_method) as group:
        try:
            result = runner_logits(ModelRunner(path, tp_group=group), seq)
        except ValueError as err:
            result = str(err)
        torch.save(result, f"{result_file}.{rank}")


def two_rank_logits(path, seq: list[int]) -> list:
    """Each of 2 tensor-parallel ranks' runner_logits of seq, or its ValueError's message."""
    with tempfile.TemporaryDirectory() as out:
        result_file = os.path.join(out, "logits")
        mp.spawn(tp_rank_logits, args=(rendezvous(), str(path), result_file, seq), nprocs=2, join=True)
        return [torch.load(f"{result_file}.{rank}") for rank in (0, 1)]


def _rank_results(rank: int, world: int, init_method: str, paths: list[str], seq: list[int], prompt: list[int],
                  new: int, result_file: str) -> None:
    torch.set_num_threads(1)
    with gloo_world(rank, world, init_method) as group:
        results = []
        for path in paths:
            runner = ModelRunner(path, tp_group=group)
            results.append({"kv_heads": runner.pool.k.shape[2], "logits": runner_logits(runner, seq),
                            "greedy": greedy_tokens(runner, prompt, new)})
        torch.save(results, f"{result_file}.{rank}")


def rank_results(tmp_path, world: int, paths: list[str], seq: list[int], prompt: list[int], new: int) -> list[list[dict]]:
    """Per rank of `world` spawned gloo ranks, per checkpoint: its KV heads, runner_logits of seq and `new` greedy
    tokens after prompt."""
    args = (world, rendezvous(), paths, seq, prompt, new, str(tmp_path / "out"))
    mp.spawn(_rank_results, args=args, nprocs=world, join=True)
    return [torch.load(tmp_path / f"out.{r}") for r in range(world)]
