"""Sampling exactness through the whole engine under the request's constraints: truncation (top-k /
top-p / min-p), min_tokens, penalties, logit bias and allowed tokens, structured outputs; each with a
test that the chi-square test catches the constraint ignored. The method, the pair and the cases are
tests/test_engine_sampling.py's; apart from it so that the suite's two workers (a test file each) can
run both halves at once."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import saguaro_dist.engine.target as target_module
from saguaro_dist import SamplingParams
from saguaro_dist.engine.structured import GrammarError, GrammarState
from test_engine_sampling import (
    ALPHA, GRAMMAR, PARAMS, PROMPT, check_case, chi_square_pvalue, exact_joint, sample_joint, sampling_pair,
)

pytestmark = pytest.mark.slow


# The broken variants below sample N_CATCH, a fifth of N: the test that rejects them at 2000 samples rejects
# them at N too (the same shift, a statistic that grows with N). At 2000 (cells pooled as at that N, alpha
# kept): penalties ignored have noncentrality ~1000 against a critical value of 215 (143 degrees of freedom),
# the bias ignored ~5000 against 146; min_p ignored draws a sequence of zero probability 86% of the time; the
# grammar's mask ignoring the speculation fails ~25% of requests. Five seed sets of 2000 each (session 90):
# penalties p <= 3e-135, the bias p = 0 to double precision, min_p ~1730 impossible draws, grammar ~500 failures.
N_CATCH = 2000


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sampling_pair(tmp_path_factory.mktemp("sampling_pair"))


def assert_rejected(pair, params: SamplingParams, broken: str) -> None:
    """The chi-square test rejects what the (broken) engine samples under params: the test has the power
    to see that constraint ignored."""
    target, draft, model = pair
    counts, _ = sample_joint(target, draft, params, n=N_CATCH, k=1, fan_out=4)
    p = chi_square_pvalue(counts, exact_joint(model, params), allow_impossible=True)
    assert p < ALPHA, f"{broken} went unnoticed (p = {p:.2e})"


@pytest.mark.parametrize("name", ["t0.8_topk4", "t1_topp0.8"])
def test_truncated_sampling_follows_the_target(pair, name):
    target, draft, model = pair
    params = PARAMS[name]
    counts, _ = sample_joint(target, draft, params, k=1, fan_out=4)
    p = chi_square_pvalue(counts, exact_joint(model, params))
    assert p > ALPHA, f"{name}: chi-square p = {p:.2e}"


def test_min_tokens_follows_the_held_back_target(pair):
    """min_tokens = 2 with the target's likeliest first token as a stop token: it cannot come first or
    second, may come third, and everything else keeps the target's (renormalised) odds."""
    target, draft, model = pair
    with torch.no_grad():
        likeliest = int(model(torch.tensor([PROMPT])).logits[0, -1].argmax())
    params = SamplingParams(temperature=1.0, max_tokens=3, min_tokens=2, stop_token_ids=[likeliest])
    counts, metrics = sample_joint(target, draft, params, k=1, fan_out=4, tree_policy="always")
    assert metrics.cache_hits > 0
    p = chi_square_pvalue(counts, exact_joint(model, params))
    assert p > ALPHA, f"chi-square p = {p:.2e}"


@pytest.mark.parametrize("case", ["sd", "ssd_hit_path", "ssd_miss_neural", "ngram"])
def test_penalties_follow_the_penalized_target(pair, case):
    """Each verify row is penalized with the counts of the output before it, speculated tokens included."""
    check_case(pair, case, PARAMS["t1_penalties"])


def test_the_test_catches_ignored_penalties(pair, monkeypatch):
    """The penalized joint differs from the plain one by far more than this test can miss."""
    monkeypatch.setattr(target_module, "penalize_batch", lambda logits, *args: logits)
    assert_rejected(pair, PARAMS["t1_penalties"], "penalties ignored")


@pytest.mark.parametrize("case", ["sd", "ssd_hit_path", "ssd_miss_neural"])
def test_min_p_follows_the_truncated_target(pair, case):
    """min-p on the tempered target (and told to the draft, whose q is its own min-p'd distribution)."""
    check_case(pair, case, PARAMS["t1_minp0.85"])


def test_the_test_catches_a_target_that_ignores_min_p(pair, monkeypatch):
    """A target sampling without min-p emits tokens min-p forbids: the test sees them."""
    plain = target_module.sampling_probs
    monkeypatch.setattr(target_module, "sampling_probs",
                        lambda logits, rows: plain(logits, replace(rows, min_p=torch.zeros_like(rows.min_p))))
    assert_rejected(pair, PARAMS["t1_minp0.85"], "min_p ignored")


@pytest.mark.parametrize("case", ["sd", "ssd_hit_path", "ssd_miss_neural"])
def test_logit_bias_and_allowed_tokens_follow_the_biased_target(pair, case):
    check_case(pair, case, PARAMS["t1_bias"])


def test_the_test_catches_an_ignored_bias(pair, monkeypatch):
    """With every token allowed, a target that drops the bias samples a joint this test rejects."""
    monkeypatch.setattr(target_module, "bias_row", lambda bias, allowed, vocab_size: torch.zeros(vocab_size))
    assert_rejected(pair, replace(PARAMS["t1_bias"], allowed_token_ids=None), "the bias ignored")


@pytest.mark.parametrize("case", ["sd", "ssd_hit_path", "ssd_miss_neural", "ngram"])
def test_structured_outputs_follow_the_masked_target(pair, case):
    """Verify row t masked by the grammar after the output and x_1..x_t: the joint is the target's
    renormalised over what the regex allows at each step."""
    check_case(pair, case, SamplingParams(temperature=1.0, structured_outputs=GRAMMAR))


def test_the_test_catches_a_grammar_mask_that_ignores_the_speculation(pair, monkeypatch):
    """Every verify row masked as the first one (the drafted tokens not consumed): a token the grammar
    forbids gets out, and the engine's check at commit fails its request rather than emit it."""
    target, draft, _ = pair
    params = SamplingParams(temperature=1.0, structured_outputs=GRAMMAR)
    row_masks = GrammarState.row_masks
    monkeypatch.setattr(GrammarState, "row_masks", lambda self, drafted, rows: row_masks(self, [], rows))
    with pytest.raises(GrammarError, match="cannot follow this grammar past token"):
        sample_joint(target, draft, params, n=N_CATCH, k=1, fan_out=4)
