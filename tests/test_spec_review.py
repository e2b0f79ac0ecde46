"""Review of spec/'s pure functions against docs (ssd-notes) and their own docstrings: regression tests for
the bugs found, and property tests of the formulas found correct."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from saguaro_dist.spec.branches import select_branches
from saguaro_dist.spec.fallback import critical_batch_size, fast_backup_throughput, neural_backup_throughput, ngram_lookup
from saguaro_dist.spec.fanout import geometric_fanout, geometric_outcome_probs, round_to_budget
from saguaro_dist.spec.lookup_length import expected_tokens
from saguaro_dist.spec.sampling import saguaro_probs, top_k_proposal
from saguaro_dist.spec.stats import SpecStats, acceptance_counts
from saguaro_dist.spec.theory import expected_tokens_per_round, predicted_speedup
from saguaro_dist.spec.tree_gate import RoundMode, RoundYield, _BatchGate
from saguaro_dist.spec.verify import acceptance_ratios, bonus_probs, verify

FAST = settings(max_examples=60, deadline=None, derandomize=True)


# --- bugs found -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("min_lookups", [0, -1])
def test_r_is_the_default_before_any_informative_lookup_whatever_min_lookups(min_lookups):
    """Old: with min_lookups <= 0 and no lookup at F >= 2 yet, `r` called fit_miss_exponent() with no
    arguments (zip of no bins) and raised TypeError; the docstring promises the default."""
    stats = SpecStats(3, min_lookups=min_lookups)
    assert stats.r == stats.defaults["r"]
    stats.record_lookups([1, 1], [True, False])  # fan-outs of 1 carry no information: still no bins
    assert stats.r == stats.defaults["r"]
    stats.record_lookups([4] * 10, [True] * 5 + [False] * 5)
    assert stats.r == pytest.approx(-math.log(0.5) / math.log(4))


def _gate_after(records: list[tuple[RoundYield, int]]) -> _BatchGate:
    gate = _BatchGate(batch_size=1)
    gate.unmeasured = 0
    for gained, times in records:
        for _ in range(times):
            gate.rounds += 1
            gate.record(RoundMode.TREES, gained, 0.01)
    return gate


def test_tokens_per_row_stays_a_mix_of_the_yields_when_rows_move_from_the_fast_backup_to_lookups():
    """Old: the fast share (decay 0.99) and the lookup share (0.9) summed to 1.59 here, so the draft's
    yield got weight -0.59: tokens per row -0.76 and a negative rate for tree rounds."""
    gate = _gate_after([
        (RoundYield(rows=1, tokens=1, fast_rows=1, fast_tokens=1), 100),      # misses on the fast backup
        (RoundYield(rows=1, tokens=4), 3),                                     # a few hits
        (RoundYield(rows=1, tokens=1, lookup_rows=1, lookup_tokens=1), 20),   # then lookups every round
    ])
    tokens = gate.tokens_per_row(RoundMode.TREES)
    assert 1.0 <= tokens <= 4.0
    assert gate.rate(RoundMode.TREES) > 0


_block = st.tuples(st.integers(1, 4), st.sampled_from(["fast", "lookup", "draft", "mixed"]), st.integers(0, 4),
                  st.integers(1, 120))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(_block, min_size=1, max_size=5))
@example([(1, "fast", 0, 100), (1, "draft", 3, 3), (1, "lookup", 0, 20)])
def test_tokens_per_row_is_within_the_yields_it_mixes(blocks):
    """Whatever the history, a mode's tokens per row is a convex mix of the measured yields (each row gains
    1..K+1 tokens); old code left that range whenever the two shares summed past 1."""
    records = []
    for rows, kind, extra, times in blocks:
        fast_rows = rows if kind == "fast" else rows // 3 if kind == "mixed" else 0
        lookup_rows = rows if kind == "lookup" else rows // 2 if kind == "mixed" else 0
        draft_rows = rows - fast_rows - lookup_rows
        records.append((RoundYield(rows=rows, tokens=(1 + extra) * draft_rows + fast_rows + 2 * lookup_rows,
                                   fast_rows=fast_rows, fast_tokens=fast_rows, lookup_rows=lookup_rows,
                                   lookup_tokens=2 * lookup_rows), times))
    gate = _gate_after(records)
    means = [m.mean for m in (gate.draft_yield, gate.fast_yield, gate.fast_round_yield, gate.lookup_yield) if m.weight]
    for mode in (RoundMode.TREES, RoundMode.JUST_IN_TIME):
        tokens = gate.tokens_per_row(mode)
        assert min(means + [1.0]) - 1e-9 <= tokens <= max(means + [1.0]) + 1e-9


# --- formulas checked and found correct ---------------------------------------------------------------------


@FAST
@given(st.integers(1, 6), st.data())
def test_round_to_budget_keeps_its_promises(n, data):
    budget = data.draw(st.integers(n, 40))
    ideal = data.draw(st.lists(st.floats(0, 50), min_size=n, max_size=n))
    caps = data.draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    f = round_to_budget(ideal, budget, caps)
    assert all(1 <= x <= c for x, c in zip(f, caps))
    assert sum(f) == min(budget, sum(caps))


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_a_budget_under_one_branch_per_position_is_refused_not_divided(budget):
    with pytest.raises(ValueError):
        geometric_fanout(budget, 3, 0.7, 0.5)


@FAST
@given(st.integers(0, 8), st.floats(0, 1), st.floats(0, 4))
def test_geometric_fanout_is_theorem_12_with_acceptance_at_its_edges(k, a, r):
    probs = geometric_outcome_probs(k, a)
    assert len(probs) == k + 1 and math.isclose(sum(probs), 1.0)
    budget = 10_000 * (k + 1)
    f = geometric_fanout(budget, k, a, r)
    assert len(f) == k + 1 and sum(f) == budget and min(f) >= 1
    a_c = min(max(a, 0.01), 0.99)
    ideal = [a_c ** (j / (1 + r)) for j in range(k)] + [a_c ** (k / (1 + r)) * (1 - a_c) ** (-1 / (1 + r))]
    floored = f.count(1)  # units the >= 1 floor takes come out of the other positions (F is the integer optimum)
    for fj, ij in zip(f, ideal):  # F_j / budget follows the paper's closed form up to rounding (and the >= 1 floor)
        assert abs(fj / budget - ij / sum(ideal)) <= (2 + floored) / budget + 1e-9 or fj == 1


@FAST
@given(st.integers(2, 6), st.integers(0, 10_000), st.floats(0.0, 1.0), st.integers(0, 6))
def test_verify_emits_the_target_for_the_q_the_draft_drew_from(v, seed, c, top_k):
    """Exact law of the first emitted token, from acceptance_ratios and bonus_probs themselves: a drafted
    x ~ q is kept with ratio(x), else the bonus comes from the residual; the sum must be p_1 (q = Saguaro's
    sigma after top-k, as the draft worker builds it)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(1, 2, v, generator=gen, dtype=torch.float64), -1)
    z = torch.softmax(3 * torch.randn(1, v, generator=gen, dtype=torch.float64), -1)
    q = top_k_proposal(saguaro_probs(z, min(2, v), c), top_k)[0]
    xs = torch.arange(v)[:, None]                                                   # every drafted token
    ratios = acceptance_ratios(p.expand(v, -1, -1), xs, q.expand(v, 1, -1))[:, 0]   # [V]
    rejected = bonus_probs(p.expand(v, -1, -1), xs, q.expand(v, 1, -1), torch.zeros(v, dtype=torch.long))
    law = q * ratios + (q * (1 - ratios)) @ rejected
    torch.testing.assert_close(law, p[0, 0], atol=1e-12, rtol=0)


