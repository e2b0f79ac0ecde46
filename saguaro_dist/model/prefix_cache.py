"""Automatic prefix caching: finished sequences' KV rows stay in the pool, and a new sequence whose
tokens begin with a kept sequence's copies that KV instead of computing it again (vLLM's automatic
prefix caching; here per stored sequence, as the pool holds a row per sequence, not blocks).

What it saves: a repeated system prompt, a chat's next turn (the previous prompt and reply), the n
samples of one prompt arriving one after another. Running sequences are sources too (`live`): requests
that share a system prompt while others with it are still generating copy it from them. The copy is of
the same keys and values a prefill of those tokens at those positions computes, so outputs do not
change (up to the last bits: a kept row's later positions may have been computed by a verify rather
than a prefill).

Namespaces: each sequence starts in one (any hashable; None by default), and only kept entries and live
sequences of the same namespace are its sources. The caller builds it (engine/sequence.py's cache_namespace:
vLLM's cache_salt), so that one tenant's time to first token never shows whether another sent a prompt.

Kept rows only ever use rows the pool has spare: a new sequence that finds none evicts the least
recently used entry other than its match rather than growing the pool (which on CUDA would drop every
captured graph); where the match is the only kept row, the new sequence takes that row over.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

MIN_REUSE = 16        # shorter matches are not worth a copy (vLLM's block size)
MAX_ENTRIES = 64      # bounds the lookup's scan


class PrefixCache:
    """Wraps a ModelRunner's add / free for whole sequences; `enabled=False` is plain add / free."""

    def __init__(self, runner, enabled: bool = True, min_reuse: int = MIN_REUSE, max_entries: int = MAX_ENTRIES):
        self.runner, self.enabled = runner, enabled
        self.min_reuse, self.max_entries = min_reuse, max_entries
        self.entries: OrderedDict[tuple, np.ndarray] = OrderedDict()  # runner id -> its tokens; oldest first
        self.namespaces: dict[Hashable, Hashable] = {}  # runner id (started or kept) -> its namespace
        self._ids = itertools.count()

    def start(self, seq_id: Hashable, tokens: Sequence[int], live: Mapping[Hashable, Sequence[int]] | None = None,
              namespace: Hashable = None, lora_slot: int | None = None) -> int:
        """Add seq_id to the runner with as much of `tokens`' KV as a kept entry or a live sequence of its
        namespace holds (never the last token: its logits are what a prefill is for). live: the caller's
        sequences in the runner -> their tokens (valid as far as each one's KV goes). Returns how many
        positions it holds. lora_slot: the runner's adapter slot it runs (its namespace must name the adapter)."""
        source, length = self._lookup(tokens, live or {}, namespace) if self.enabled else (None, 0)
        if self.enabled and self.runner.spare_rows() == 0 and self.entries:
            # The match is looked up first and spared: evicting the LRU entry blindly lost a hit that was the
            # entry itself (a pool of max_batch_size rows, as CUDA's, then never hit a repeated prompt).
            if not self._evict(spare=source):  # the match is the only kept row: seq_id takes it over
                if self.runner.lora_slot(source) == lora_slot:
                    return self._take_over(source, seq_id, length, namespace)
                self._evict()  # (KV of another adapter slot: never reused)
                source, length = None, 0
        if lora_slot is None:  # (the no-LoRA call stays the plain add every runner has)
            self.runner.add(seq_id)
        else:
            self.runner.add(seq_id, lora_slot=lora_slot)
        self.namespaces[seq_id] = namespace
        if not length:
            return 0
        if source in self.entries:
            self.entries.move_to_end(source)
        try:
            self.runner.copy_prefix(source, seq_id, length)
        except BaseException:  # (out of room for the copy) a failed start holds nothing: the id can start again
            self.namespaces.pop(seq_id, None)
            self.runner.free(seq_id)
            raise
        return length

    def _lookup(self, tokens: Sequence[int], live: Mapping[Hashable, Sequence[int]], namespace: Hashable
                ) -> tuple[Hashable, int]:
        """The source to copy from and how many positions (None, 0: none worth a copy)."""
        if reusable_len(len(tokens), len(tokens), self.min_reuse) == 0:  # too short to take any: no scan
            return None, 0
        source, match = self._longest_match(tokens, self._candidates(live, namespace))
        length = reusable_len(match, len(tokens), self.min_reuse)
        return (source, length) if length else (None, 0)

    def _take_over(self, key: Hashable, seq_id: Hashable, length: int, namespace: Hashable) -> int:
        """seq_id takes the kept entry `key`'s row, cut to `length` positions: the pool has no other row to copy
        it into (the row's KV is the prefix's already: nothing is copied; same namespace, same adapter slot)."""
        self.runner.rename(key, seq_id)
        del self.entries[key]
        self.namespaces.pop(key, None)
        self.namespaces[seq_id] = namespace
        try:
            self.runner.truncate(seq_id, length)
        except BaseException:  # a failed start holds nothing
            self.namespaces.pop(seq_id, None)
            self.runner.free(seq_id)
            raise
        return length

    def finish(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """seq_id is done; keep its row (in its namespace) while its KV holds `tokens`' first min(stored, len) positions."""
        namespace = self.namespaces.pop(seq_id, None)
        length = min(self.runner.length(seq_id), len(tokens))
        if not self.enabled or length < self.min_reuse:
            self.runner.free(seq_id)
            return
        key = ("prefix", next(self._ids))
        self.runner.rename(seq_id, key)
        try:
            self.runner.truncate(key, length)
        except BaseException:  # no entry names the renamed row: freed now, or it stayed taken for good
            self.runner.free(key)
            raise
        self.namespaces[key] = namespace
        self.entries[key] = np.asarray(tokens[:length], dtype=np.int64)
        while len(self.entries) > self.max_entries:
            self._evict()

    def clear(self) -> None:
        while self.entries:
            self._evict()

    def drop(self, doomed) -> None:
        """Free the kept entries whose namespace doomed(namespace) condemns (their adapter's slot was reloaded)."""
        for key in [k for k in self.entries if doomed(self.namespaces.get(k))]:
            del self.entries[key]
            self.namespaces.pop(key, None)
            self.runner.free(key)

    def _evict(self, spare: Hashable = None) -> bool:
        """Free the least recently used kept entry other than `spare`; False if there is none."""
        key = next((k for k in self.entries if k != spare), None)
        if key is None:
            return False
        del self.entries[key]
        self.namespaces.pop(key, None)
        self.runner.free(key)
        return True

    def _candidates(self, live: Mapping[Hashable, Sequence[int]], namespace: Hashable
                    ) -> Iterable[tuple[Hashable, np.ndarray]]:
        """Kept entries and live sequences of `namespace` (a live one started elsewhere is in None's)."""
        yield from ((key, stored) for key, stored in self.entries.items() if self.namespaces.get(key) == namespace)
        for key, tokens in live.items():
            if self.namespaces.get(key) != namespace:
                continue
            stored = min(self.runner.length(key), len(tokens))
            if stored >= self.min_reuse:
                yield key, np.asarray(tokens[:stored], dtype=np.int64)

    @staticmethod
    def _longest_match(tokens: Sequence[int], candidates: Iterable[tuple[Hashable, np.ndarray]]) -> tuple[Hashable, int]:
        """The candidate sharing the longest prefix with tokens, and that length."""
        query = np.asarray(tokens, dtype=np.int64)
        best, best_len = None, 0
        for key, stored in candidates:
            match = common_prefix_len(stored, query)
            if match > best_len:
                best, best_len = key, match
        return best, best_len


def reusable_len(match: int, prompt_len: int, min_reuse: int = MIN_REUSE) -> int:
    """Positions of a prompt a source sharing `match` tokens with it lends: never the prompt's last token (its
    logits are what a prefill is for), and none below min_reuse. One rule for PrefixCache.start and the engine's
    wait for a prefix about to be computed (engine._prefix_coming), so the two cannot drift apart."""
    length = min(match, prompt_len - 1)
    return length if length >= min_reuse else 0


def common_prefix_len(a: np.ndarray | Sequence[int], b: np.ndarray | Sequence[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n
