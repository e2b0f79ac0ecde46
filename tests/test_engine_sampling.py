"""Sampling exactness through the whole engine: the joint law of the first three generated tokens
under SD and every SSD path equals the target's, computed by enumeration.

Test: Pearson chi-square over the V^3 joint (cells with expected count < 5 pooled), false-alarm
rate ALPHA per case. With N = 6000 samples a 1% shift of probability mass between two likely
cells is seen with power ~0.5 at this alpha, a broken verifier (tested below) is rejected at once;
the verifier itself is tested with 10^5+ samples in tests/test_spec_*.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2

import saguaro_dist.engine.target as target_module
from engine_helpers import llama_config, save_model, save_perturbed
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.spec import VerifyResult

VOCAB, PROMPT, N, ALPHA = 6, [1, 2, 3], 6000, 1e-4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("sampling_pair")
    target = save_model(root / "target", llama_config(VOCAB, 32, 1), seed=3, sharpen=2.0)
    save_perturbed(root / "draft", target, seed=4, noise=0.6)
    return str(root / "target"), str(root / "draft"), target


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Plain sampling's distribution, written independently of saguaro_dist.spec."""
    logits = logits.double() / p.temperature
    if p.top_k:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < p.top_p  # smallest set whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        probs /= probs.sum()
    return probs


def exact_joint(model, params: SamplingParams, depth: int = 3) -> dict[tuple[int, ...], float]:
    joint = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, mass in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            for t, q in enumerate(reference_probs(logits, params).tolist()):
                if q > 0:
                    nxt[prefix + (t,)] = mass * q
        joint = nxt
    return joint


def sample_joint(target: str, draft: str | None, params: SamplingParams, **kwargs) -> dict[tuple[int, ...], int]:
    mode = kwargs.pop("mode", "ssd")
    with LLM(model=target, draft=draft, mode=mode, max_batch_size=64, **kwargs) as llm:
        seeded = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                 max_tokens=3, ignore_eos=True, seed=i) for i in range(N)]
        outs = llm.generate(prompt_token_ids=[PROMPT] * N, sampling_params=seeded)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    return counts


def chi_square_pvalue(counts: dict, joint: dict) -> float:
    impossible = {c: n for c, n in counts.items() if c not in joint}
    assert not impossible, f"sequences with zero target probability were generated: {impossible}"
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * N >= 5]
    observed = [counts.get(c, 0) for c in big] + [N - sum(counts.get(c, 0) for c in big)]
    expected = [joint[c] * N for c in big] + [N * (1 - sum(joint[c] for c in big))]
    pairs = [(o, e) for o, e in zip(observed, expected) if e > 1e-9]
    stat = sum((o - e) ** 2 / e for o, e in pairs)
    return float(chi2.sf(stat, len(pairs) - 1))


CASES = {
    "sd": dict(mode="sd", k=1),
    "ssd_hit_path": dict(k=1, fan_out=VOCAB * 2 - 1),          # every outcome cached: round 1 always hits
    "ssd_miss_neural": dict(k=1, fan_out=2, fallback="neural"),
    "ssd_miss_fast": dict(k=1, fan_out=2, fallback="fast"),
    "ssd_miss_random": dict(k=1, fan_out=2, fallback="random"),
    "ssd_saguaro_c": dict(k=1, fan_out=4, saguaro_c=0.3),
    "ssd_k2": dict(k=2, fan_out=9),
}
PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.8_topk4": SamplingParams(temperature=0.8, top_k=4),
    "t1_topp0.8": SamplingParams(temperature=1.0, top_p=0.8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_tokens_follow_the_target(pair, case):
    target, draft, model = pair
    params = PARAMS["t1"]
    p = chi_square_pvalue(sample_joint(target, draft, params, **CASES[case]), exact_joint(model, params))
    assert p > ALPHA, f"{case}: chi-square p = {p:.2e}"


@pytest.mark.parametrize("name", ["t0.8_topk4", "t1_topp0.8"])
def test_truncated_sampling_follows_the_target(pair, name):
    target, draft, model = pair
    params = PARAMS[name]
    counts = sample_joint(target, draft, params, k=1, fan_out=4)
    p = chi_square_pvalue(counts, exact_joint(model, params))
    assert p > ALPHA, f"{name}: chi-square p = {p:.2e}"


def always_accept(target_probs, draft_tokens, draft_probs, generators):
    """A broken verifier: accepts every draft token, bonus from p_{K+1}."""
    b, k = draft_tokens.shape
    bonus = torch.stack([torch.multinomial(target_probs[i, k], 1, generator=g)[0] for i, g in enumerate(generators)])
    return VerifyResult(accepted=torch.full((b,), k, dtype=torch.long), bonus=bonus)


def test_the_test_catches_a_broken_verifier(pair, monkeypatch):
    target, draft, model = pair
    monkeypatch.setattr(target_module, "verify", always_accept)
    params = PARAMS["t1"]
    p = chi_square_pvalue(sample_joint(target, draft, params, k=1, fan_out=4), exact_joint(model, params))
    assert p < ALPHA, f"a verifier that always accepts went unnoticed (p = {p:.2e})"
