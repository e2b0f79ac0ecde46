"""The tree gate: trees first (or the mode that won at the nearest batch size), then just-in-time rounds, then the
faster one, re-trying the slower."""
import pytest

from saguaro_dist.spec.tree_gate import (
    BURST, EXPLORE_EVERY, HOLD, INHERIT_LEAD, MAX_STRETCH, RETRY_BURST, TRANSITION_ROUNDS, RoundMode, RoundYield, TreeGate, _BatchGate,
    choose_mode, explore_interval,
)

TREES, JIT, FAST = RoundMode.TREES, RoundMode.JUST_IN_TIME, RoundMode.FAST


@pytest.mark.parametrize("trees, jit, explore, want", [
    (None, None, False, TREES), (None, 5.0, False, TREES), (5.0, None, False, JIT),
    (5.0, 4.0, False, TREES), (4.0, 5.0, False, JIT), (5.0, 4.0, True, JIT), (4.0, 5.0, True, TREES),
])
def test_choose_mode(trees, jit, explore, want):
    assert choose_mode({TREES: trees, JIT: jit}, explore) is want


def test_choose_mode_explores_the_slower_mode_run_least_lately():
    rates = {TREES: 5.0, JIT: 4.0, FAST: 3.0}
    assert choose_mode(rates, False, {JIT: 10, FAST: 20}) is TREES
    assert choose_mode(rates, True, {JIT: 10, FAST: 20}) is JIT
    assert choose_mode(rates, True, {JIT: 30, FAST: 20}) is FAST
    assert choose_mode({TREES: 5.0, JIT: None, FAST: None}, False) is JIT  # unmeasured first, in order
    assert choose_mode({JIT: 4.0}, True) is JIT  # nothing slower to explore


def drive(gate: TreeGate, rounds: int, tokens_per_s: dict, batch: int = 1, tokens: dict | None = None) -> list[RoundMode]:
    """Run `rounds` rounds in which a round of mode m lasts 10 / tokens_per_s[m] seconds and gains
    tokens[m] tokens (default 10, so that its rate is tokens_per_s[m])."""
    modes = []
    for _ in range(rounds):
        mode = gate.mode(batch)
        gate.record(batch, mode, RoundYield(batch, (tokens or {}).get(mode, 10)), seconds=10 / tokens_per_s[mode])
        modes.append(mode)
    return modes


@pytest.mark.parametrize("trees, jit, bursts, lost, want", [
    (None, 5.0, 9, 1, EXPLORE_EVERY), (10.0, 10.5, 9, 1, EXPLORE_EVERY), (10.0, 9.0, 9, 1, EXPLORE_EVERY),
    (8.0, 10.0, 9, 1, 4 * EXPLORE_EVERY), (10.0, 5.0, 99, 1, MAX_STRETCH * EXPLORE_EVERY),
    (10.0, 5.0, 1, 1, EXPLORE_EVERY), (10.0, 5.0, 3, 1, 3 * EXPLORE_EVERY),  # few bursts: a gap may be a fluke
    (10.0, 5.0, 99, 0, EXPLORE_EVERY),  # no re-try confirmed the gap: it may be a stall's
    (10.0, 9.0, 99, 2, 2 * EXPLORE_EVERY), (10.0, 9.0, 99, 4, MAX_STRETCH * EXPLORE_EVERY),  # 2x per re-try lost
])
def test_the_slower_mode_is_retried_less_often_the_further_behind_it_is(trees, jit, bursts, lost, want):
    assert explore_interval(trees, jit, bursts, lost) == pytest.approx(want)


def test_measures_both_then_runs_the_faster_and_explores_the_slower():
    gate = TreeGate()
    modes = drive(gate, 2 * BURST + 2 * EXPLORE_EVERY, {TREES: 18, JIT: 20})  # close: re-tried every EXPLORE_EVERY
    assert modes[:BURST] == [TREES] * BURST and modes[BURST:2 * BURST] == [JIT] * BURST
    assert gate.rates(1) == {"trees": pytest.approx(18.0), "just_in_time": pytest.approx(20.0)}
    later = modes[2 * BURST:]
    assert later.count(TREES) == 2 * BURST  # one exploration burst in EXPLORE_EVERY rounds (at first: lost_in_a_row)
    assert later[-1] is JIT


