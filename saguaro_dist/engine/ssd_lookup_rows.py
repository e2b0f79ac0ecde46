"""SSD's n-gram proposals row by row (a part of engine/ssd_loop.py's SSDLoop): the rows of a round that take
their n-gram proposal over the draft's (spec/lookup_pick.py), whole rounds of n-gram proposals alone
(engine/lookup_rounds.py), and the scoring of every proposal offered, verified or not."""
from __future__ import annotations

import torch

from saguaro_dist.config import FallbackPolicy
from saguaro_dist.engine.messages import Outcome, Proposal
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.spec import ProposalSource
from saguaro_dist.spec.fallback import ngram_lookup
from saguaro_dist.spec.lookup_pick import Guess, could_gain, pick_lookup_rows
from saguaro_dist.spec.tree_gate import RoundMode


class LookupRows:
    """SSDLoop's n-gram proposals (mixed into it, before SDLoop): they use its picker, gate, lookup_rounds,
    config and metrics, and this round's _mode, _sampled and _batch_size (and set its _lookup_round)."""

    def _lookups_alone(self, seqs: list[Sequence]) -> list[Outcome]:
        """The whole round on n-gram proposals, at the length that measures fastest (engine/lookup_rounds.py);
        the picker still scores each row's K-token proposal, which is what a row of a tree round would take."""
        found = self.lookup_rounds.lookups(seqs)
        for s, lookup in zip(seqs, found):
            self._offer_lookup(s, lookup)
        self._lookup_round = True
        return self._take_fast(seqs, self.lookup_rounds.propose(seqs, self._draft_room, found), FallbackPolicy.FAST)

    def _take_lookups(self, seqs: list[Sequence], hit_rate: float) -> tuple[list[Outcome], list[Sequence]]:
        """The rows that take their n-gram proposal over the draft's (their outcomes to stream), and the rest."""
        picked = self._pick_lookups(seqs, hit_rate) if self.picker else {}
        outcomes, rest = [], []
        for s in seqs:
            if s.seq_id in picked:
                outcomes += self._propose_here(s, picked[s.seq_id], ProposalSource.LOOKUP)
            else:
                rest.append(s)
        self.metrics.lookup_rows += len(picked)
        return outcomes, rest

    def _pick_lookups(self, seqs: list[Sequence], hit_rate: float) -> dict[int, Proposal]:
        """seq_id -> its n-gram proposal, for the rows spec/lookup_pick.py expects to gain more by it than by
        the draft's (hit_rate: of the draft's proposals for them, a tree's or one drafted now). Every row's
        proposal is offered, to be scored once its tokens are known; but after a pick in which none could have
        gained, only one pick in REST_PICKS offers (spec/lookup_pick.py)."""
        where = (self._mode, self._sampled, self._batch_size)
        if self.picker.rests(where):
            return {}
        guesses = [self._offer_lookup(s) for s in seqs]
        busy_s, wait_s = self.picker.round_times(where)
        draft_tokens = self.gate.draft_tokens_per_row(self._batch_size, self._sampled)
        wait_s = wait_s if self._may_skip_wait(len(seqs)) else None
        picks = pick_lookup_rows([self.picker.expected(g.key) for g in guesses], draft_tokens, hit_rate, busy_s, wait_s)
        if not any(picks) and not could_gain(self.picker.best_yield({s.params.greedy for s in seqs}), len(seqs),
                                              draft_tokens, hit_rate, busy_s, wait_s):
            self.picker.rest(where)
        return {s.seq_id: Proposal(torch.tensor(g.tokens, dtype=torch.long), None)
                for s, g, pick in zip(seqs, guesses, picks) if pick}

    def _may_skip_wait(self, rows: int) -> bool:
        """Whether this round may skip its wait by every row taking its lookup: only a whole round, and not a
        sampled tree round. The draft still builds the trees the round asks for; when sampled builds could not
        stop early, rounds that did not wait for them queued builds faster than they were made (b = 1,
        T = 0.7: a prefill then waited ~1 s for that queue, session 57). Only the one-host child stops them now
        (DraftWorker.finish_trees), and skipping was not measured again. Rounds of lookups alone are the
        gate's RoundMode.FAST, which asks for none."""
        return rows == self._batch_size and not (self._sampled and self._mode is RoundMode.TREES)

    def _offer_lookup(self, s: Sequence, found: tuple[list[int], int] | None = None) -> Guess:
        """s's K-token n-gram proposal, offered to the picker to be scored (whether it is verified or not);
        found: a longer lookup of s already made, (tokens, n), whose first K tokens it is."""
        k = self.config.k
        tokens, n = found or ngram_lookup(s.tokens, k, self.config.prompt_lookup_max, self.config.prompt_lookup_min)
        guess = Guess(s.num_tokens, tuple(tokens[:k]), (n, s.params.greedy))
        self.picker.offer(s.seq_id, guess)
        return guess

    def _fast_proposal(self, s: Sequence, kind: FallbackPolicy) -> Proposal:
        """The fast backup's n-gram proposals are scored too: rounds of them alone (RoundMode.FAST) are
        where the picker learns the text's n-gram yields before tree rounds come to use them."""
        if self.picker is None or kind is not FallbackPolicy.FAST:
            return super()._fast_proposal(s, kind)
        return Proposal(torch.tensor(self._offer_lookup(s).tokens, dtype=torch.long), None)

    def _score_lookups(self, seqs: list[Sequence]) -> None:
        """Score the n-gram proposals offered in earlier rounds whose tokens are now known."""
        if self.picker:
            for s in seqs:
                if self.picker.pending.get(s.seq_id):  # (s.tokens builds a list: only where a guess waits)
                    self.picker.observe(s.seq_id, s.tokens)
