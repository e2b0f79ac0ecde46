"""Rounds of n-gram proposals alone (mode ngram; SSD's RoundMode.FAST) at the length that measures fastest
(spec/lookup_length.py): the proposals, and the measurements that choose their length."""
from __future__ import annotations

import torch

from saguaro_dist.config import Config
from saguaro_dist.engine.messages import Proposal
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.spec.fallback import ngram_lookup
from saguaro_dist.spec.lookup_length import LookupLengths, candidate_lengths


class LookupRounds:
    """Proposes every row of a round by prompt lookup, all at one length (a verify scores [b, L + 1]); with
    config.adaptive_lookup_length off, at K. `max_len`: the target's KV capacity a sequence."""

    def __init__(self, config: Config, max_len: int):
        self.config, self.max_len = config, max_len
        self.lengths = LookupLengths(config.k)
        self._longest = max(candidate_lengths(config.k)) if config.adaptive_lookup_length else config.k
        self._round: tuple[list[tuple[int, bool]], int] | None = None  # this round's (n, greedy) per row, its length

    def lookups(self, seqs: list[Sequence]) -> list[tuple[list[int], int]]:
        """Each row's lookup at the longest length it may take, and the n of its match (spec.ngram_lookup: any
        shorter proposal is a prefix of it)."""
        return [ngram_lookup(s.tokens, self._longest, self.config.prompt_lookup_max, self.config.prompt_lookup_min)
                for s in seqs]

    def propose(self, seqs: list[Sequence], draft_room: int | None = None,
                found: list[tuple[list[int], int]] | None = None) -> list[Proposal]:
        """One proposal a row, of the round's length. draft_room: the longest sequence the draft keeps (its
        rows may not outgrow it by more than a K-token round would); None: no draft holds them. found: the
        rows' lookups() when the caller already made them."""
        found = found or self.lookups(seqs)
        keys = [(n, s.params.greedy) for s, (_, n) in zip(seqs, found)]
        length = self.config.k
        if self.config.adaptive_lookup_length:
            length = self.lengths.choose(keys, min(self._room(s, draft_room) for s in seqs))
        self._round = (keys, length)
        return [Proposal(torch.tensor(tokens[:length], dtype=torch.long), None) for tokens, _ in found]

    def record(self, seqs: list[Sequence], verify_s: float) -> None:
        """After the round's verify: each row's accepted count (s.last_outcome) and the verify's seconds."""
        if self._round is None:
            return
        (keys, length), self._round = self._round, None
        self.lengths.record(keys, [s.last_outcome[0] for s in seqs], length, verify_s)

    def _room(self, s: Sequence, draft_room: int | None) -> int:
        """The longest proposal s can take (at least K, as the engine keeps room for K): its KV holds
        num_tokens + L after the verify; held by a draft, it goes no further past draft_room than a round of K
        would (it leaves the draft there, engine/sd_loop.py). A row near its max_tokens is not a limit: its
        tokens past the end are dropped, and the other rows' proposals need not stop short for it."""
        room = self.max_len - s.num_tokens - 1
        if draft_room is not None and not s.beyond_draft:
            room = min(room, draft_room + self.config.k - s.num_tokens)
        return max(1, room)
