"""Which rows take their n-gram proposal over the draft's (spec/lookup_pick.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saguaro_dist.spec.fallback import ngram_lookup
from saguaro_dist.spec.lookup_pick import (
    MIN_SCORED, RECHECK_ROUNDS, REST_PICKS, Guess, LookupPicker, could_gain, pick_lookup_rows, score,
)
from saguaro_dist.spec.tree_gate import MIN_DRAFT_ROWS, TRANSITION_ROUNDS, RoundMode, RoundYield, TreeGate, _BatchGate


def test_a_row_takes_its_lookup_where_it_yields_more_than_the_draft():
    assert pick_lookup_rows([4.0, 2.0, None], 3.0, 0.8, 0.003, None) == [True, False, False]


def test_nothing_is_taken_before_the_draft_was_measured():
    assert pick_lookup_rows([5.0], None, 1.0, 0.003, 0.001) == [False]


def test_every_row_takes_its_lookup_when_skipping_the_tree_wait_pays():
    # alone: (2.5 + 2.5) / 2 ms = 2.5 a ms; mixed: (3 h + 2.5 (1 - h)) x 2 / 3 ms at h = 1 = 2.0 a ms
    assert pick_lookup_rows([2.5, 2.5], 3.0, 1.0, 0.002, 0.001) == [True, True]
    # a short wait: mixed (6 / 2.2 ms) beats alone (5 / 2 ms)
    assert pick_lookup_rows([2.5, 2.5], 3.0, 1.0, 0.002, 0.0002) == [False, False]


def test_a_missed_tree_falls_back_to_the_same_lookup():
    """At hit rate 0 a tree round gives the lookup's tokens anyway, and then skipping its wait always pays."""
    assert pick_lookup_rows([1.5], 3.0, 0.0, 0.002, 0.0001) == [True]
    assert pick_lookup_rows([1.5], 3.0, 1.0, 0.002, 0.0001) == [False]


def test_an_unmeasured_row_keeps_the_whole_round_on_trees():
    assert pick_lookup_rows([9.0, None], 3.0, 1.0, 0.002, 0.010) == [True, False]


def test_no_row_could_gain_only_when_even_the_best_yield_would_not_be_taken():
    assert not could_gain(1.1, 1, 3.4, 1.0, 0.0033, 0.0025)  # T = 0.7, b = 1: a lookup's ~1.1 tokens
    assert could_gain(3.5, 1, 3.4, 1.0, 0.0033, 0.0025)      # a row would take it
    assert could_gain(2.5, 2, 3.0, 1.0, 0.002, 0.001)        # the whole round would, to skip its wait
    assert could_gain(None, 1, 3.4, 1.0, 0.0033, 0.0025)     # an n not yet measured may be better
    assert could_gain(1.1, 1, None, 1.0, 0.0033, 0.0025)     # the draft's yield not yet measured


def test_the_best_yield_waits_for_every_n_of_those_rows_kinds():
    picker = LookupPicker()
    # guessed (5, 6) each time: the text [0, 9] gains 1 (the bonus), [0, 5, 9] 2, [0, 5, 6] 3 (both and the bonus)
    for key, text in (((1, False), [0, 9]), ((3, False), [0, 5, 9]), ((3, True), [0, 5, 6])):
        for i in range(MIN_SCORED):
            picker.offer(i, Guess(1, (5, 6), key))
            picker.observe(i, text)
    assert picker.best_yield({False}) == pytest.approx(2.0)
    assert picker.best_yield({False, True}) == pytest.approx(3.0)
    picker.offer(99, Guess(1, (5,), (2, False)))
    picker.observe(99, [0, 5])
    assert picker.best_yield({False}) is None  # n = 2 scored once: it could be the better


def test_after_a_hopeless_pick_only_one_in_rest_picks_offers():
    picker, where, other = LookupPicker(), (RoundMode.JUST_IN_TIME, True, 1), (RoundMode.TREES, True, 1)
    assert not picker.rests(where)
    picker.rest(where)
    assert [picker.rests(where) for _ in range(REST_PICKS)] == [True] * (REST_PICKS - 1) + [False]
    assert not picker.rests(other)


