"""Backup proposals (n-gram, random), the critical batch size and the fallback policy; Theorem 7."""
import math

import pytest
import torch

from saguaro_dist.config import FallbackPolicy
from saguaro_dist.spec import (
    choose_fallback, critical_batch_size, expected_tokens_per_round, explore_fallback, fast_backup_throughput,
    neural_backup_throughput, ngram_proposal, predicted_speedup, random_proposal,
)
from saguaro_dist.spec.fallback import EXPLORE_EVERY, explore_every


@pytest.mark.parametrize("tokens, k, want", [
    ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),             # longest suffix [1, 2, 3] seen before: copy what followed
    ([5, 1, 2, 7, 8, 1, 2], 2, [7, 8]),                # suffix [1, 2]
    ([4, 1, 7, 1, 8, 1], 1, [8]),                      # the most recent occurrence wins
    ([1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),                # runs off the end: continues with the period
    ([1, 2, 3, 1, 2], 5, [3, 1, 2, 3, 1]),
    ([5, 6, 7], 3, [7, 7, 7]),                         # no match: repeat the last token
    ([3], 2, [3, 3]),
    ([], 2, [0, 0]),
    ([2, 2, 2], 4, [2, 2, 2, 2]),
])
def test_ngram_proposal(tokens, k, want):
    assert ngram_proposal(tokens, k) == want


def test_ngram_respects_its_size_limits():
    tokens = [1, 2, 3, 4, 9, 2, 3, 4, 8, 3, 4]
    assert ngram_proposal(tokens, 1, max_ngram=3) == [8]     # [8, 3, 4] unseen; [3, 4] last seen before 8
    assert ngram_proposal(tokens, 1, max_ngram=1) == [8]
    assert ngram_proposal([1, 2, 9, 1, 2], 1, min_ngram=3) == [2]  # no 3-gram match: last token


def test_random_proposal_reproducible_and_in_range():
    a = random_proposal(50, 6, torch.Generator().manual_seed(3))
    assert a == random_proposal(50, 6, torch.Generator().manual_seed(3))
    assert len(a) == 6 and all(0 <= t < 50 for t in a)
    assert len(random_proposal(50, 4)) == 4


def test_throughput_formulas_hand_case():
    # p = 0.9, b = 2: neural = 2 (0.9*4 + 0.1*3) / (1 + 0.19 * 2) = 7.8 / 1.38; fast = 2 (3.6 + 0.1)
    assert neural_backup_throughput(2, 0.9, 4.0, 3.0, 2.0) == pytest.approx(7.8 / 1.38)
    assert fast_backup_throughput(2, 0.9, 4.0, 1.0) == pytest.approx(7.4)


def test_critical_batch_size_matches_closed_form():
    # fast >= neural  <=>  p^b <= 1 - (N/F - 1)/t with N, F the per-sequence tokens of each side
    p, eh, en, ef, t = 0.99, 4.0, 3.5, 1.0, 0.05
    n, f = p * eh + (1 - p) * en, p * eh + (1 - p) * ef
    want = math.ceil(math.log(1 - (n / f - 1) / t) / math.log(p))
    assert critical_batch_size(p, eh, en, ef, t) == want
    assert want > 1


def test_a_round_that_waits_for_trees_makes_the_neural_wait_relatively_cheaper():
    # Round cost c = max(1, T_p): fast >= neural  <=>  c + (1 - p^b) t >= c N / F, so t scales with c.
    assert neural_backup_throughput(2, 0.9, 4.0, 3.0, 2.0, round_cost=1.5) == pytest.approx(7.8 / 1.88)
    assert fast_backup_throughput(2, 0.9, 4.0, 1.0, round_cost=1.5) == pytest.approx(7.4 / 1.5)
    # The measured b = 1, T = 0.7 case: p 0.44, 3.1 tokens a hit, 3.5 neural, 1.1 fast, JIT 1.25 verifies.
    args = (0.44, 3.1, 3.5, 1.1, 1.25)
    assert critical_batch_size(*args) == 1                      # counted as costing one verify: fast
    assert critical_batch_size(*args, round_cost=1.5) > 1       # its trees made it 1.5: neural at b = 1
    assert critical_batch_size(*args, round_cost=1.5) <= critical_batch_size(*args, round_cost=3.0)


