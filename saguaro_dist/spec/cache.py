"""The speculation cache S_T: prepared speculations keyed by (sequence, k, t*), latest round only."""
from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any


class SpeculationCache:
    """Per sequence, the branches of its latest round; older rounds are misses.

    Thread-safe: a transport thread may `put` while the round loop looks up. Values are opaque to
    put(); put_tree() stores a messages.SpeculationTree whole, and its lookups return the branch's
    messages.Proposal (made on lookup: one row, not one object per branch at every put).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[Hashable, tuple[int, Callable[[tuple[int, int]], Any]]] = {}  # seq -> (round, key -> value)
        self.hits = 0
        self.misses = 0

    def put(self, seq_id: Hashable, round: int, branches: Mapping[tuple[int, int], Any]) -> bool:
        """Store {(k, bonus_token): value} as seq_id's round `round`, replacing an older round.
        A round older than the stored one (a late delivery) is ignored; returns whether it was stored."""
        return self._store(seq_id, round, {(int(k), int(t)): value for (k, t), value in branches.items()}.get)

    def put_tree(self, tree) -> bool:
        """put() for a messages.SpeculationTree: outcome (accepted, bonus_token) -> that branch's proposal."""
        return self._store(tree.seq_id, tree.round, lambda key: tree.lookup(*key))

    def _store(self, seq_id: Hashable, round: int, entry: Callable[[tuple[int, int]], Any]) -> bool:
        with self._lock:
            current = self._entries.get(seq_id)
            if current is not None and current[0] > round:
                return False
            self._entries[seq_id] = (round, entry)
            return True

    def lookup(self, seq_id: Hashable, round: int, k: int, bonus: int) -> Any | None:
        """The value for outcome (k, bonus) of `round`, or None (counted as a miss) if absent or stale."""
        with self._lock:
            entry = self._entries.get(seq_id)
            value = entry[1]((int(k), int(bonus))) if entry is not None and entry[0] == round else None
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
            return value

    def latest_round(self, seq_id: Hashable) -> int | None:
        """The round stored for seq_id (to tell 'tree not here yet' from 'outcome not cached')."""
        with self._lock:
            entry = self._entries.get(seq_id)
            return None if entry is None else entry[0]

    def drop(self, seq_id: Hashable) -> None:
        with self._lock:
            self._entries.pop(seq_id, None)

    def __len__(self) -> int:
        """Number of sequences with a stored round."""
        with self._lock:
            return len(self._entries)

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0 before any lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def reset_counters(self) -> None:
        with self._lock:
            self.hits = 0
            self.misses = 0

