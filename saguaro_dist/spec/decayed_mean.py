"""A mean whose older values fade: what the gates (spec/tree_gate.py, cohorts.py, lookup_pick.py,
lookup_length.py) keep of each measured rate, round time and yield."""
from __future__ import annotations

from dataclasses import dataclass

from saguaro_dist.spec.gate_maths import CLIP, CLIP_AFTER


@dataclass
class DecayedMean:
    """Mean of the values added, the older ones fading by `decay` per value."""
    decay: float
    total: float = 0.0
    weight: float = 0.0
    count: int = 0
    last_round: int = 0  # add_round's: the round of the last value added

    def add_clipped(self, value: float) -> None:
        """Winsorized: one stall of the box (another process, a page fault; tens of ms against a round of
        a few) would move a ~10-round mean by more than the modes differ, and a mode measured during a
        stall then lost for hundreds of rounds. A miss's round (a just-in-time draft, ~1.5x a hit's at
        b = 1) is mostly under the clip: trees are favoured only where misses cost more than that."""
        mean = self.mean
        self.add(min(value, CLIP * mean) if self.count >= CLIP_AFTER and mean else value)

    def add_round(self, value: float, round_no: int) -> None:
        """add_clipped a round's seconds, `round_no` rounds into its batch size, first fading the mean by
        the rounds since the last one added. Seconds decay by rounds, not by measurements: a way last run
        long ago was measured on another load and text, and a short re-try must be able to replace that,
        not nudge it."""
        self.fade(max(0, round_no - self.last_round - 1))
        self.last_round = round_no
        self.add_clipped(value)

    def add_share(self, value: float, weight: float, round_no: int) -> None:
        """add `value` of `weight` observations, first fading the mean by the rounds since the last one
        added (as add_round, unclipped): for a share that follows a policy that learns, like the lookup
        picker's, which an old burst's share would understate for its ~100-round life."""
        self.fade(max(0, round_no - self.last_round - 1))
        self.last_round = round_no
        self.add(value, weight)

    def fade(self, steps: int) -> None:
        """Age the values by `steps` more decays without adding any (the mean stays where it was)."""
        self.total, self.weight = self.total * self.decay ** steps, self.weight * self.decay ** steps

    def add(self, value: float, weight: float = 1.0) -> None:
        """`value` is the sum of `weight` observations (tokens over rows, say); the mean is per weight."""
        self.total, self.weight = self.decay * self.total + value, self.decay * self.weight + weight
        self.count += 1

    @property
    def mean(self) -> float | None:
        return self.total / self.weight if self.weight else None


def first_mean(*means: DecayedMean) -> float:
    """The mean of the first of `means` with any weight; 1 if none has (a row gains at least its bonus token)."""
    return next((m.mean for m in means if m.weight), 1.0)
