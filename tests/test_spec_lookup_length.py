"""spec/lookup_length.py: the length of a round of n-gram proposals alone, from measured acceptance and verify
seconds."""
from __future__ import annotations

import pytest

from saguaro_dist.spec.lookup_length import (
    MIN_PROPOSALS, Acceptance, LookupLengths, best_length, candidate_lengths, estimated_seconds, expected_tokens,
)


def test_candidate_lengths_are_one_k_and_its_multiples():
    assert candidate_lengths(4) == (1, 4, 8, 12)
    assert candidate_lengths(1) == (1, 2, 3)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("length", [1, 4, 12])
def test_expected_tokens_is_one_plus_the_geometric_sum(alpha, length):
    assert expected_tokens(alpha, length) == pytest.approx(1 + sum(alpha ** i for i in range(1, length + 1)))


def test_best_length_runs_long_on_good_matches_and_short_on_poor_ones():
    seconds = lambda n: 1.0 + 0.04 * n  # noqa: E731 - a CPU-like verify, 4% more a token
    assert best_length([0.95], [1, 4, 8, 12], seconds) == 12
    assert best_length([0.01], [1, 4, 8, 12], seconds) == 1
    # Four rows, each token proposed costing four positions: one good match does not pay for three poor ones.
    assert best_length([0.95, 0.01, 0.01, 0.01], [1, 4, 8, 12], lambda n: 1.0 + 0.25 * n) == 1
    assert best_length([0.6], [1, 4, 8, 12], lambda n: 1.0) == 12  # a flat verify (a GPU's at a small batch): longest


def test_estimated_seconds_interpolates_extrapolates_and_never_falls_with_length():
    measured = {4: 5.0, 8: 6.0}
    assert estimated_seconds(measured, 4) == 5.0
    assert estimated_seconds(measured, 6) == pytest.approx(5.5)
    assert estimated_seconds(measured, 12) == pytest.approx(7.0)  # on the line through 4 and 8
    assert estimated_seconds(measured, 1) == pytest.approx(4.25)
    assert estimated_seconds({4: 5.0, 8: 4.0}, 12) == pytest.approx(4.0)  # noise made 8 cheaper: flat beyond, not falling
    assert estimated_seconds({4: 5.0}, 12, slope=0.05) == pytest.approx(5.0 * 1.4)  # one length: the prior slope
    assert estimated_seconds({12: 5.0}, 1, slope=0.5) == pytest.approx(2.5)  # floored at half the nearest


def test_acceptance_is_the_censored_geometric_fit():
    fit = Acceptance()
    for _ in range(MIN_PROPOSALS - 1):
        fit.add(2, 4)
    assert fit.rate is None  # too few proposals to trust
    fit.add(4, 4)  # all accepted: no rejection seen, so no trial failed
    successes, trials = 2 * (MIN_PROPOSALS - 1) + 4, 3 * (MIN_PROPOSALS - 1) + 4
    assert fit.rate == pytest.approx(successes / trials, rel=0.05)  # (the decay weighs recent proposals a little more)


def measured_lengths(alpha_by_n: dict[int, float], seconds: dict[int, float], k: int = 4) -> LookupLengths:
    lengths = LookupLengths(k)
    for n, alpha in alpha_by_n.items():
        for _ in range(MIN_PROPOSALS * 4):  # accepted counts whose censored fit is about alpha
            lengths.record([(n, True)], [round(alpha * k)], k, seconds.get(k, 1.0))
    for length, s in seconds.items():
        lengths.record([(0, False)], [0], length, s)
    return lengths


def test_choose_takes_k_until_the_rows_matches_were_measured_then_the_fastest():
    lengths = LookupLengths(4)
    assert lengths.choose([(3, True)], room=100) == 4
    lengths = measured_lengths({3: 1.0, 1: 0.0}, {4: 1.0, 8: 1.1, 12: 1.2})
    assert lengths.choose([(3, True)], room=100) == 12
    assert lengths.choose([(1, True)], room=100) == 1
    assert lengths.choose([(2, True)], room=100) == 4  # an n never measured: K, as before
    assert lengths.choose([(3, True)], room=9) == 8  # what the rows' KV, output and draft can take
    assert lengths.choose([(3, True)], room=3) == 1


def test_verify_seconds_are_kept_per_batch_size():
    lengths = measured_lengths({3: 1.0}, {4: 1.0})
    assert lengths.choose([(3, True), (3, True)], room=100) == 4  # b = 2 never measured: K
