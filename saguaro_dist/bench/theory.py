"""Theorem 7 next to the measurement: the predicted SSD tokens/s from a run's own acceptance, hit rate and
verify time, with the draft's tree-build and just-in-time latencies timed on one thread (calibrate_draft)."""
from __future__ import annotations

import statistics
import time

import torch

from saguaro_dist.spec.theory import predicted_speedup


def predicted_tokens_per_s(tokens_per_round: float, p_hit: float, verify_s: float, tree_s: float,
                           backup_s: float) -> float:
    """Theorem 7 in seconds: tokens per round / (verify_s x [p max(1, T_p) + (1 - p)(1 + T_b)]),
    T_p = tree_s / verify_s, T_b = backup_s / verify_s. The run's mean tokens per round stands for both
    E[tokens | hit] and E[tokens | miss] (their p-weighted mean is exactly what the run measured)."""
    if verify_s <= 0:
        return 0.0
    rel = predicted_speedup(p_hit, tokens_per_round, tokens_per_round, tree_s / verify_s, backup_s / verify_s)
    return rel / verify_s


def predict_from_run(m, batch: int, calib: dict) -> dict:
    """The prediction's inputs from Measurement `m` (engine deltas) and the draft calibration.

    Per engine round the batch waits for a backup if any sequence missed and got the neural backup:
    p (round without a neural wait) = hit_rate^batch when misses go neural; the backup's cost is weighted
    by the share of misses that went neural (fast/random backups cost ~0)."""
    rounds = m.engine.get("rounds", 0)
    lookups = m.cache_hits + m.cache_misses
    if not rounds or not lookups:
        return {}
    hit = m.cache_hits / lookups
    neural_share = m.fallbacks.get("neural", 0) / m.cache_misses if m.cache_misses else 0.0
    p_round = 1.0 - neural_share * (1.0 - hit ** batch)
    inputs = {"tokens_per_round": (m.tokens - batch) / rounds, "p_hit": p_round,
              "verify_s": m.engine["verify_s"] / rounds, "tree_s": calib["tree_s"], "backup_s": calib["jit_s"]}
    pred = predicted_tokens_per_s(**inputs)
    return {**inputs, "hit_rate": hit, "neural_share": neural_share, "predicted_tokens_per_s": pred,
            "measured_tokens_per_s": m.tokens_per_s, "measured_over_predicted": m.tokens_per_s / pred if pred else 0.0}


def calibrate_draft(target: str, draft: str, engine_kwargs: dict, prompts: list[list[int]], temperature: float,
                    rounds: int = 6) -> dict:
    """Median seconds of one tree build and one just-in-time K-token draft for this batch, draft alone on
    one torch thread (the draft's own core in the paper setup)."""
    from saguaro_dist.config import Config
    from saguaro_dist.engine.build import build_draft_worker
    from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
    config = Config(model=target, draft=draft, mode="ssd", draft_threads=1, **engine_kwargs)
    worker = build_draft_worker(config)
    sampling = DraftSampling(temperature, 0, 1.0, 0)
    worker.prefill([PrefillRequest(i, p, sampling) for i, p in enumerate(prompts)])
    tree, jit = [], []
    for r in range(rounds + 1):
        reqs = [JitDraftRequest(i, r, 0 if r == 0 else 1, p[-1]) for i, p in enumerate(prompts)]
        jit.append(_timed(worker.jit_draft, reqs))
        tree.append(_timed(worker.build_trees))
    return {"tree_s": statistics.median(tree[1:]), "jit_s": statistics.median(jit[1:]), "threads": torch.get_num_threads()}


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start
