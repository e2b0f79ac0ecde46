"""When the draft pool counts a worker dead, and how soon it asks a dead one back (distributed/draft_pool.py):
pure policy, no state, so each rule is read and tested on its own."""
from __future__ import annotations

REVIVAL_BACKOFF_MAX_S = 30.0
# A worker taken back that then stays in placement this long is no longer counted as flapping: its next revival
# starts the backoff over. Twice the longest delay: a worker whose every stay is shorter keeps the full backoff
# (it is taken back at most every ~30 s), one that served a minute since is back at once, as a first death is.
# Time, not rounds: the delays are in seconds, and an idle engine (no rounds) misses nothing meanwhile either.
REVIVAL_RESET_S = 2 * REVIVAL_BACKOFF_MAX_S
# Waits in a row, each to its deadline, in which a worker's part brought no tree before the pool marks it dead.
# Why more than one: a single late batch can be a slow round; two whole timeouts in a row are a stall, and
# without it a stalled worker whose just-in-time drafts are made elsewhere (the split executor) would cost
# every round that asks for trees the whole tree_timeout_s, for as long as it stalls.
LATE_TREE_WAITS_BEFORE_DEAD = 2


def revival_delay_s(revivals: int) -> float:
    """How long the pool waits before asking a worker back: at once the first time (Ray restarts a crashed
    actor in ~1.6 s here); doubling from 1 s after that, so a worker that keeps missing deadlines is not
    taken back, and its sequences moved off it again, every round."""
    return 0.0 if revivals == 0 else min(REVIVAL_BACKOFF_MAX_S, 2.0 ** (revivals - 1))


def revivals_counted(revivals: int, served_s: float | None, reset_s: float = REVIVAL_RESET_S) -> int:
    """The revivals a worker marked dead again backs off by: its revivals in a row, none once it served reset_s
    since it was last taken back (served_s; None: never taken back)."""
    return 0 if served_s is not None and served_s >= reset_s else revivals
