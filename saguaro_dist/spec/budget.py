"""Keep the tree build off the critical path: shrink the fan-out budget while the draft is slower
than the target's verify, grow it back while the draft idles.

Theorem 7's round time on a hit is max(1, T_p) verifies: once building the trees takes longer than a
verify (T_p > 1), every branch past the break-even point costs the target time instead of hiding
behind its verify. Two signals say the target waited on the draft: the target's own report (each
outcome carries how long it waited for that round's tree), and, with no link between them, an outcome
already waiting the moment a build ends (idle ~ 0). Over gRPC the idle gap alone misleads: it holds the
link's round trip (~1 ms on loopback), so the target could wait every round while the draft saw slack.
"""
from __future__ import annotations

import enum
import time
from typing import Callable

SHRINK = 0.8          # multiplicative decrease: the draft is on the critical path
GROW = 1.1            # slow increase back towards the configured budget
BUSY_IDLE_SHARE = 0.1  # idle < 10% of a build: the outcome was waiting, the target waited on us
SLACK_IDLE_SHARE = 0.5  # idle > 50% of a build: room for more branches


class DraftLoad(enum.Enum):
    BUSY = "busy"    # the target waited for the tree: the draft is on the critical path
    SLACK = "slack"  # the draft idled over half a build: room for more work
    EVEN = "even"    # neither: keep what you do


def draft_load(build_s: float, idle_s: float, target_wait_s: float = 0.0) -> DraftLoad:
    """BUSY if the target waited (target_wait_s or the idle gap under 0.1 build_s), SLACK if it did not
    and idle_s > 0.5 build_s, else EVEN."""
    busy = BUSY_IDLE_SHARE * build_s
    if target_wait_s > busy or idle_s < busy:
        return DraftLoad.BUSY
    return DraftLoad.SLACK if idle_s > SLACK_IDLE_SHARE * build_s else DraftLoad.EVEN


def next_budget_scale(scale: float, build_s: float, idle_s: float, floor: float, target_wait_s: float = 0.0) -> float:
    """scale' in [floor, 1]: x SHRINK when the draft is BUSY, x GROW when it has SLACK, else kept."""
    return _rescaled(scale, draft_load(build_s, idle_s, target_wait_s), floor)


def _rescaled(scale: float, load: DraftLoad, floor: float) -> float:
    scale *= SHRINK if load is DraftLoad.BUSY else GROW if load is DraftLoad.SLACK else 1.0
    return min(1.0, max(floor, scale))


def scaled_budget(budget: int, scale: float, minimum: int) -> int:
    """round(budget x scale), never below `minimum` (one branch per position: K + 1)."""
    return max(minimum, round(budget * scale))


class BudgetController:
    """The draft's budget scale. After each tree build the draft notes the time; when the next
    outcomes arrive, the idle gap since then says whether that build outlasted the target's verify."""

    def __init__(self, floor: float, enabled: bool = True, clock: Callable[[], float] | None = None):
        """clock: seconds, monotonic (default time.perf_counter; a test's own, so the idle gaps it reads are exact)."""
        self.scale, self.floor, self.enabled = 1.0, floor, enabled
        self._clock = clock or time.perf_counter
        self.busy = False  # the target waited for a recent tree and the draft has had no slack since (HitGlue.AUTO)
        self._built_at: float | None = None  # when the last tree build ended (None: no clean measurement)
        self._build_s = 0.0

    def tree_built(self, build_s: float) -> None:
        self._build_s, self._built_at = build_s, self._clock()

    def interrupted(self) -> None:
        """Other draft work (a just-in-time draft) ran after the build: the gap is not idle time."""
        self._built_at = None

    def outcomes_arrived(self, target_wait_s: float = 0.0) -> None:
        """target_wait_s: how long the target waited for the last tree built (0: not reported)."""
        if self._built_at is not None:
            idle_s = self._clock() - self._built_at
            load = draft_load(self._build_s, idle_s, target_wait_s)
            self.busy = load is DraftLoad.BUSY or (self.busy and load is DraftLoad.EVEN)  # off only at SLACK
            if self.enabled:
                self.scale = _rescaled(self.scale, load, self.floor)
        self._built_at = None
