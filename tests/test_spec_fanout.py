"""Fan-out allocation (Theorem 12), rounding to the budget, caps, and branch selection."""
import itertools

import pytest
import torch

from saguaro_dist.config import FanOut
from saguaro_dist.spec import (
    geometric_fanout, geometric_outcome_probs, outcome_fanout, resolve_fanout, round_to_budget, select_branches, uniform_fanout,
    full_acceptance_worth_skipping, without_full_acceptance,
)

torch.set_num_threads(1)


@pytest.mark.parametrize("budget, k, a, r", list(itertools.product([8, 12, 21, 64, 500], [1, 4, 7],
                                                                   [0.0, 0.3, 0.8, 0.95, 1.0], [0.0, 0.5, 2.0])))
def test_geometric_shape_budget_and_monotonicity(budget, k, a, r):
    if budget < k + 1:
        pytest.skip("budget below one branch per position")
    f = geometric_fanout(budget, k, a, r)
    assert len(f) == k + 1 and sum(f) == budget and min(f) >= 1
    assert all(x >= y for x, y in zip(f[:k], f[1:k]))  # non-increasing over the rejection positions


def test_geometric_follows_theorem_12_for_a_large_budget():
    a, r, k, budget = 0.7, 0.5, 5, 100_000
    f = geometric_fanout(budget, k, a, r)
    e = 1 / (1 + r)
    for j in range(1, k):
        assert f[j] / f[0] == pytest.approx(a ** (j * e), rel=1e-3)
    assert f[k] / f[0] == pytest.approx(a ** (k * e) * (1 - a) ** (-e), rel=1e-3)


def test_geometric_favours_the_all_accepted_position_when_acceptance_is_high():
    f = geometric_fanout(24, 4, 0.95, 0.5)
    assert f[-1] == max(f)
    assert geometric_fanout(24, 4, 0.2, 0.5)[0] == max(geometric_fanout(24, 4, 0.2, 0.5))


def test_uniform_fanout():
    assert uniform_fanout(12, 3) == [3, 3, 3, 3]
    assert uniform_fanout(14, 3) == [4, 4, 3, 3]
    assert sum(uniform_fanout(100, 6)) == 100


def test_round_to_budget_largest_remainder_and_caps():
    assert round_to_budget([2.6, 2.3, 1.1], 6) == [3, 2, 1]
    assert round_to_budget([0.2, 0.2, 5.6], 6) == [1, 1, 4]   # the minimum of one costs the big one
    assert round_to_budget([5.0, 5.0, 2.0], 12, caps=[3, 3, 10]) == [3, 3, 6]
    assert round_to_budget([5.0, 5.0], 12, caps=[3, 3]) == [3, 3]  # the caps cannot hold the budget
    with pytest.raises(ValueError):
        round_to_budget([1.0, 1.0, 1.0], 2)


def test_resolve_explicit_list_overrides_and_caps():
    assert resolve_fanout(FanOut.GEOMETRIC, (1, 2, 3), 2, 0.8, 0.5, 100) == [1, 2, 3]
    assert resolve_fanout("uniform", [9, 9, 9], 2, 0.8, 0.5, 5) == [4, 4, 5]
    with pytest.raises(ValueError):
        resolve_fanout(FanOut.UNIFORM, [1, 2], 2, 0.8, 0.5, 100)


def test_resolve_budget_by_kind_within_vocab():
    assert resolve_fanout(FanOut.UNIFORM, 12, 3, 0.8, 0.5, 1000) == [3, 3, 3, 3]
    assert resolve_fanout(FanOut.GEOMETRIC, 12, 3, 0.8, 0.5, 1000) == geometric_fanout(12, 3, 0.8, 0.5)
    small = resolve_fanout(FanOut.GEOMETRIC, 40, 3, 0.8, 0.5, 4)
    assert small == [3, 3, 3, 4]  # every candidate there is, and no more


# ---- branch selection -------------------------------------------------------------------------------

def test_branches_exclude_the_drafted_token():
    probs = torch.tensor([[[0.5, 0.3, 0.15, 0.05],    # x_1 = 0 drafted here
                           [0.1, 0.2, 0.3, 0.4],      # x_2 = 2
                           [0.25, 0.35, 0.3, 0.1]]])  # the all-accepted position
    out = select_branches(probs, torch.tensor([[0, 2]]), [2, 3, 2])
    assert out.accepted.tolist() == [[0, 0, 1, 1, 1, 2, 2]]
    assert out.bonus.tolist() == [[1, 2, 3, 1, 0, 1, 2]]
    assert probs[0, 0, 0] == 0.5  # the input is not modified


def test_branches_random_batch_shapes_and_exclusion():
    gen = torch.Generator().manual_seed(0)
    b, k, v = 6, 4, 9
    probs = torch.softmax(torch.randn(b, k + 1, v, generator=gen), dim=-1)
    tokens = torch.randint(v, (b, k), generator=gen)
    fanout = [8, 5, 3, 2, 9]
    out = select_branches(probs, tokens, fanout)
    assert out.accepted.shape == out.bonus.shape == (b, sum(fanout))
    for row in range(b):
        pairs = list(zip(out.accepted[row].tolist(), out.bonus[row].tolist()))
        assert len(set(pairs)) == len(pairs)
        for j, t in pairs:
            assert j == k or t != tokens[row, j]
        assert sorted(t for j, t in pairs if j == k) == list(range(v))
        # the top candidate at position 0 is the likeliest non-drafted token
        masked = probs[row, 0].clone()
        masked[tokens[row, 0]] = -1
        assert pairs[0] == (0, int(masked.argmax()))