def test_critical_batch_size_edges():
    assert critical_batch_size(0.9, 4, 3.5, 1.0, 0.0) == 1024           # a free neural backup always wins
    assert critical_batch_size(0.9, 4, 3.5, 1.0, 0.0, max_batch=64) == 64
    assert critical_batch_size(0.9, 4, 3.0, 3.0, 1.0) == 1              # fast as good and free
    assert critical_batch_size(0.99, 4, 3.5, 1.0, 0.01) > critical_batch_size(0.99, 4, 3.5, 1.0, 1.0)


def test_choose_fallback_small_batch_neural_large_batch_fast():
    b_star = critical_batch_size(0.99, 4.0, 3.5, 1.2, 0.05)
    assert 1 < b_star < 1024
    assert choose_fallback(FallbackPolicy.AUTO, 1, b_star) is FallbackPolicy.NEURAL
    assert choose_fallback(FallbackPolicy.AUTO, b_star - 1, b_star) is FallbackPolicy.NEURAL
    assert choose_fallback(FallbackPolicy.AUTO, b_star, b_star) is FallbackPolicy.FAST
    assert choose_fallback("auto", 512, b_star) is FallbackPolicy.FAST
    for fixed in (FallbackPolicy.NEURAL, FallbackPolicy.FAST, FallbackPolicy.RANDOM):
        assert choose_fallback(fixed, 1, 2) is fixed
        assert choose_fallback(fixed, 1000, 2) is fixed


def test_every_sixteenth_automatic_choice_takes_the_other_backup():
    """So the losing backup's cost and tokens are measured again: one slow first measurement must not
    settle the choice for good."""
    NEURAL, FAST = FallbackPolicy.NEURAL, FallbackPolicy.FAST
    chosen = [explore_fallback(FAST, d) for d in range(48)]
    assert [d for d, kind in enumerate(chosen) if kind is NEURAL] == [15, 31, 47]
    assert [explore_fallback(NEURAL, d, every=4) for d in range(4)] == [NEURAL, NEURAL, NEURAL, FAST]
    assert explore_fallback(FallbackPolicy.RANDOM, 15) is FallbackPolicy.RANDOM


def test_the_backup_behind_is_tried_less_often_the_further_behind_it_is():
    """Every 16th choice while the two are within 10%, up to 8 x 16 as the gap grows (a try costs in
    proportion to it), and never stretched past the tries the backup behind has had."""
    assert explore_every(1.0, 0.95, tries=50) == EXPLORE_EVERY
    assert explore_every(1.0, 0.8, tries=50) == explore_every(0.8, 1.0, tries=50) == 4 * EXPLORE_EVERY  # (0.2 / 0.1)^2
    assert explore_every(1.0, 0.7, tries=50) == 8 * EXPLORE_EVERY  # (0.3 / 0.1)^2 = 9, capped at 8
    assert explore_every(1.0, 0.1, tries=50) == 8 * EXPLORE_EVERY
    assert explore_every(1.0, 0.1, tries=2.5) == 2.5 * EXPLORE_EVERY  # a gap seen in few tries may be a fluke
    assert explore_every(1.0, 0.1, tries=0) == EXPLORE_EVERY
    assert explore_every(0.0, 1.0, tries=50) == EXPLORE_EVERY  # nothing to compare


def test_theorem_7_hand_case():
    # [0.8*4 + 0.2*2] / [0.8*max(1, 1.5) + 0.2*(1 + 0.5)] = 3.6 / 1.5
    assert predicted_speedup(0.8, 4.0, 2.0, 1.5, 0.5) == pytest.approx(2.4)
    # the cache build hides behind verification while T_p <= 1
    assert predicted_speedup(1.0, 4.0, 2.0, 0.3, 9.0) == pytest.approx(4.0)
    assert expected_tokens_per_round(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens_per_round(1.0, 3) == 4.0


def test_critical_batch_size_bisection_equals_the_definition():
    """b* = the first b where fast >= neural, found by bisection; checked against the plain scan."""
    import random

    from saguaro_dist.spec.fallback import fast_backup_throughput, neural_backup_throughput

    def scan(p, th, tn, tf, t, m):
        return next((b for b in range(1, m + 1)
                     if fast_backup_throughput(b, p, th, tf) >= neural_backup_throughput(b, p, th, tn, t)), m)
    rng = random.Random(0)
    for _ in range(2000):
        args = (rng.random(), rng.uniform(1, 6), rng.uniform(1, 6), rng.uniform(1, 3),
                rng.choice([0.0, rng.uniform(0, 5)]), rng.choice([8, 64, 1024]))
        assert critical_batch_size(*args) == scan(*args), args