def retry_starts(modes: list[RoundMode], mode: RoundMode) -> list[int]:
    return [i for i in range(1, len(modes)) if modes[i] is mode and modes[i - 1] is not mode]


def test_a_close_mode_that_keeps_losing_its_retries_is_retried_ever_more_rarely():
    """Each re-try lost in a row doubles the interval (up to the bursts run and MAX_STRETCH); one won resets it."""
    modes = drive(TreeGate(), 2 * BURST + 12 * EXPLORE_EVERY, {TREES: 19, JIT: 20})
    starts = retry_starts(modes, TREES)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert [round(g / EXPLORE_EVERY) for g in gaps] == [1, 2, 4]  # 2x per re-try lost after the first


def drive_one(gate: _BatchGate, rounds: int, tokens_per_s: dict) -> list[RoundMode]:
    """drive, for one batch size's gate."""
    modes = []
    for _ in range(rounds):
        modes.append(gate.next_round())
        gate.record(modes[-1], RoundYield(1, 10), seconds=10 / tokens_per_s[modes[-1]])
    return modes


def test_only_a_lost_retry_counts_against_a_mode():
    """A mode overtaken while it ran (a stall of the box can do that) lost no re-try: it is re-tried after
    EXPLORE_EVERY rounds whatever its gap (explore_interval with none lost); a re-try that loses counts."""
    gate = _BatchGate()
    drive_one(gate, 2 * BURST + EXPLORE_EVERY + BURST, {TREES: 18, JIT: 20})
    assert gate.lost == {**gate.lost, TREES: 1, JIT: 0}  # trees' re-try lost
    while drive_one(gate, 1, {TREES: 18, JIT: 12}) == [JIT]:  # JIT's rounds stall until trees take over
        pass
    assert gate.lost[JIT] == 0 and gate.lost[TREES] == 0
    after = drive_one(gate, 2 * EXPLORE_EVERY, {TREES: 18, JIT: 20})
    assert after.index(JIT) <= EXPLORE_EVERY and after[-1] is JIT


def test_a_far_slower_mode_is_retried_ever_more_rarely():
    gate = TreeGate()
    modes = drive(gate, 2 * BURST + 6 * EXPLORE_EVERY, {TREES: 30, JIT: 10})
    retries = [i for i in range(2 * BURST, len(modes)) if modes[i] is JIT and modes[i - 1] is TREES]
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert len(retries) == 3 and gaps[1] > gaps[0]  # after 1, 2, 3 x EXPLORE_EVERY rounds


def test_the_text_a_burst_happens_to_run_on_does_not_decide():
    """Tokens per round come from the text (both modes propose with the same draft); a re-try of the
    slower mode on an easy stretch (many tokens a round) must not make it look faster."""
    gate = TreeGate()
    drive(gate, 2 * BURST + EXPLORE_EVERY, {TREES: 30, JIT: 20})
    modes = drive(gate, 4 * EXPLORE_EVERY, {TREES: 30, JIT: 20}, tokens={TREES: 10, JIT: 25})
    assert modes.count(JIT) <= BURST


def test_a_change_in_speed_is_followed():
    gate = TreeGate()
    drive(gate, 4 * EXPLORE_EVERY, {TREES: 18, JIT: 20})
    modes = drive(gate, 4 * EXPLORE_EVERY, {TREES: 22, JIT: 20})
    assert modes[-EXPLORE_EVERY:].count(TREES) >= EXPLORE_EVERY - BURST  # all but an exploration burst


def test_batch_sizes_are_measured_apart():
    gate = TreeGate()
    drive(gate, 3 * BURST, {TREES: 30, JIT: 10}, batch=1)
    drive(gate, 3 * BURST, {TREES: 10, JIT: 30}, batch=8)
    assert gate.mode(1) is TREES and gate.mode(8) is JIT