def test_verify_is_seeded_per_row():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, 4, 7, generator=gen), -1)
    q = torch.softmax(torch.randn(3, 3, 7, generator=gen), -1)
    x = torch.randint(0, 7, (3, 3), generator=gen)
    runs = [verify(p, x, q, [torch.Generator().manual_seed(s) for s in (5, 6, 7)]) for _ in range(2)]
    alone = verify(p[1:2], x[1:2], q[1:2], [torch.Generator().manual_seed(6)])
    assert torch.equal(runs[0].accepted, runs[1].accepted) and torch.equal(runs[0].bonus, runs[1].bonus)
    assert runs[0].accepted[1] == alone.accepted[0] and runs[0].bonus[1] == alone.bonus[0]


@FAST
@given(st.integers(2, 8), st.integers(1, 7), st.sampled_from([0.0, 0.3, 1.0]), st.integers(0, 1000))
def test_saguaro_sigma_is_a_distribution_scaling_the_top_f_by_c(v, f, c, seed):
    z = torch.softmax(2 * torch.randn(3, v, generator=torch.Generator().manual_seed(seed)), -1)
    f = min(f, v)
    s = saguaro_probs(z, f, c)
    torch.testing.assert_close(s.sum(-1), torch.ones(3))
    top = z.topk(f, -1).indices
    w = torch.ones_like(z).scatter(1, top, c)
    expect = w * z / (w * z).sum(-1, keepdim=True)
    expect = torch.where((w * z).sum(-1, keepdim=True) > 0, expect, z)
    torch.testing.assert_close(s, expect)


