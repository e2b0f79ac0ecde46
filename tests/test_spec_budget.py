"""The fan-out budget controller: shrink while the draft is on the critical path, grow back when idle."""
import pytest

from saguaro_dist.spec import BudgetController, DraftLoad, draft_load, next_budget_scale, scaled_budget


@pytest.mark.parametrize("idle_s, expected", [(0.0, 0.72), (0.05, 0.72), (0.2, 0.9), (0.6, 0.99)])
def test_next_scale_by_idle_share(idle_s, expected):
    # build 1 s: idle < 0.1 s shrinks (x0.8), idle in [0.1, 0.5] s holds, idle > 0.5 s grows (x1.1)
    assert next_budget_scale(0.9, 1.0, idle_s, floor=0.1) == pytest.approx(expected)


@pytest.mark.parametrize("target_wait_s, expected", [(0.0, 0.99), (0.05, 0.99), (0.2, 0.72)])
def test_a_target_that_reports_waiting_shrinks_the_scale_whatever_the_idle_gap(target_wait_s, expected):
    # Over gRPC the idle gap holds the link's round trip: 0.6 s here would read as slack on its own.
    assert next_budget_scale(0.9, 1.0, 0.6, floor=0.1, target_wait_s=target_wait_s) == pytest.approx(expected)


def test_scale_stays_within_floor_and_one():
    assert next_budget_scale(0.3, 1.0, 0.0, floor=0.3) == 0.3
    assert next_budget_scale(1.0, 1.0, 5.0, floor=0.3) == 1.0


def test_scaled_budget_keeps_one_branch_per_position():
    assert scaled_budget(12, 0.5, 5) == 6
    assert scaled_budget(12, 0.1, 5) == 5


class Clock:
    """A clock the test moves: the idle gaps the controller reads are exactly those it is told."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_controller_shrinks_when_outcomes_wait_and_recovers_when_idle():
    clock = Clock()
    c = BudgetController(floor=0.25, clock=clock)
    for _ in range(3):  # outcomes arrive the moment each build ends: the target waited on the draft
        c.tree_built(0.05)
        c.outcomes_arrived()
    assert c.scale == pytest.approx(0.8 ** 3)
    c.tree_built(0.001)
    clock.now += 0.01  # idle for 10x the build: the draft has room
    c.outcomes_arrived()
    assert c.scale == pytest.approx(0.8 ** 3 * 1.1)


def test_controller_ignores_gaps_filled_by_other_work_and_can_be_off():
    c = BudgetController(floor=0.25)
    c.tree_built(0.05)
    c.interrupted()  # a just-in-time draft ran in the gap
    c.outcomes_arrived()
    assert c.scale == 1.0
    off = BudgetController(floor=0.25, enabled=False)
    off.tree_built(0.05)
    off.outcomes_arrived()
    assert off.scale == 1.0


@pytest.mark.parametrize("idle_s, target_wait_s, load", [(0.05, 0.0, DraftLoad.BUSY), (0.6, 0.2, DraftLoad.BUSY),
                                                         (0.3, 0.0, DraftLoad.EVEN), (0.6, 0.0, DraftLoad.SLACK)])
def test_draft_load_by_idle_share_and_reported_wait(idle_s, target_wait_s, load):
    assert draft_load(1.0, idle_s, target_wait_s) is load


def test_busy_turns_on_when_the_target_waits_and_off_only_at_slack_even_with_adaptation_off():
    """HitGlue.AUTO reads `busy`: hysteresis, so a tree that got fast enough by skipping x_K (the draft now
    about even with the verify) does not flip back to the slower tree every other round."""
    clock = Clock()
    c = BudgetController(floor=0.25, enabled=False, clock=clock)
    c.tree_built(1.0)
    clock.now += 0.6  # slack by the gap, but the target reports it waited
    c.outcomes_arrived(target_wait_s=0.5)
    assert c.busy and c.scale == 1.0
    c.tree_built(1.0)
    clock.now += 0.3  # idle 0.3 of a build: EVEN
    c.outcomes_arrived()
    assert c.busy
    c.tree_built(0.001)
    clock.now += 0.01  # idle 10x the build: SLACK
    c.outcomes_arrived()
    assert not c.busy
