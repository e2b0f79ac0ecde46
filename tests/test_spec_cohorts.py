"""The cohort gate: both ways tried, then the one with the shorter round, the other re-tried now and then."""
import pytest

from saguaro_dist.spec.cohorts import FIRST_RETRY, INHERIT_LEAD, MAX_STRETCH, RETRY_EVERY, TRY_ROUNDS, CohortGate


def drive(gate: CohortGate, rounds: int, seconds: dict[bool, float], batch: int = 4) -> list[bool]:
    ways = []
    for _ in range(rounds):
        way = gate.split(batch)
        gate.record(batch, way, seconds[way])
        ways.append(way)
    return ways


@pytest.mark.parametrize("cohorts_faster", [True, False])
def test_tries_both_then_keeps_the_faster(cohorts_faster):
    gate = CohortGate()
    fast, slow = 0.010, 0.015
    ways = drive(gate, TRY_ROUNDS + FIRST_RETRY, {cohorts_faster: fast, not cohorts_faster: slow})
    assert ways[:TRY_ROUNDS] == [True] * TRY_ROUNDS and ways[TRY_ROUNDS:2 * TRY_ROUNDS] == [False] * TRY_ROUNDS
    assert set(ways[2 * TRY_ROUNDS:]) == {cohorts_faster}
    means = gate.means(4)
    assert means["cohorts" if cohorts_faster else "whole"] == pytest.approx(fast)


def test_retries_the_slower_way_and_follows_a_change():
    gate = CohortGate()
    drive(gate, RETRY_EVERY + 2 * TRY_ROUNDS, {True: 0.010, False: 0.0105})
    # Whole rounds got faster (another load, another text): the next re-try notices and switches.
    ways = drive(gate, 2 * RETRY_EVERY, {True: 0.010, False: 0.005})
    assert False in ways and ways[-1] is False


@pytest.mark.parametrize("whole_s, interval", [(0.0105, RETRY_EVERY), (0.0115, 1.70 * RETRY_EVERY),  # gap 1 - 10 / 11.5 = 0.13: (0.13 / 0.1)^2
                                                (0.020, MAX_STRETCH * RETRY_EVERY)])
def test_a_slower_way_far_behind_is_retried_less_often(whole_s, interval):
    gate = CohortGate()
    ways = drive(gate, 2 * TRY_ROUNDS + 6 * MAX_STRETCH * RETRY_EVERY, {True: 0.010, False: whole_s})
    retries = retry_starts(ways)[3:]  # past the doubling: FIRST_RETRY, 2x, 4x, then RETRY_EVERY
    assert len(retries) > 2 and all(b - a == pytest.approx(interval, abs=TRY_ROUNDS + 1) for a, b in zip(retries, retries[1:]))


def retry_starts(ways: list[bool]) -> list[int]:
    """The rounds at which whole rounds were re-tried after cohorts had been chosen."""
    return [i for i in range(2 * TRY_ROUNDS + 1, len(ways)) if not ways[i] and ways[i - 1]]


def test_the_first_retries_come_soon_then_twice_as_far_apart_each():
    gate = CohortGate()
    ways = drive(gate, 2 * TRY_ROUNDS + 2 * RETRY_EVERY + 4 * FIRST_RETRY, {True: 0.010, False: 0.0105})
    starts = retry_starts(ways)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert starts[0] - TRY_ROUNDS == pytest.approx(FIRST_RETRY, abs=1)  # from the start of whole's first try
    assert gaps[:3] == pytest.approx([2 * FIRST_RETRY, 4 * FIRST_RETRY, RETRY_EVERY], abs=TRY_ROUNDS + 1)


def test_an_early_fluke_is_undone_at_the_first_retry():
    """Cohort rounds measured during a stall lose the first choice; the first re-try, FIRST_RETRY rounds
    later, finds them faster and keeps them (it used to take RETRY_EVERY rounds)."""
    gate = CohortGate()
    drive(gate, TRY_ROUNDS, {True: 0.030, False: 0.0})  # the stall
    ways = drive(gate, FIRST_RETRY + 3 * TRY_ROUNDS, {True: 0.010, False: 0.013})
    assert ways[:FIRST_RETRY] == [False] * FIRST_RETRY and all(ways[FIRST_RETRY:])


def test_the_first_round_of_a_switch_is_not_measured():
    gate = CohortGate()
    drive(gate, TRY_ROUNDS, {True: 0.010, False: 0.0})
    gate.record(4, gate.split(4), 100.0)  # the switch to whole: a transition, ignored
    assert gate.means(4)["whole"] is None


def test_batch_sizes_choose_apart():
    gate = CohortGate()
    drive(gate, 3 * TRY_ROUNDS, {True: 0.010, False: 0.015}, batch=4)
    assert gate.means(2) == {"cohorts": None, "whole": None}


@pytest.mark.parametrize("cohorts_faster", [True, False])
def test_a_new_batch_size_starts_with_the_way_faster_at_the_nearest(cohorts_faster):
    """A shrinking batch meets b = 3, 2 after 4 for a few rounds each: they keep the way that won at 4, and
    try the other only after INHERIT_LEAD rounds."""
    seconds = {cohorts_faster: 0.010, not cohorts_faster: 0.015}
    gate = CohortGate()
    drive(gate, 3 * TRY_ROUNDS, seconds, batch=4)
    assert drive(gate, INHERIT_LEAD, seconds, batch=3) == [cohorts_faster] * INHERIT_LEAD
    assert drive(gate, 1, seconds, batch=3) == [not cohorts_faster]
    assert drive(gate, INHERIT_LEAD, seconds, batch=2) == [cohorts_faster] * INHERIT_LEAD


def test_the_first_two_rounds_of_a_way_are_not_measured():
    """The switch's round and the next, whose cohort pays the other half's catch-up: whatever they cost is ignored."""
    gate = CohortGate()
    for seconds in (1.0, 1.0, *[0.010] * (TRY_ROUNDS - 2)):
        gate.record(4, gate.split(4), seconds)
    assert gate.means(4)["cohorts"] == pytest.approx(0.010)
