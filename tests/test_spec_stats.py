"""SpecStats: online a, r, hit rate, tokens per round, times, and what they feed."""
import pytest
import torch

from saguaro_dist.config import FanOut
from saguaro_dist.spec import ProposalSource, SpecStats, Timing, critical_batch_size, geometric_fanout
from saguaro_dist.spec.stats import FAST_PRIOR_ROUNDS, acceptance_counts, expected_tokens_per_round, fit_miss_exponent

torch.set_num_threads(1)


def _geometric_rounds(a, k, n, seed):
    """k* of n rounds with i.i.d. per-token acceptance a: leading successes, capped at K."""
    gen = torch.Generator().manual_seed(seed)
    accept = torch.rand(n, k, generator=gen) < a
    return accept.to(torch.int64).cumprod(-1).sum(-1)


def test_defaults_before_data():
    s = SpecStats(k=4)
    assert (s.accept_rate, s.r, s.hit_rate) == (0.7, 0.5, 0.5)
    # untried, the fast backup is presumed as good as the draft: it gets tried before it is judged
    assert s.tokens_per_round(ProposalSource.FAST) == pytest.approx(expected_tokens_per_round(0.7, 4))
    assert s.tokens_per_round(ProposalSource.CACHE) == pytest.approx((1 - 0.7 ** 5) / 0.3)
    assert s.time(Timing.VERIFY) is None and s.relative_time(Timing.DRAFT) is None
    assert s.critical_batch_size() == 1024  # neural until its cost is measured


def test_acceptance_rate_is_the_unbiased_per_token_estimate():
    accepted = _geometric_rounds(0.6, 4, 20000, 0)
    successes, trials = acceptance_counts(accepted, 4)
    assert successes / trials == pytest.approx(0.6, abs=0.01)
    assert float(accepted.float().mean()) / 4 < 0.45  # the naive accepted/drafted is far lower
    s = SpecStats(k=4, decay=1.0)
    for chunk in accepted.split(500):
        s.record_verify(chunk, ProposalSource.NEURAL)
    assert s.accept_rate == pytest.approx(0.6, abs=0.01)
    assert s.mean_accepted(ProposalSource.NEURAL) == pytest.approx(float(accepted.float().mean()))


def test_fast_rounds_do_not_move_the_primary_acceptance_rate():
    s = SpecStats(k=4, decay=1.0)
    s.record_verify([4, 4, 4, 3], ProposalSource.CACHE)
    s.record_verify([0, 0, 0, 0, 0], ProposalSource.FAST)
    assert s.accept_rate == pytest.approx(15 / 16)
    prior = expected_tokens_per_round(15 / 16, 4)
    assert s.tokens_per_round(ProposalSource.FAST) == pytest.approx((5 + FAST_PRIOR_ROUNDS * prior) / (5 + FAST_PRIOR_ROUNDS))
    assert s.tokens_per_round(ProposalSource.CACHE) == pytest.approx(4.75)


def test_miss_exponent_fit_recovers_a_power_law():
    fanouts = [2, 4, 8, 16]
    misses = [f ** -0.7 for f in fanouts]
    assert fit_miss_exponent(fanouts, [m * 1000 for m in misses], [1000] * 4) == pytest.approx(0.7)
    assert fit_miss_exponent([1, 1], [3, 4], [10, 10]) is None


def test_stats_estimates_r_and_hit_rate_from_lookups():
    gen = torch.Generator().manual_seed(1)
    s = SpecStats(k=3, decay=1.0)
    fanouts = torch.tensor([1, 2, 4, 8])[torch.randint(4, (20000,), generator=gen)]
    hits = torch.rand(20000, generator=gen) >= fanouts.double() ** -0.8
    assert s.r == 0.5
    for f, h in zip(fanouts.split(1000), hits.split(1000)):
        s.record_lookups(f.tolist(), h.tolist())
    assert s.r == pytest.approx(0.8, abs=0.05)
    assert s.hit_rate == pytest.approx(float(hits.double().mean()))


def test_r_needs_enough_informative_lookups():
    s = SpecStats(k=3, min_lookups=32)
    s.record_lookups([1] * 100, [False] * 100)  # F = 1 says nothing about the exponent
    s.record_lookups([4] * 10, [True] * 10)
    assert s.r == 0.5


def test_times_feed_the_critical_batch_size_and_fanout():
    s = SpecStats(k=4, decay=1.0)
    for t in (0.1, 0.3):
        s.record_time(Timing.VERIFY, t)
    s.record_time(Timing.NEURAL_BACKUP, 0.01)
    assert s.time(Timing.VERIFY) == pytest.approx(0.2)
    assert s.relative_time(Timing.NEURAL_BACKUP) == pytest.approx(0.05)
    s.record_verify([4, 3, 4], ProposalSource.CACHE)
    s.record_verify([2], ProposalSource.NEURAL)
    s.record_verify([0, 1], ProposalSource.FAST)
    s.record_lookups([3, 3, 3, 3], [True, True, True, False])
    fast = (3 + FAST_PRIOR_ROUNDS * expected_tokens_per_round(s.accept_rate, 4)) / (2 + FAST_PRIOR_ROUNDS)
    want = critical_batch_size(0.75, 14 / 3, 3.0, fast, 0.05)
    assert s.critical_batch_size() == want
    assert s.fanout(FanOut.GEOMETRIC, 20, 1000) == geometric_fanout(20, 4, s.accept_rate, s.r)