@pytest.mark.parametrize("guessed, sequence, want", [
    ((7, 8, 9), [1, 7, 8, 9], 4),    # every token right: K accepted and the bonus
    ((7, 8, 9), [1, 7, 5], 2),       # the second wrong: 1 accepted and the bonus
    ((7, 8, 9), [1, 6], 1),          # the first wrong: the bonus only
    ((7, 8, 9), [1, 7, 8], None),    # right so far, the last not yet known
    ((7, 8, 9), [1], None),
])
def test_a_guess_is_scored_once_its_tokens_show_it(guessed, sequence, want):
    assert score(Guess(1, guessed, (3, True)), sequence) == want


def test_the_picker_trusts_an_n_after_enough_scores():
    picker, key = LookupPicker(), (2, True)
    for i in range(MIN_SCORED):
        assert picker.expected(key) is None
        picker.offer(i, Guess(1, (5, 6), key))
        picker.observe(i, [0, 5, 9])
    assert picker.expected(key) == pytest.approx(2.0)  # one accepted and the bonus, each time


def test_the_picker_scores_one_guess_a_position_oldest_first():
    picker, key = LookupPicker(), (1, False)
    picker.offer(0, Guess(1, (5,), key))
    picker.offer(0, Guess(1, (5,), key))  # the fallback's offer of the same proposal
    picker.offer(0, Guess(2, (6,), key))
    picker.observe(0, [0, 5])
    assert len(picker.pending[0]) == 1 and picker.yields[key].count == 1
    picker.observe(0, [0, 5, 7])
    assert not picker.pending[0] and picker.yields[key].count == 2
    picker.forget(0)
    assert 0 not in picker.pending


def test_a_tree_rounds_time_is_kept_apart_from_its_wait():
    picker, where = LookupPicker(), (RoundMode.TREES, False, 1)
    assert picker.round_times(where) == (None, None)
    picker.record_round(where, 0.004, 0.001)
    picker.record_round(where, 0.003, None)  # every row took its lookup: no wait
    busy, wait = picker.round_times(where)
    assert busy == pytest.approx(0.003) and wait == pytest.approx(0.001)


def test_a_wait_not_measured_lately_is_stale_and_a_re_check_replaces_it():
    """Rounds whose every row took its lookup do not wait, so cannot update the wait; after RECHECK_ROUNDS of
    them it is unknown (the next round makes the per-row choice, which waits), and what that round measures
    replaces the wait measured before."""
    picker, where = LookupPicker(), (RoundMode.TREES, False, 1)
    for _ in range(10):
        picker.record_round(where, 0.012, 0.008)  # a stall: trees came 8 ms late
    for _ in range(RECHECK_ROUNDS):
        picker.record_round(where, 0.003, None)
        assert picker.round_times(where)[1] == pytest.approx(0.008)
    picker.record_round(where, 0.003, None)
    assert picker.round_times(where) == (pytest.approx(0.003, rel=0.2), None)
    picker.record_round(where, 0.0035, 0.0005)  # the re-check: trees now come in time
    assert picker.round_times(where)[1] == pytest.approx(0.0005)


def brute_force_lookup(tokens, k, max_n, min_n):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
        if starts:
            extended = list(tokens)
            for j in range(k):
                extended.append(extended[starts[-1] + n + j])
            return extended[len(tokens):], n
    return ([tokens[-1]] * k if tokens else [0] * k), 0


@pytest.mark.parametrize("tokens", [
    [], [4], [4, 4], [1, 2, 3, 1, 2], [1, 2, 3, 9, 2, 3], [256, 1, 0, 256, 1],
    [1, 256, 1, 256],                  # bytes of one token inside another's: no match there
    [65536, 0, 1, 65536], [3, 70000, 2, 3, 70000],
])
def test_ngram_lookup_matches_a_brute_force_search(tokens):
    assert ngram_lookup(tokens, 4) == brute_force_lookup(tokens, 4, 3, 1)
    assert ngram_lookup(tokens, 2, 2, 2) == brute_force_lookup(tokens, 2, 2, 2)


