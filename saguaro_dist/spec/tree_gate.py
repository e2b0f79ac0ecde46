"""Trees or just-in-time drafts, per batch size, by measurement.

SSD's tree pays only while the draft builds it within the target's verify. When it cannot (a big
batch, sampling at T > 0 where every branch carries a [K, V] distribution, or a draft that slows the
target by sharing its hardware), a round waits for the tree and plain speculative decoding (the draft
drafting K tokens after each outcome) is faster. Theorem 7 predicts this only from the times it is
given; the gate measures instead: tokens per second of rounds run each way, per batch size, running
the faster and re-trying the slower in short bursts, so a change (load, text, batch mix) is noticed.
Either way every token is verified exactly: the gate only chooses where proposals come from.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

BURST = 8            # rounds a mode keeps once chosen; the first is a transition and is not measured
EXPLORE_EVERY = 96   # rounds at one batch size between re-tries of the slower mode
DECAY = 0.9          # per measured round: a mode's rate follows its last ~10 rounds


class RoundMode(str, enum.Enum):
    TREES = "trees"                # SSD: the draft prepares a tree while the target verifies
    JUST_IN_TIME = "just_in_time"  # SD: the draft drafts after each outcome, no tree


@dataclass
class _Rate:
    """Decayed tokens and seconds: rate = tokens / seconds, old rounds fading by DECAY each."""
    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens, self.seconds = DECAY * self.tokens + tokens, DECAY * self.seconds + seconds
        self.rounds += 1

    @property
    def per_s(self) -> float | None:
        """None until a burst's worth of rounds was measured."""
        return self.tokens / self.seconds if self.rounds >= BURST - 1 and self.seconds > 0 else None


def choose_mode(trees_per_s: float | None, jit_per_s: float | None, explore: bool) -> RoundMode:
    """The unmeasured mode first (trees before just-in-time), then the faster one, or the slower one
    when it is time to explore (so a mode that lost once is not lost for good)."""
    if trees_per_s is None:
        return RoundMode.TREES
    if jit_per_s is None:
        return RoundMode.JUST_IN_TIME
    faster = RoundMode.TREES if trees_per_s >= jit_per_s else RoundMode.JUST_IN_TIME
    slower = RoundMode.JUST_IN_TIME if faster is RoundMode.TREES else RoundMode.TREES
    return slower if explore else faster


@dataclass
class _BatchGate:
    mode: RoundMode = RoundMode.TREES
    left: int = BURST            # rounds the current mode still runs before the next choice
    since_explore: int = 0
    fresh: bool = True           # the current round is the first of its mode (a transition)
    rates: dict = field(default_factory=lambda: {m: _Rate() for m in RoundMode})

    def next_round(self) -> RoundMode:
        self.since_explore += 1
        if self.left > 0:
            self.left -= 1
            return self.mode
        explore = self.since_explore >= EXPLORE_EVERY
        mode = choose_mode(self.rates[RoundMode.TREES].per_s, self.rates[RoundMode.JUST_IN_TIME].per_s, explore)
        if explore:
            self.since_explore = 0
        if mode is not self.mode:
            self.mode, self.fresh, self.left = mode, True, BURST - 1
        return mode


class TreeGate:
    """Per batch size: which RoundMode the next round runs, from the measured rounds of each."""

    def __init__(self):
        self._gates: dict[int, _BatchGate] = {}

    def mode(self, batch_size: int) -> RoundMode:
        gate = self._gates.get(batch_size)
        if gate is None:  # not setdefault: that would build a _BatchGate every round
            gate = self._gates[batch_size] = _BatchGate()
        return gate.next_round()

    def record(self, batch_size: int, mode: RoundMode, tokens: int, seconds: float) -> None:
        """A finished round of `mode` at `batch_size`: `tokens` gained in `seconds` (prepare + verify)."""
        gate = self._gates.get(batch_size)
        if gate is None or gate.mode is not mode:
            return
        if gate.fresh:  # its cost belongs partly to the previous mode's last round
            gate.fresh = False
            return
        gate.rates[mode].add(tokens, seconds)

    def rates(self, batch_size: int) -> dict[str, float | None]:
        gate = self._gates.get(batch_size)
        return {m.value: gate.rates[m].per_s if gate else None for m in RoundMode}