def test_branches_reject_impossible_fanout():
    probs = torch.ones(1, 3, 4) / 4
    with pytest.raises(ValueError):
        select_branches(probs, torch.tensor([[0, 1]]), [4, 1, 1])  # only 3 non-drafted tokens
    with pytest.raises(ValueError):
        select_branches(probs, torch.tensor([[0, 1]]), [1, 1])


@pytest.mark.parametrize("budget, k, a, r", list(itertools.product([8, 12, 64, 10_000], [1, 4], [0.3, 0.8, 0.95], [0.0, 0.5, 2.0])))
def test_outcome_fanout_of_the_geometric_distribution_is_the_geometric_fanout(budget, k, a, r):
    assert outcome_fanout(budget, geometric_outcome_probs(k, a), r) == geometric_fanout(budget, k, a, r)


def test_outcome_fanout_follows_the_measured_distribution():
    probs = [0.18, 0.06, 0.15, 0.46, 0.15]  # the demo pair's greedy k* at K = 4: the 4th token is often wrong
    f = outcome_fanout(12, probs, 0.5)
    assert sum(f) == 12 and min(f) >= 1 and f[3] == max(f)
    big = outcome_fanout(100_000, probs, 0.5)
    assert big[3] / big[0] == pytest.approx((0.46 / 0.18) ** (1 / 1.5), rel=1e-3)
    with pytest.raises(ValueError):
        outcome_fanout(12, [0.0] * 5, 0.5)


def test_resolve_outcome_kind_uses_the_given_distribution_or_the_geometric_one():
    probs = [0.1, 0.1, 0.1, 0.6, 0.1]
    assert resolve_fanout(FanOut.OUTCOME, 12, 4, 0.8, 0.5, 100, probs) == outcome_fanout(12, probs, 0.5)
    assert resolve_fanout("outcome", 12, 4, 0.8, 0.5, 100) == geometric_fanout(12, 4, 0.8, 0.5)


def test_a_tree_without_full_acceptance_keeps_the_budget_and_answers_k_below_K():
    assert without_full_acceptance([5, 3, 2, 1, 1], vocab_size=10) == [5, 3, 2, 2]
    assert without_full_acceptance([8, 6], vocab_size=10) == [9]  # k = K - 1 still excludes x_K: V - 1 at most
    probs = torch.softmax(torch.randn(1, 3, 10), -1)  # K = 3, the glue's rows after b, x_1, x_2: none after x_3
    chosen = select_branches(probs, torch.tensor([[1, 2, 3]]), without_full_acceptance([3, 2, 2, 1], vocab_size=10))
    assert chosen.accepted.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert 3 not in chosen.bonus[0, 5:].tolist()  # a rejected x_3 is never the bonus at k = 2
    full = select_branches(torch.full((1, 2, 10), 0.1), torch.tensor([[4, 5]]), without_full_acceptance([2, 8, 3], 10))
    assert sorted(full.bonus[0, 2:].tolist()) == [t for t in range(10) if t != 5]


def test_full_acceptance_is_skipped_only_while_its_hits_are_worth_less_than_a_forward():
    fanout = [5, 3, 2, 1, 1]  # K = 4

    def model(r):
        return lambda f: 1 - f ** -r if f > 1 else (0.8 if f == 1 else 0.0)
    # a draft right to the end in 60% of rounds (the target as its own draft): keep k = K
    assert not full_acceptance_worth_skipping([0.1, 0.1, 0.1, 0.1, 0.6], fanout, model(1.0))
    # k = K rare, or its one branch rarely hits: skip
    assert full_acceptance_worth_skipping([0.3, 0.25, 0.2, 0.15, 0.1], fanout, model(1.0))
    assert full_acceptance_worth_skipping([0.1, 0.1, 0.1, 0.3, 0.4], fanout, lambda f: 0.05)
    # the lost hits net of what the moved branch gains at k = K - 1, times K, against 1
    probs, hit = [0.2, 0.2, 0.2, 0.2, 0.2], model(1.0)
    lost = 0.2 * hit(2) - 0.2 * (hit(4) - hit(2))
    assert full_acceptance_worth_skipping(probs, [2, 2, 2, 2, 2], hit) == (lost * 4 < 1)


def test_hit_probability_is_measured_where_seen_and_modelled_elsewhere():
    from saguaro_dist.spec import SpecStats
    stats = SpecStats(k=4, min_lookups=4)
    stats.record_lookups([1] * 10, [True] * 9 + [False])
    assert stats.hit_probability(1) == pytest.approx(0.9, abs=0.01)
    assert stats.hit_probability(4) == pytest.approx(1 - 4 ** -stats.r)
    assert stats.hit_probability(0) == 0.0