def test_the_first_rounds_of_a_mode_are_not_measured():
    """The switch's round and the idle draft's catch-up round: whatever they cost is ignored."""
    gate = TreeGate()
    for _ in range(TRANSITION_ROUNDS):
        mode = gate.mode(1)
        gate.record(1, mode, RoundYield(1, 1000), seconds=1.0)
    drive(gate, BURST - TRANSITION_ROUNDS, {TREES: 10, JIT: 10})
    assert gate.rates(1)["trees"] == pytest.approx(10.0)


def test_a_batch_size_above_one_where_trees_clearly_lost_starts_just_in_time():
    gate = TreeGate()
    drive(gate, 3 * BURST, {TREES: 10, JIT: 30}, batch=2)          # trees lost at b = 2 by far
    modes = drive(gate, EXPLORE_EVERY + BURST, {TREES: 10, JIT: 30}, batch=8)
    assert modes[:EXPLORE_EVERY - 1] == [JIT] * (EXPLORE_EVERY - 1)  # no tree burst up front
    assert TREES in modes[EXPLORE_EVERY - 1:]                        # but trees are still tried, on schedule
    assert gate.rates(8)["trees"] is not None
    # A smaller batch size starts with the nearest's winner too, but trees, which may win there, soon follow.
    modes = drive(gate, INHERIT_LEAD + BURST, {TREES: 10, JIT: 30}, batch=1)
    assert modes == [JIT] * INHERIT_LEAD + [TREES] * BURST


@pytest.mark.parametrize("below", [{TREES: 30, JIT: 10}, {TREES: 19, JIT: 20}])
def test_trees_are_not_deferred_long_where_they_won_or_were_close_below(below):
    gate = TreeGate()
    drive(gate, 3 * BURST, below, batch=2)
    winner = max(below, key=below.get)
    other = JIT if winner is TREES else TREES
    modes = drive(gate, INHERIT_LEAD + BURST, {TREES: 10, JIT: 30}, batch=8)
    assert modes == [winner] * INHERIT_LEAD + [other] * BURST


