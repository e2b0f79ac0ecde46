"""SSD's rounds without trees: the batch verified whole (SD's round) or as two cohorts, by measurement.

A round without a tree is SD's: the draft drafts, then the target verifies, and each waits for the
other. With the draft on hardware of its own, the batch can instead be verified as two cohorts A and
B: the draft drafts B's next speculation while the target verifies A, and A's while it verifies B.
Per round that costs max(V(A), D(B)) + max(V(B), D(A)) against SD's V(A + B) + D(A + B) (V a verify,
D a draft). Where a forward's cost grows with its batch (a CPU) the cohorts win; where it hardly does
(a GPU below its memory-bound limit) two half verifies cost nearly two whole ones and they lose. So
the choice is measured per batch size, as the tree gate does: both ways gain the same tokens per row
(the same drafts, verified alike), so seconds per round decide. Every token is verified exactly
either way; only the order of the work changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from saguaro_dist.spec.tree_gate import (
    CLIP_AFTER, CLOSE_GAP, INHERIT_LEAD, TRANSITION_ROUNDS, DecayedMean, nearest_first, relative_gap,
)

TRY_ROUNDS = 8        # rounds each way when it is (re-)tried; the first TRANSITION_ROUNDS are not measured: the
                      # switch's round and the second, which pays a catch-up (whole: the thread's draft worker runs
                      # what it missed; cohorts: the first cohort's drafts, asked beside the second's verify). b = 4,
                      # T = 0.7, the ways alternated every 8 rounds (session 73), ms a round: cohorts 13.3, 8.4, then
                      # 7.9; whole 9.6, 10.0, then 8.8
FIRST_RETRY = 16      # rounds to the first re-try of the slower way; each later one waits twice as long ...
RETRY_EVERY = 128     # ... up to this many rounds at one batch size, while the two are close;
MAX_STRETCH = 4       # up to 4x less often the further behind it is (a re-try costs in proportion to the gap)
SECONDS_DECAY = 0.9   # a way's round time follows its last ~10 rounds


@dataclass
class _BatchChoice:
    cohorts: bool = True        # the way the current rounds run
    left: int = TRY_ROUNDS      # rounds it keeps before the next choice
    unmeasured: int = TRANSITION_ROUNDS  # rounds of the current way still left out of its measurement
    rounds: int = 0             # rounds at this batch size so far
    retried_at: int = 0
    retries: int = 0            # re-tries of the slower way so far
    seconds: dict = field(default_factory=lambda: {w: DecayedMean(SECONDS_DECAY) for w in (True, False)})

    def next_round(self) -> bool:
        """The current way while its turn lasts; then the faster, an unmeasured one first, and the slower
        for TRY_ROUNDS now and then (_retry_interval: the box, the batch mix and the text change)."""
        self.rounds += 1
        if self.left > 0:
            self.left -= 1
            return self.cohorts
        faster = self.faster()
        if faster is None:  # the other way's first try: re-tries count from its start
            way, self.retried_at = not self.cohorts, self.rounds
        elif self.rounds - self.retried_at >= self._retry_interval():
            way, self.retried_at, self.retries = not faster, self.rounds, self.retries + 1
        else:
            way = faster
        if way is not self.cohorts:
            self.cohorts, self.unmeasured, self.left = way, TRANSITION_ROUNDS, TRY_ROUNDS - 1
        return way

    def record(self, cohorts: bool, seconds: float) -> None:
        if cohorts is not self.cohorts:
            return
        if self.unmeasured:  # a transition: its time is partly the other way's and the switch's (TRY_ROUNDS)
            self.unmeasured -= 1
            return
        self.seconds[cohorts].add_round(seconds, self.rounds)

    def _retry_interval(self) -> float:
        """FIRST_RETRY rounds, doubling with each re-try up to RETRY_EVERY, times (gap / CLOSE_GAP)^2 between
        1 and MAX_STRETCH (noise rarely closes a wide gap) but at most the re-tries so far (a wide gap
        seen once may be a fluke). The first choice rests on six rounds a way: one stall among them (the
        draft catching up after a prefill, another process) used to hold the wrong way for RETRY_EVERY
        rounds or more, a whole short run (b = 8, T = 0.7, session 54: ssd 0.95x sd in the one run of
        nine whose timed passes ran no cohort round). Early re-tries cost little while the gap is small."""
        gap = relative_gap(self.seconds[True].mean, self.seconds[False].mean)
        stretch = min(MAX_STRETCH, max(1, self.retries), max(1.0, (gap / CLOSE_GAP) ** 2))
        return min(RETRY_EVERY, FIRST_RETRY << min(self.retries, 16)) * stretch  # (16: a bounded shift)

    def faster(self) -> bool | None:
        """Whether cohorts run the shorter round; None while either way has fewer than CLIP_AFTER rounds."""
        split, whole = self.seconds[True], self.seconds[False]
        if split.count < CLIP_AFTER or whole.count < CLIP_AFTER:
            return None
        return split.mean < whole.mean


class CohortGate:
    """Per batch size: whether the next round without a tree verifies the batch as two cohorts."""

    def __init__(self):
        self._choices: dict[int, _BatchChoice] = {}

    def split(self, batch_size: int) -> bool:
        choice = self._choices.get(batch_size)
        if choice is None:
            choice = self._choices[batch_size] = self._new_choice(batch_size)
        return choice.next_round()

    def _new_choice(self, batch_size: int) -> _BatchChoice:
        """The way that was faster at the nearest batch size measured both ways starts, and keeps
        INHERIT_LEAD rounds before the other is tried: a shrinking batch meets each size for a few rounds
        only (spec/tree_gate.py, TreeGate._new_gate). Cohorts first where nothing was measured."""
        near = nearest_first(self._choices, batch_size)
        faster = next((f for b in near if (f := self._choices[b].faster()) is not None), None)
        return _BatchChoice() if faster is None else _BatchChoice(cohorts=faster, left=INHERIT_LEAD)

    def record(self, batch_size: int, cohorts: bool, seconds: float) -> None:
        """A finished round without a tree at `batch_size`, verified as two cohorts or not, in `seconds`."""
        choice = self._choices.get(batch_size)
        if choice is not None:
            choice.record(cohorts, seconds)

    def means(self, batch_size: int) -> dict[str, float | None]:
        """Mean seconds per round each way ("cohorts", "whole"); None until measured."""
        choice = self._choices.get(batch_size)
        return {("cohorts" if w else "whole"): (choice.seconds[w].mean if choice else None) for w in (True, False)}
