"""Fan-out edges (spec/fanout.py): caps of 0 (a 1-token vocabulary's k < K), caps that cannot hold the
budget, non-finite ideals; every kind gives a fan-out within the candidates that exist, never raising."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from saguaro_dist.config import FanOut
from saguaro_dist.spec.branches import select_branches
from saguaro_dist.spec.fanout import outcome_fanout, resolve_fanout, round_to_budget, vocab_caps

FAST = settings(max_examples=200, deadline=None, derandomize=True)


@FAST
@given(st.integers(1, 6), st.data())
def test_round_to_budget_gives_zero_where_no_candidate_exists_and_one_or_more_elsewhere(n, data):
    """Old: a cap of 0 with a budget under len(ideal) raised although every position with a candidate got
    one; a NaN ideal raised (int(nan)); a negative cap gave F = -1."""
    caps = data.draw(st.lists(st.integers(-2, 12), min_size=n, max_size=n))
    live = sum(1 for c in caps if c > 0)
    budget = data.draw(st.integers(live, 40))
    ideal = data.draw(st.lists(st.floats(0, 50) | st.sampled_from([math.nan, math.inf]), min_size=n, max_size=n))
    f = round_to_budget(ideal, budget, caps)
    assert all(x == 0 if c <= 0 else 1 <= x <= c for x, c in zip(f, caps))
    assert sum(f) == min(budget, sum(max(c, 0) for c in caps))


@pytest.mark.parametrize("kind", list(FanOut))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_one_token_vocabulary_prepares_only_the_all_accepted_outcome(kind, k):
    """V = 1: the drafted token is the only token, so k* = K always and no bonus exists at k < K."""
    assert vocab_caps(k, 1) == [0] * k + [1]
    assert resolve_fanout(kind, 4 * (k + 1), k, 0.7, 0.5, 1) == [0] * k + [1]
    assert resolve_fanout(kind, [3] * (k + 1), k, 0.7, 0.5, 1) == [0] * k + [1]


@FAST
@given(st.sampled_from(list(FanOut)), st.integers(0, 6), st.integers(1, 5), st.data())
def test_resolve_fanout_stays_within_the_vocabulary_caps(kind, k, vocab, data):
    budget = data.draw(st.integers(k + 1, 60))
    a, r = data.draw(st.floats(0, 1)), data.draw(st.floats(0, 4))
    caps = vocab_caps(k, vocab)
    f = resolve_fanout(kind, budget, k, a, r, vocab)
    assert len(f) == k + 1 and sum(f) == min(budget, sum(caps))
    assert all(x == 0 if c == 0 else 1 <= x <= c for x, c in zip(f, caps))


def test_outcome_fanout_reads_a_non_finite_probability_as_no_mass():
    assert outcome_fanout(8, [math.nan, 0.5, 0.5], 0.5) == [1, 4, 3]
    with pytest.raises(ValueError, match="positive mass"):
        outcome_fanout(8, [math.nan, math.nan], 0.5)


def test_a_one_token_vocabulary_tree_selects_the_all_accepted_branch_alone():
    """Old: select_branches refused the F = 0 this fan-out gives (every tree build failed and logged)."""
    k = 3
    fanout = resolve_fanout(FanOut.GEOMETRIC, 4 * (k + 1), k, 0.7, 0.5, 1)
    branches = select_branches(torch.ones(2, k + 1, 1), torch.zeros(2, k, dtype=torch.long), fanout)
    assert branches.accepted.tolist() == [[k], [k]] and branches.bonus.tolist() == [[0], [0]]
    with pytest.raises(ValueError, match="summing to >= 1"):
        select_branches(torch.ones(1, k + 1, 1), torch.zeros(1, k, dtype=torch.long), [0] * (k + 1))
