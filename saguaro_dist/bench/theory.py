"""Theorem 7 next to the measurement: the predicted SSD tokens/s from a run's own acceptance, hit rate,
verify time and tree-build time (the draft's own clock, beside the verifying target), with the
just-in-time latency timed on one thread (calibrate_draft). The same prediction with the tree build timed
on the draft alone is reported too: the two differ by what sharing the hardware costs the draft.

E_hit and E_miss are the two kinds' own tokens per round (tokens_by_round_kind): at the run's p their mix is
exactly its measured tokens per round. Rounds verified as two cohorts (spec/cohorts.py) overlap the just-in-time
draft with a verify, which Theorem 7 does not model: its 1 + T_b overstates them; their share is reported
(cohort_share). Rounds run on n-gram proposals alone (RoundMode.FAST, and rounds whose every row took its n-gram
proposal) are outside the theorem too: they are mixed in at one verify each and their own tokens per round
(with_fast_rounds; fast_share)."""
from __future__ import annotations

import logging
import statistics
import time

import torch

from saguaro_dist.spec.theory import predicted_speedup

log = logging.getLogger(__name__)


def predicted_tokens_per_s(tokens_hit: float, tokens_miss: float, p_hit: float, verify_s: float, tree_s: float,
                           backup_s: float) -> float:
    """Theorem 7 in seconds: [p E_hit + (1 - p) E_miss] / (verify_s x [p max(1, T_p) + (1 - p)(1 + T_b)]),
    T_p = tree_s / verify_s, T_b = backup_s / verify_s; E_hit, E_miss: tokens a round of either kind verifies."""
    if verify_s <= 0:
        return 0.0
    return predicted_speedup(p_hit, tokens_hit, tokens_miss, tree_s / verify_s, backup_s / verify_s) / verify_s


def with_fast_rounds(t7_rate: float, t7_tokens: float, fast_share: float, fast_tokens: float, verify_s: float) -> float:
    """Tokens/s of rounds of which fast_share ran on n-gram proposals alone (RoundMode.FAST: no tree built, no
    draft waited for, so one verify each, fast_tokens a round; outside Theorem 7) and the rest at Theorem 7's
    t7_rate, t7_tokens a round: each kind's rounds at their own length."""
    if fast_share <= 0:
        return t7_rate
    t7_round_s = t7_tokens / t7_rate if t7_rate else 0.0
    seconds = (1.0 - fast_share) * t7_round_s + fast_share * verify_s
    return ((1.0 - fast_share) * t7_tokens + fast_share * fast_tokens) / seconds if seconds > 0 else 0.0


def first_tokens(m, batch: int) -> int:
    """Tokens the prefills sampled, one a sequence (a cell's b-at-a-time calls add up); the rest came from rounds."""
    return len(m.outputs) or batch


def ngram_alone(m) -> tuple[int, int]:
    """(rounds, tokens) verified on n-gram proposals alone, waiting for no tree or draft: the gate's
    RoundMode.FAST rounds and the rounds whose every row took its n-gram proposal (lookup_rounds)."""
    e = m.engine
    return e.get("fast_rounds", 0) + e.get("lookup_rounds", 0), e.get("fast_round_tokens", 0) + e.get("lookup_round_tokens", 0)


def tokens_by_round_kind(m, batch: int, rounds: int) -> tuple[float | None, float | None]:
    """Of Theorem 7's `rounds` (the run's but its n-gram rounds, with_fast_rounds): E[tokens | a round that
    did not wait for a just-in-time draft] and E[tokens | one that did] (None:
    the run had no such round), from EngineMetrics jit_round_tokens; without it the run's mean stands for
    both. Misses that took the fast backup verify fewer tokens than a neural draft's rounds: a best case
    that gave every round the mean (what this once did) overstated the kind the run did not run."""
    # Theorem 7's rounds' tokens (never below 0: runs from before session 65 counted tokens a last round
    # verified past max_tokens or another end inside the round; metrics.EmittedTokens counts only those kept)
    total = max(0, m.tokens - first_tokens(m, batch) - ngram_alone(m)[1])
    jit = m.engine.get("jit_rounds")
    if jit is None or "jit_round_tokens" not in m.engine:
        return total / rounds, total / rounds
    waited = min(m.engine["jit_round_tokens"], total)  # a last round's tokens past max_tokens are not output
    return ((total - waited) / (rounds - jit) if rounds > jit else None), (waited / jit if jit else None)