def test_decay_tracks_drift():
    s = SpecStats(k=4, decay=0.5)
    for _ in range(20):
        s.record_verify([0] * 8, ProposalSource.NEURAL)
    for _ in range(20):
        s.record_verify([4] * 8, ProposalSource.NEURAL)
    assert s.accept_rate > 0.99


def test_outcome_probs_start_geometric_and_follow_the_verified_rounds():
    from saguaro_dist.spec import geometric_outcome_probs
    stats = SpecStats(k=4)
    assert stats.outcome_probs == pytest.approx(geometric_outcome_probs(4, stats.accept_rate))
    for _ in range(50):
        stats.record_verify([3, 3, 3, 0], ProposalSource.CACHE)
        stats.record_verify([4], ProposalSource.FAST)  # fast rounds are not the draft's outcomes
    p = stats.outcome_probs
    assert sum(p) == pytest.approx(1.0)
    assert p[3] > 0.65 and p[0] > 0.15 and p[4] < 0.1
    f = stats.fanout(FanOut.OUTCOME, 12, vocab_size=100)
    assert f[3] == max(f) and sum(f) == 12


def test_the_fast_backup_is_tried_before_it_is_judged():
    """At b = 1 with the neural backup timed, an untried fast backup is chosen (so it gets measured);
    once measured poor (prompt lookup finding nothing: 1 token a round), the neural one is."""
    s = SpecStats(k=4, decay=1.0)
    s.record_time(Timing.VERIFY, 0.003)
    s.record_time(Timing.NEURAL_BACKUP, 0.002)
    s.record_verify([4, 3, 2, 4, 0], ProposalSource.CACHE)
    s.record_verify([2, 3], ProposalSource.NEURAL)
    s.record_lookups([3] * 10, [True] * 7 + [False] * 3)
    assert s.critical_batch_size() == 1  # fast at every batch size: untried, presumed as good
    for _ in range(12):
        s.record_verify([0], ProposalSource.FAST)
    assert s.critical_batch_size() > 1  # measured poor: neural at b = 1


def test_the_wait_for_trees_is_the_round_cost_in_the_fallback_choice():
    """A draft slower than the verify: every round with trees costs verify + wait, and the neural
    backup's wait is judged against that (Theorem 7's max(1, T_p)), not against one verify."""
    s = SpecStats(k=4, decay=1.0)
    assert s.round_cost == 1.0
    s.record_time(Timing.VERIFY, 0.010)
    s.record_time(Timing.NEURAL_BACKUP, 0.014)
    s.record_verify([4, 3, 2, 0], ProposalSource.CACHE)
    s.record_verify([3, 2, 4, 2], ProposalSource.NEURAL)
    s.record_lookups([3] * 10, [True] * 4 + [False] * 6)
    for _ in range(20):
        s.record_verify([0], ProposalSource.FAST)  # prompt lookup when sampling: ~1 token a round
    assert s.critical_batch_size() == 1  # as if a round cost one verify: the fast backup at b = 1
    for wait in (0.004, 0.006):
        s.record_time(Timing.TREE_WAIT, wait)
    assert s.round_cost == pytest.approx(1.5)
    assert s.critical_batch_size() > 1  # the real cost: the neural backup at b = 1


def _timed_stats(neural_backup_s: float, hits_in_10: int) -> SpecStats:
    s = SpecStats(k=4, decay=1.0)
    s.record_time(Timing.VERIFY, 0.004)
    s.record_verify([4, 3, 2, 4, 0], ProposalSource.CACHE)
    s.record_verify([3, 2, 4, 2], ProposalSource.NEURAL)
    s.record_lookups([3] * 10, [True] * hits_in_10 + [False] * (10 - hits_in_10))
    s.record_time(Timing.NEURAL_BACKUP, neural_backup_s)
    return s


def test_the_backup_behind_is_explored_less_the_further_behind_and_the_more_measured():
    """The fallback's exploration (spec/fallback.py: explore_every) from the throughputs b* compares: every
    16th choice before the neural backup is timed; a fast backup measured far behind over many rounds
    (n-gram proposals when sampling: 1 token a round) every 128th; a neural backup timed slow once, still
    every 16th (it may have run beside a tree build), three times, every 48th."""
    from saguaro_dist.spec.fallback import EXPLORE_EVERY
    assert SpecStats(k=4).fallback_explore_every(1) == EXPLORE_EVERY  # the neural backup not timed yet
    sampling = _timed_stats(0.003, hits_in_10=1)  # most rounds miss: the backup decides
    for _ in range(40):
        sampling.record_verify([0], ProposalSource.FAST)
    assert sampling.critical_batch_size() > 1 and sampling.fallback_explore_every(1) == 8 * EXPLORE_EVERY
    repeating = _timed_stats(0.012, hits_in_10=1)  # prompt lookup finds the text: 4 of 4 a round
    for _ in range(20):
        repeating.record_verify([4], ProposalSource.FAST)
    assert repeating.critical_batch_size() == 1 and repeating.fallback_explore_every(1) == EXPLORE_EVERY
    for _ in range(2):
        repeating.record_time(Timing.NEURAL_BACKUP, 0.012)
    assert repeating.fallback_explore_every(1) == 3 * EXPLORE_EVERY