@FAST
@given(st.integers(1, 5), st.integers(3, 9), st.integers(0, 1000), st.data())
def test_branches_are_keyed_by_outcome_and_never_the_drafted_token(k, v, seed, data):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(2, k + 1, v, generator=gen), -1)
    drafted = torch.randint(0, v, (2, k), generator=gen)
    fanout = [data.draw(st.integers(1, v - 1)) for _ in range(k)] + [data.draw(st.integers(1, v))]
    b = select_branches(probs, drafted, fanout)
    for row in range(2):
        keys = list(zip(b.accepted[row].tolist(), b.bonus[row].tolist()))
        assert len(set(keys)) == len(keys) == sum(fanout)
        for j in range(k + 1):
            cands = [t for kk, t in keys if kk == j]
            assert len(cands) == fanout[j]
            if j < k:
                assert drafted[row, j].item() not in cands
            others = [t for t in range(v) if t not in cands and (j == k or t != drafted[row, j].item())]
            assert all(probs[row, j, t] <= min(probs[row, j, c] for c in cands) for t in others)


def _reference_ngram(tokens, k, mx, mn):
    if not tokens:
        return [0] * k, 0
    for n in range(min(mx, len(tokens) - 1), mn - 1, -1):
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[-n:]:
                e = list(tokens)
                for j in range(k):
                    e.append(e[i + n + j])
                return e[len(tokens):], n
    return [tokens[-1]] * k, 0


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from([0, 1, 2, 255, 256, 257, 2 ** 40]), max_size=14), st.integers(1, 6),
       st.integers(1, 4), st.integers(1, 4))
def test_ngram_lookup_is_the_latest_earlier_match_longest_first(tokens, k, mx, mn):
    """The byte search (rfind over int64 bytes) agrees with a plain scan, also where a token's bytes
    straddle another's (256, 2**40)."""
    mn = min(mn, mx)
    assert ngram_lookup(tokens, k, mx, mn) == _reference_ngram(tokens, k, mx, mn)


@FAST
@given(st.lists(st.integers(0, 4), min_size=1, max_size=30))
def test_acceptance_counts_is_the_censored_geometric_mle(accepted):
    k = 4
    s, n = acceptance_counts(accepted, k)
    assert s == sum(accepted) and n == sum(accepted) + sum(a < k for a in accepted)


@FAST
@given(st.floats(0, 1), st.integers(0, 12))
def test_expected_tokens_agree_with_the_sum_and_between_modules(a, k):
    direct = sum(a ** i for i in range(k + 1))
    assert expected_tokens_per_round(a, k) == pytest.approx(direct, rel=1e-9)
    assert expected_tokens(a, k) == pytest.approx(direct, rel=1e-9)


def test_theorem_7_edges():
    assert predicted_speedup(1.0, 5.0, 1.0, 0.5, 9.0) == 5.0          # every hit, draft hidden
    assert predicted_speedup(1.0, 5.0, 1.0, 2.0, 9.0) == 2.5          # a draft slower than the verify
    assert predicted_speedup(0.0, 5.0, 3.0, 0.5, 0.5) == 2.0          # every miss: 3 tokens in 1 + T_b
    assert predicted_speedup(0.5, 4.0, 2.0, 1.0, 1.0) == pytest.approx(3.0 / 1.5)


@FAST
@given(st.floats(0, 1), st.floats(1, 8), st.floats(1, 8), st.floats(0, 8), st.floats(0, 5), st.floats(1, 3))
def test_critical_batch_size_is_the_first_batch_where_fast_wins(p, hit, neural, fast, t, cost):
    b = critical_batch_size(p, hit, neural, fast, t, max_batch=64, round_cost=cost)

    def fast_wins(n):
        return fast_backup_throughput(n, p, hit, fast, cost) >= neural_backup_throughput(n, p, hit, neural, t, cost)
    first = next((n for n in range(1, 65) if fast_wins(n)), 64)
    assert b == first