def tree_mode_p(m, rounds: int) -> float | None:
    """p of "trees every round": the share of the rounds the tree gate ran with trees that waited for no
    draft (a miss that took the neural backup waits, at any p); None if the run had no such round. Runs
    from before the gate's count (no just_in_time_rounds): every tree round taken as one without a wait."""
    gate_jit = m.engine.get("just_in_time_rounds")
    if gate_jit is None:
        return 1.0
    tree_rounds = rounds - gate_jit
    if tree_rounds <= 0:
        return None
    waited = max(0, m.engine.get("jit_rounds", 0) - gate_jit)  # the gate's own rounds all drafted just in time
    return 1.0 - min(waited, tree_rounds) / tree_rounds


def predict_from_run(m, batch: int, calib: dict) -> dict | None:
    """Theorem 7's predictions beside the measurement: the inputs read of Measurement `m` (engine deltas) and the
    draft calibration (run_inputs), the run's own prediction, the same with the tree build timed on the draft
    alone, and SSD's best case (best_case_rate). Each is set against the measured tok/s at the run's scale
    (run_tokens_per_s: its prefills added back).

    None (the JSON's null, as for a cell without a prediction) for a run without rounds or lookups, and for one
    without a verify time: Theorem 7 is in units of verifies (it divided by zero, or predicted 0 tok/s)."""
    inputs = run_inputs(m, batch, calib)
    if inputs is None or not timed_a_verify(m, inputs["verify_s"]):
        return None
    rounds, fast_tokens = inputs.pop("t7_rounds"), inputs.pop("tokens_per_gate_fast_round")
    pred = mixed_rate(inputs, inputs["p_hit"], inputs["tree_s"], inputs["fast_share"])
    alone = mixed_rate(inputs, inputs["p_hit"], calib["tree_s"], inputs["fast_share"])
    best_case = best_case_rate(m, inputs, rounds, fast_tokens, pred)
    run = lambda rate: run_tokens_per_s(m, batch, inputs["prefill_s"], rate)  # noqa: E731 - the run at that rate
    return {**inputs, "predicted_tokens_per_s": pred, "predicted_run_tokens_per_s": run(pred),
            "predicted_alone_tokens_per_s": run(alone), "best_case_tokens_per_s": run(best_case),
            "measured_tokens_per_s": m.tokens_per_s, "measured_over_predicted": m.tokens_per_s / run(pred) if pred else 0.0}


def timed_a_verify(m, verify_s: float) -> bool:
    """Theorem 7 is in units of verifies: a run that timed none has no prediction (said in the log)."""
    if verify_s > 0:
        return True
    log.warning("Theorem 7: a run of %d rounds timed no verify (verify_s %s): no prediction",
                m.engine.get("rounds", 0), verify_s)
    return False


def best_case_rate(m, inputs: dict, rounds: int, fast_tokens: float | None, pred: float) -> float:
    """SSD's best case with this draft on this hardware: every round of the cheapest mode (Theorem 7 is linear
    in p, so the best mix is all trees, all just-in-time drafts (p = 0) or all n-gram rounds), among the modes
    the run measured: the tokens of a kind it never ran are not known. The n-gram mode takes only the gate's
    RoundMode.FAST rounds' tokens: the rows that took an n-gram proposal in other rounds were chosen for a
    good match. The run's own mix (pred) is one it reached: with such rows, the rest of its tree rounds are the
    rows without a good match, and every round of their kind would gain less than the run did."""
    modes = ((tree_mode_p(m, rounds) if rounds else None, inputs["tokens_per_hit_round"]),
             (0.0, inputs["tokens_per_miss_round"]))
    best = [mixed_rate(inputs, p, inputs["tree_s"], 0.0) for p, kind in modes if p is not None and kind is not None]
    return max(best + ([fast_tokens / inputs["verify_s"]] if fast_tokens else []) + [pred])


def run_tokens_per_s(m, batch: int, prefill_s: float, rate: float) -> float:
    """The whole generate call's tok/s had its decoding run at `rate`: Theorem 7 is a decoding rate, and the
    measured tok/s counts the prefills too, which the theorem does not model and every system pays alike. So
    the run's own prefill seconds, plus its decoded tokens at that rate."""
    decoded = m.tokens - first_tokens(m, batch)
    return m.tokens / (prefill_s + decoded / rate) if rate else 0.0