@settings(max_examples=500, deadline=None)
@given(tokens=st.lists(st.sampled_from([0, 1, 2, 256, 257, 65536, 65537, 2 ** 31 - 1, 2 ** 32]), max_size=24),
       k=st.integers(1, 6), sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)))
def test_ngram_lookup_is_the_brute_force_search_on_any_text(tokens, k, sizes):
    """Tokens whose bytes hold each other's (256 is 1 shifted a byte): rfind over the bytes finds such
    unaligned matches too, and they must be skipped."""
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    assert ngram_lookup(tokens, k, max_n, min_n) == brute_force_lookup(tokens, k, max_n, min_n)


def test_the_gate_counts_lookup_rows_apart():
    """A tree round's lookup rows are chosen for a good match: their tokens raise the tree mode's expected
    yield by their share, not the draft's yield (which the just-in-time mode shares)."""
    gate = _BatchGate(batch_size=2)
    gate.unmeasured = 0
    gate.record(RoundMode.TREES, RoundYield(rows=2, tokens=7, lookup_rows=1, lookup_tokens=5), 0.004)
    assert gate.draft_yield.mean == 2.0 and gate.lookup_yield.mean == 5.0
    assert gate.tokens_per_row(RoundMode.TREES) == pytest.approx(3.5)
    assert gate.tokens_per_row(RoundMode.JUST_IN_TIME) == pytest.approx(2.0)


def test_the_drafts_yield_reaches_the_picker_only_once_measured_over_enough_rows():
    """A few rows' mean is noise at T > 0 (1..K + 1 tokens a row): offered early, a low one made every row take
    its lookup, and the draft, no longer run, was not measured again."""
    gate = TreeGate()
    gate.mode(2, sampled=True)
    for _ in range(TRANSITION_ROUNDS + MIN_DRAFT_ROWS // 2 - 1):
        gate.record(2, RoundMode.TREES, RoundYield(rows=2, tokens=3), 0.01, sampled=True)
        assert gate.draft_tokens_per_row(2, sampled=True) is None
    gate.record(2, RoundMode.TREES, RoundYield(rows=2, tokens=3), 0.01, sampled=True)
    assert gate.draft_tokens_per_row(2, sampled=True) == pytest.approx(1.5)
    assert gate.draft_tokens_per_row(2) is None and gate.draft_tokens_per_row(4, sampled=True) is None


def test_the_pooled_yield_is_every_scored_proposal_of_greedy_or_sampling_rows():
    picker = LookupPicker()
    assert picker.pooled_yield(greedy=False) is None
    for i in range(MIN_SCORED):  # one-token guesses of 7, by a 1-gram at even positions, a 3-gram at odd ones
        picker.offer(1, Guess(i, (7,), (3 if i % 2 else 1, False)))
        picker.offer(2, Guess(i, (5,), (2, True)))
    picker.observe(1, [7, 0] * (MIN_SCORED // 2) + [0])  # the 1-gram's guesses right (2 tokens), the 3-gram's not (1)
    assert picker.pooled_yield(greedy=False) == pytest.approx(1.5)  # both n pooled
    assert picker.pooled_yield(greedy=True) is None                 # sequence 2's guesses not yet scored


def test_the_gates_lookup_share_follows_a_re_try_not_an_old_burst():
    """A tree burst before the picker had scores took no lookup; a re-try 100 rounds later, when it does,
    must be credited with its own share, as its round times are."""
    gate = _BatchGate(batch_size=1)
    gate.unmeasured = 0
    for gate.rounds in range(1, 7):
        gate.record(RoundMode.TREES, RoundYield(rows=1, tokens=3), 0.004)
    for gate.rounds in range(100, 103):
        gate.record(RoundMode.TREES, RoundYield(rows=1, tokens=5, lookup_rows=1, lookup_tokens=5), 0.003)
    assert gate.lookup_share[RoundMode.TREES].mean > 0.99
