"""The tree gate's pure rules (spec/tree_gate.py holds its state): its constants, the round modes and
a round's yield, and the choice and re-try schedule as pure functions of measured rates."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

BURST = 8             # rounds a mode keeps once chosen; the first TRANSITION_ROUNDS are not measured
TRANSITION_ROUNDS = 2  # a mode's first round is partly the last one's; its second pays the catch-up of the
                       # draft that sat idle (the tree side's KV, or the just-in-time worker's, runs every token
                       # since its last forward): one-host b = 1 greedy, a tree round 5.1 ms there against 3.6
                       # from the third on, a just-in-time round 4.9 against 4.4 (session 42)
RETRY_BURST = 5       # rounds of a re-try of a mode that was far behind (more than 2 x CLOSE_GAP)
EXPLORE_EVERY = 96    # rounds at one batch size between re-tries of the slower mode, while the two are close
INHERIT_LEAD = 16     # rounds a new batch size runs the mode that won at the nearest measured one before it
                      # tries the others: longer than a shrinking batch's stay at one size (1-6 rounds, b = 8)
CLOSE_GAP = 0.1       # modes within 10% are close; a slower one g behind is re-tried (g / CLOSE_GAP)^2 ...
MAX_STRETCH = 8       # ... times less often, at most 8 times (a lost mode is never lost for good); and twice
                      # as rarely again for each further re-try in a row that it lost (explore_interval)
SECONDS_DECAY = 0.9   # per round at the batch size: a mode's round time follows its last ~10 rounds, and a
                      # re-try after 96 rounds of the other replaces what was measured before
TOKENS_DECAY = 0.99   # tokens per row, and the fast backup's share of rows, follow the last ~100 rounds
CLIP = 1.5            # a round is counted at most 1.5x its mode's mean round ...
CLIP_AFTER = 3        # ... once the mode has that many measured rounds (a stall is not the mode's cost)
MIN_DRAFT_ROWS = 16   # draft rows measured at a batch size before their yield is offered to the lookup picker
HOLD = 4              # rounds a mode chosen again keeps before the next choice: the choice (~10 us, plus the
                      # n-gram estimate's ~5) ran every round once the bursts ended, ~0.5% of a 4.5 ms SD round at
                      # b = 1 for a choice the ~10-round means move little between rounds


@dataclass(frozen=True)
class RoundYield:
    """What a round gained: `tokens` over its `rows` (sequences), of which `fast_tokens` over
    `fast_rows` rows whose proposals came from the fast backup (n-gram or random), and `lookup_tokens`
    over `lookup_rows` rows that took their n-gram proposal over the draft's (spec/lookup_pick.py)."""
    rows: int
    tokens: int
    fast_rows: int = 0
    fast_tokens: int = 0
    lookup_rows: int = 0
    lookup_tokens: int = 0

    @property
    def draft_rows(self) -> int:
        return self.rows - self.fast_rows - self.lookup_rows

    @property
    def draft_tokens(self) -> int:
        return self.tokens - self.fast_tokens - self.lookup_tokens


class RoundMode(str, enum.Enum):
    TREES = "trees"                # SSD: the draft prepares a tree while the target verifies
    JUST_IN_TIME = "just_in_time"  # SD: the draft drafts after each outcome, no tree
    FAST = "fast"                  # the fast backup (n-gram) proposes for every sequence: no draft, no tree


TWO_MODES = (RoundMode.TREES, RoundMode.JUST_IN_TIME)
Estimate = Callable[[], "float | None"] | None  # a rate estimated on demand (TreeGate.mode's fast_estimate)


def choose_mode(rates: dict, explore: bool, last_run: dict | None = None) -> RoundMode:
    """The first unmeasured mode (in the gate's order: trees first), then the fastest, or when it is time
    to explore a slower one: the one run least lately (so a mode that lost once is not lost for good)."""
    unmeasured = [m for m, rate in rates.items() if rate is None]
    if unmeasured:
        return unmeasured[0]
    fastest = max(rates, key=rates.get)
    slower = [m for m in rates if m is not fastest]
    if not explore or not slower:
        return fastest
    return min(slower, key=lambda m: (last_run or {}).get(m, 0))


def nearest_first(batch_sizes, batch_size: int) -> list[int]:
    """The measured batch sizes, nearest to `batch_size` first, the smaller on a tie: what a new batch size
    learns from (a shrinking batch meets b - 1 after b; the gates' priors read the nearest)."""
    return sorted(batch_sizes, key=lambda b: (abs(b - batch_size), b))


def relative_gap(a: float, b: float) -> float:
    """How far the slower of two rates (or round times) is behind the faster, as a share of the faster."""
    return 1.0 - min(a, b) / max(a, b)


def far_behind(best: float, rate: float) -> bool:
    """Whether `rate` is more than 2 x CLOSE_GAP below `best` (noise and drift rarely close such a gap)."""
    return rate < best and relative_gap(best, rate) > 2 * CLOSE_GAP


def clearly_slower(estimate: float | None, rates: dict) -> bool:
    """Whether an estimated rate is far behind the best measured one (False without both)."""
    best = max((r for r in rates.values() if r is not None), default=None)
    return bool(estimate is not None and best and far_behind(best, estimate))


def burst_length(best_per_s: float | None, explored_per_s: float | None, explore: bool) -> int:
    """Rounds a newly chosen mode keeps: BURST, or RETRY_BURST for a re-try of a mode far behind. Such a
    re-try costs in proportion to its length and only has to notice that the gap closed (then the next
    re-try comes sooner, and is a full burst); three measured rounds do, against a gap over 20%."""
    if not explore or not best_per_s or not explored_per_s:
        return BURST
    return RETRY_BURST if far_behind(best_per_s, explored_per_s) else BURST


def explore_interval(best_per_s: float | None, slower_per_s: float | None, slower_bursts: int,
                     lost_in_a_row: int) -> float:
    """Rounds between re-tries of a slower mode: EXPLORE_EVERY while it is close to the best, up to
    MAX_STRETCH times that when it is far behind, as in a bandit's schedule: a re-try costs in proportion
    to the gap and is needed less the larger it is (noise and drift rarely close a 40% gap). But a gap
    counts only once a re-try of the mode confirmed it (lost_in_a_row: its re-tries in a row that did not
    win): a mode overtaken while it ran may have been measured in a stall of the box, and a gap read from
    it alone kept the mode that stalled out for ~700 rounds (b = 1, T = 0.7, session 73). Each further
    re-try lost doubles the stretch, as an arm's re-tries thin out while it keeps losing (UCB: log t of
    them by round t): a re-try also pays its two switches, which the rates leave out (TRANSITION_ROUNDS;
    there ~3 ms over a 6.4 ms round each). And a gap seen in few bursts may be a fluke (a cold start), so
    the stretch grows by at most one EXPLORE_EVERY per burst the slower mode has run."""
    if not best_per_s or not slower_per_s or lost_in_a_row < 1:
        return EXPLORE_EVERY
    by_gap = max(1.0, (relative_gap(best_per_s, slower_per_s) / CLOSE_GAP) ** 2) * 2 ** (lost_in_a_row - 1)
    return EXPLORE_EVERY * min(MAX_STRETCH, max(1, slower_bursts), by_gap)