def run_inputs(m, batch: int, calib: dict) -> dict | None:
    """What predict_from_run reads of a run (`t7_rounds`: its rounds but the n-gram ones); None without any."""
    all_rounds, (fast, fast_tokens), gate_fast = m.engine.get("rounds", 0), ngram_alone(m), m.engine.get("fast_rounds", 0)
    rounds = all_rounds - fast  # Theorem 7's: the rest ran on n-gram proposals alone (with_fast_rounds)
    lookups = m.cache_hits + m.cache_misses
    if not all_rounds or (not lookups and "jit_rounds" not in m.engine):
        return None
    hit = m.cache_hits / lookups if lookups else None  # None: the gate ran every round without trees
    neural_share = m.fallbacks.get("neural", 0) / m.cache_misses if m.cache_misses else 0.0
    p_round, builds = p_without_wait(m, batch, rounds, hit, neural_share), m.engine.get("tree_builds", 0)
    tokens_hit, tokens_miss = tokens_by_round_kind(m, batch, rounds) if rounds else (None, None)
    return {"p_hit": p_round, "verify_s": m.engine.get("verify_s", 0.0) / all_rounds,
            "tree_s": run_tree_s(m, calib), "backup_s": calib["jit_s"],
            "t7_rounds": rounds, "tokens_per_round": (m.tokens - first_tokens(m, batch)) / all_rounds,
            "tokens_per_hit_round": tokens_hit, "tokens_per_miss_round": tokens_miss, "tree_alone_s": calib["tree_s"],
            "tree_s_in_run": bool(builds), "hit_rate": hit, "neural_share": neural_share,
            "prefill_s": m.engine.get("prefill_s", 0.0), "cohort_share": m.engine.get("cohort_rounds", 0) / all_rounds,
            "fast_share": fast / all_rounds,
            "tokens_per_fast_round": fast_tokens / fast if fast else None,
            "tokens_per_gate_fast_round": m.engine.get("fast_round_tokens", 0) / gate_fast if gate_fast else None}


def run_tree_s(m, calib: dict) -> float:
    """T_p's build time: the run's own, the draft's mean build time of the trees the target took (EngineMetrics
    tree_build_s / tree_builds), measured like verify_s beside the other process on shared hardware; the
    calibration's draft-alone build time stands in when the run took no tree."""
    builds = m.engine.get("tree_builds", 0)
    return m.engine["tree_build_s"] / builds if builds else calib["tree_s"]


def p_without_wait(m, batch: int, rounds: int, hit: float | None, neural_share: float) -> float:
    """p: the share of rounds that did not wait for a just-in-time draft (EngineMetrics jit_rounds), whose
    complement is the rounds whose misses took the neural backup and the rounds the tree gate ran without
    trees (SD's round, Theorem 7's 1 + T_b). Without that count, p is estimated from the lookups: a round waits
    if any sequence missed and got the neural backup, p = 1 - (neural share of misses)(1 - hit_rate^batch)."""
    if "jit_rounds" in m.engine:
        return 1.0 - m.engine["jit_rounds"] / rounds if rounds else 1.0
    return 1.0 - neural_share * (1.0 - hit ** batch)


def mixed_rate(inputs: dict, p_hit: float, tree_s: float, fast_share: float) -> float:
    """Theorem 7's rate at p_hit and tree_s (a kind of round the run did not have verifies no tokens: p puts no
    weight there), with fast_share of the rounds n-gram ones (with_fast_rounds)."""
    tokens_hit, tokens_miss = inputs["tokens_per_hit_round"] or 0.0, inputs["tokens_per_miss_round"] or 0.0
    t7 = predicted_tokens_per_s(tokens_hit, tokens_miss, p_hit, inputs["verify_s"], tree_s, inputs["backup_s"])
    t7_tokens = p_hit * tokens_hit + (1.0 - p_hit) * tokens_miss
    return with_fast_rounds(t7, t7_tokens, fast_share, inputs["tokens_per_fast_round"] or 0.0, inputs["verify_s"])


def calibrate_draft(target: str, draft: str, engine_kwargs: dict, prompts: list[list[int]], temperature: float,
                    rounds: int = 6) -> dict:
    """Median seconds of one tree build and one just-in-time K-token draft for this batch, draft alone on
    one torch thread (the draft's own core in the paper setup)."""
    from saguaro_dist.config import Config
    from saguaro_dist.engine.build import build_draft_worker
    from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
    config = Config(model=target, draft=draft, mode="ssd", draft_threads=1, **engine_kwargs)
    torch.set_num_threads(1)  # process-wide: the bench sets each system's own before it runs
    worker = build_draft_worker(config)
    sampling = DraftSampling(temperature, 0, 1.0, 0)
    worker.prefill([PrefillRequest(i, p, sampling) for i, p in enumerate(prompts)])
    tree, jit = [], []
    for r in range(rounds + 1):
        reqs = [JitDraftRequest(i, r, 0 if r == 0 else 1, p[-1]) for i, p in enumerate(prompts)]
        jit.append(_timed(worker.jit_draft, reqs))
        tree.append(_timed(worker.build_trees))
    return {"batch": len(prompts), "tree_s": statistics.median(tree[1:]), "jit_s": statistics.median(jit[1:]),
            "threads": torch.get_num_threads()}


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start