@pytest.mark.parametrize("sampled", [False, True])
def test_a_shrinking_batch_keeps_the_mode_that_won_above_it(sampled):
    """A batch's sequences end a few rounds apart, so it meets b = 7, 6, ..., 1 for a few rounds each: every
    new size runs the mode that won at the size before, with no burst of the others."""
    gate = TreeGate(THREE)
    speeds = {TREES: 10, JIT: 30, FAST: 20}
    for _ in range(4 * BURST):
        mode = gate.mode(8, sampled)
        gate.record(8, mode, RoundYield(8, 10), seconds=10 / speeds[mode], sampled=sampled)
    tail = []
    for batch in range(7, 0, -1):
        for _ in range(INHERIT_LEAD // 3):
            tail.append(gate.mode(batch, sampled))
            gate.record(batch, tail[-1], RoundYield(batch, 10), seconds=10 / speeds[tail[-1]], sampled=sampled)
    assert tail == [JIT] * len(tail)


def test_one_stall_of_the_box_does_not_lose_the_faster_mode():
    """A round 20x its mode's usual length (another process took the core) counts as at most CLIP x:
    unclipped, it doubled a ~10-round mean and handed the slower mode the next ~100 rounds."""
    gate = TreeGate()
    drive(gate, 2 * BURST + BURST // 2, {TREES: 30, JIT: 22})
    assert gate.mode(1) is TREES
    gate.record(1, TREES, RoundYield(1, 10), seconds=20 * 10 / 30)  # the stall
    modes = drive(gate, EXPLORE_EVERY - 3 * BURST, {TREES: 30, JIT: 22})  # (up to the next exploration)
    assert modes == [TREES] * len(modes)


def test_rows_the_fast_backup_proposed_count_against_the_mode_that_has_them():
    """At T > 0 past the critical batch size, a tree round's misses go to the fast backup, whose rows
    gain ~1 token against the draft's ~3. A tree round here is a little shorter than a just-in-time
    one but gains 2 tokens a row, not 3: just-in-time is faster. Pooled over all rows, tokens per
    round made both modes look equally productive, and trees won on time alone."""
    gate, batch, modes = TreeGate(), 8, []
    for _ in range(2 * BURST + 2 * EXPLORE_EVERY):
        mode = gate.mode(batch)
        if mode is TREES:  # half the rows missed and took the fast backup
            gate.record(batch, mode, RoundYield(batch, 4 * 3 + 4 * 1, fast_rows=4, fast_tokens=4), seconds=1.0)
        else:
            gate.record(batch, mode, RoundYield(batch, 8 * 3), seconds=1.2)
        modes.append(mode)
    assert gate.rates(batch) == {"trees": pytest.approx(16.0), "just_in_time": pytest.approx(20.0)}
    assert modes[-1] is JIT and modes[2 * BURST:].count(TREES) <= 2 * BURST


@pytest.mark.parametrize("jit, want", [(20, BURST), (10, RETRY_BURST)])
def test_a_retry_of_a_mode_far_behind_is_short(jit, want):
    """Close modes (10%) are re-tried for a full burst; one 67% behind only long enough to notice a change."""
    modes = drive(TreeGate(), 2 * BURST + 8 * EXPLORE_EVERY, {TREES: 22, JIT: jit})[2 * BURST:]
    runs = "".join("j" if m is JIT else "t" for m in modes).split("t")
    assert {len(r) for r in runs if r} == {want}


def test_a_short_retry_still_notices_that_the_gap_closed():
    gate = TreeGate()
    drive(gate, 2 * BURST + 2 * EXPLORE_EVERY, {TREES: 30, JIT: 10})
    modes = drive(gate, 8 * EXPLORE_EVERY, {TREES: 30, JIT: 40})
    assert modes[-EXPLORE_EVERY:].count(JIT) >= EXPLORE_EVERY - BURST


THREE = (TREES, JIT, FAST)


def drive_three(gate: TreeGate, rounds: int, tokens_per_s: dict, batch: int = 1) -> list[RoundMode]:
    """drive, with a FAST round's rows all the fast backup's (as the engine records them)."""
    modes = []
    for _ in range(rounds):
        mode = gate.mode(batch)
        fast = batch if mode is FAST else 0
        gate.record(batch, mode, RoundYield(batch, 10, fast_rows=fast, fast_tokens=10 if fast else 0),
                    seconds=10 / tokens_per_s[mode])
        modes.append(mode)
    return modes


def test_with_n_gram_rounds_offered_each_mode_is_measured_then_the_fastest_runs():
    gate = TreeGate(THREE)
    modes = drive_three(gate, 3 * BURST + 4 * EXPLORE_EVERY, {TREES: 20, JIT: 18, FAST: 30})
    assert modes[:3 * BURST] == [TREES] * BURST + [JIT] * BURST + [FAST] * BURST
    assert gate.rates(1) == {"trees": pytest.approx(20.0), "just_in_time": pytest.approx(18.0), "fast": pytest.approx(30.0)}
    later = "".join(m.value[0] for m in modes[3 * BURST:])  # t, j, f
    assert later.count("f") > 0.8 * len(later) and later[-1] == "f"
    assert "t" in later and "j" in later  # both slower modes re-tried, in turn


def test_n_gram_rounds_that_gain_little_lose_though_they_are_short():
    """At T > 0 an n-gram round is short (no draft) but its proposals are rarely accepted: tokens per second
    decide, with a FAST round's tokens counted as the fast backup's."""
    gate, modes = TreeGate(THREE), []
    for _ in range(3 * BURST + 2 * EXPLORE_EVERY):
        mode = gate.mode(1)
        if mode is FAST:  # 1.2 tokens in 4 ms: 300 tok/s
            gate.record(1, mode, RoundYield(1, 1.2, fast_rows=1, fast_tokens=1.2), seconds=0.004)
        else:             # 3.5 tokens in 7 ms: 500 tok/s
            gate.record(1, mode, RoundYield(1, 3.5), seconds=0.007)
        modes.append(mode)
    assert gate.rates(1)["fast"] == pytest.approx(300.0) and modes[-1] is not FAST
    assert modes[3 * BURST:].count(FAST) <= 2 * RETRY_BURST


def test_deferred_trees_wait_while_the_modes_without_trees_are_measured():
    gate = TreeGate(THREE)
    drive_three(gate, 4 * BURST, {TREES: 10, JIT: 30, FAST: 29}, batch=2)  # trees lost at b = 2 by far
    modes = drive_three(gate, EXPLORE_EVERY + BURST, {TREES: 10, JIT: 30, FAST: 29}, batch=8)
    assert modes[:INHERIT_LEAD + BURST] == [JIT] * INHERIT_LEAD + [FAST] * BURST  # no tree burst up front
    assert TREES in modes[EXPLORE_EVERY - 1:]                    # but trees are still tried, on schedule


def test_a_mode_without_trees_that_lost_to_another_waits_at_the_next_batch_size_either_side():
    """A batch shrinking as its sequences end meets b = 7, 6, ... after b = 8: the proposals that lost there
    (n-gram or the draft's: the text decides, not the batch) wait for the schedule; trees, which may win at
    a smaller batch, are measured after the winner's INHERIT_LEAD rounds."""
    gate = TreeGate(THREE)
    drive_three(gate, 3 * BURST, {TREES: 20, JIT: 15, FAST: 30}, batch=8)
    modes = drive_three(gate, EXPLORE_EVERY + 4 * BURST, {TREES: 20, JIT: 15, FAST: 30}, batch=7)
    assert modes[:INHERIT_LEAD + BURST] == [FAST] * INHERIT_LEAD + [TREES] * BURST
    assert JIT not in modes[:EXPLORE_EVERY - 1] and JIT in modes  # tried on the schedule, once
    assert gate.rates(7)["just_in_time"] is not None


def test_a_mode_measured_alone_is_not_inherited_as_a_winner():
    """A few rounds at a size (a warm-up's) measure the first mode tried alone: that won nothing, and a new
    size nearby tries every mode a burst each, as a gate with nothing measured would, not INHERIT_LEAD rounds of it."""
    gate = TreeGate(THREE)
    drive_three(gate, BURST, {TREES: 10, JIT: 30, FAST: 20}, batch=2)
    assert gate.rates(2)["trees"] is not None and gate.rates(2)["just_in_time"] is None
    modes = drive_three(gate, 3 * BURST, {TREES: 10, JIT: 30, FAST: 20}, batch=8)
    assert modes == [TREES] * BURST + [JIT] * BURST + [FAST] * BURST


@pytest.mark.parametrize("estimate, tried", [(15.0, False), (None, True), (25.0, True), (40.0, True)])
def test_ngram_rounds_estimated_clearly_slower_are_not_tried(estimate, tried):
    """An estimate of rounds of n-gram proposals alone (every row's proposal scored against the text) more than
    2 x CLOSE_GAP below the best measured mode keeps them untried; none, or a close or better one, does not."""
    gate, modes = TreeGate(THREE), []
    speeds = {TREES: 10, JIT: 30, FAST: 20}
    for _ in range(EXPLORE_EVERY + 4 * BURST):
        mode = gate.mode(1, fast_estimate=lambda: estimate)
        fast = 1 if mode is FAST else 0
        gate.record(1, mode, RoundYield(1, 10, fast_rows=fast, fast_tokens=10 * fast), seconds=10 / speeds[mode])
        modes.append(mode)
    assert (FAST in modes) is tried
    assert modes[:2 * BURST] == [TREES] * BURST + [JIT] * BURST and TREES in modes[2 * BURST:]  # trees still re-tried


def test_a_mode_chosen_again_is_held_and_the_estimate_asked_only_while_it_can_matter():
    """Once the bursts end, the fastest mode is chosen again HOLD rounds at a time (the choice ran every round);
    the n-gram estimate is asked for only by choices made while n-gram rounds are unmeasured."""
    gate, asked, modes = TreeGate(THREE), [], []

    def estimate():
        asked.append(len(modes))
        return 25.0  # close to the best: n-gram rounds are tried, then measured
    choices = 0
    choose = _BatchGate._candidates

    def counted(self, fast_estimate=None):
        nonlocal choices
        choices += 1
        return choose(self, fast_estimate)
    _BatchGate._candidates = counted
    try:
        for _ in range(EXPLORE_EVERY):
            mode = gate.mode(1, fast_estimate=estimate)
            fast = 1 if mode is FAST else 0
            gate.record(1, mode, RoundYield(1, 10, fast_rows=fast, fast_tokens=10 * fast),
                        seconds=10 / {TREES: 10, JIT: 30, FAST: 20}[mode])
            modes.append(mode)
    finally:
        _BatchGate._candidates = choose
    assert modes[:3 * BURST] == [TREES] * BURST + [JIT] * BURST + [FAST] * BURST and set(modes[3 * BURST:]) == {JIT}
    assert choices <= 3 + (EXPLORE_EVERY - 3 * BURST) // HOLD + 1  # the three bursts' ends, then one choice a hold
    assert asked and max(asked) <= 2 * BURST  # not once n-gram rounds ran


def test_a_shrinking_batch_passes_on_the_winner_it_inherited():
    """b = 7, 6, 5 run b = 8's winner for a few rounds each, measuring it alone: each passes it on, so b = 5
    inherits it from b = 6, not trees from a b = 3 measured long before."""
    gate = TreeGate(THREE)
    drive_three(gate, 4 * BURST, {TREES: 30, JIT: 20, FAST: 10}, batch=3)  # trees won at b = 3
    drive_three(gate, 4 * BURST, {TREES: 10, JIT: 30, FAST: 20}, batch=8)  # just-in-time rounds at b = 8
    tail = [m for b in (7, 6, 5) for m in drive_three(gate, 3, {TREES: 10, JIT: 30, FAST: 20}, batch=b)]
    assert tail == [JIT] * 9


def test_sampled_and_greedy_batches_are_measured_apart():
    """n-gram rounds won on greedy traffic; at T > 0 they gain ~1 token a row: a sampled batch of the same
    size must not inherit that choice (nor the deferrals it implies)."""
    gate = TreeGate(THREE)
    drive_three(gate, 3 * BURST, {TREES: 20, JIT: 15, FAST: 30}, batch=4)
    assert gate.mode(4, sampled=True) is TREES and gate.rates(4, sampled=True)["fast"] is None
    drive_three(gate, 2 * BURST, {TREES: 20, JIT: 15, FAST: 30}, batch=4)
    assert gate.rates(4)["fast"] == pytest.approx(30.0)


def test_fast_rounds_and_a_tree_rounds_misses_are_rated_apart():
    """A miss's fast backup proposes K tokens after the draft's guess failed; a FAST round's row, the length
    its match earns (spec/lookup_length.py). Pooled, a burst of tree rounds' misses made FAST rounds look
    poor, and FAST rounds' long proposals made misses look good."""
    gate = _BatchGate(batch_size=1, mode=FAST, modes=THREE)
    gate.unmeasured = 0
    gate.record(FAST, RoundYield(1, 9, fast_rows=1, fast_tokens=9), 0.006)
    gate.mode = TREES
    gate.record(TREES, RoundYield(2, 5, fast_rows=1, fast_tokens=1), 0.006)
    assert gate.tokens_per_row(FAST) == pytest.approx(9)
    assert gate.tokens_per_row(TREES) == pytest.approx(0.5 * 4 + 0.5 * 1)


def test_a_gate_that_saw_only_lookup_rows_rates_the_others_at_their_yield():
    gate = _BatchGate(batch_size=1, mode=TREES, modes=THREE)
    gate.unmeasured = 0
    gate.record(TREES, RoundYield(1, 4, lookup_rows=1, lookup_tokens=4), 0.006)
    assert gate.tokens_per_row(JIT) == gate.tokens_per_row(FAST) == pytest.approx(4)
