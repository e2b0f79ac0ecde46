"""The tree gate: trees first, then just-in-time rounds, then the faster one, re-trying the slower."""
import pytest

from saguaro_dist.spec.tree_gate import BURST, EXPLORE_EVERY, RoundMode, TreeGate, choose_mode

TREES, JIT = RoundMode.TREES, RoundMode.JUST_IN_TIME


@pytest.mark.parametrize("trees, jit, explore, want", [
    (None, None, False, TREES), (None, 5.0, False, TREES), (5.0, None, False, JIT),
    (5.0, 4.0, False, TREES), (4.0, 5.0, False, JIT), (5.0, 4.0, True, JIT), (4.0, 5.0, True, TREES),
])
def test_choose_mode(trees, jit, explore, want):
    assert choose_mode(trees, jit, explore) is want


def drive(gate: TreeGate, rounds: int, tokens_per_s: dict, batch: int = 1) -> list[RoundMode]:
    """Run `rounds` rounds in which mode m gains tokens_per_s[m] tokens per second."""
    modes = []
    for _ in range(rounds):
        mode = gate.mode(batch)
        gate.record(batch, mode, tokens=int(tokens_per_s[mode]), seconds=1.0)
        modes.append(mode)
    return modes


def test_measures_both_then_runs_the_faster_and_explores_the_slower():
    gate = TreeGate()
    modes = drive(gate, 2 * BURST + EXPLORE_EVERY, {TREES: 10, JIT: 20})
    assert modes[:BURST] == [TREES] * BURST and modes[BURST:2 * BURST] == [JIT] * BURST
    assert gate.rates(1) == {"trees": pytest.approx(10.0), "just_in_time": pytest.approx(20.0)}
    later = modes[2 * BURST:]
    assert later.count(TREES) == BURST  # one exploration burst in EXPLORE_EVERY rounds
    assert later[-1] is JIT


def test_a_change_in_speed_is_followed():
    gate = TreeGate()
    drive(gate, 4 * EXPLORE_EVERY, {TREES: 10, JIT: 20})
    modes = drive(gate, 4 * EXPLORE_EVERY, {TREES: 30, JIT: 20})
    assert modes[-EXPLORE_EVERY:].count(TREES) >= EXPLORE_EVERY - BURST  # all but an exploration burst


def test_batch_sizes_are_measured_apart():
    gate = TreeGate()
    drive(gate, 3 * BURST, {TREES: 30, JIT: 10}, batch=1)
    drive(gate, 3 * BURST, {TREES: 10, JIT: 30}, batch=8)
    assert gate.mode(1) is TREES and gate.mode(8) is JIT


def test_the_first_round_of_a_mode_is_not_measured():
    gate = TreeGate()
    mode = gate.mode(1)
    gate.record(1, mode, tokens=1000, seconds=1.0)  # a transition round: whatever it cost is ignored
    drive(gate, BURST - 1, {TREES: 10, JIT: 10})
    assert gate.rates(1)["trees"] == pytest.approx(10.0)
