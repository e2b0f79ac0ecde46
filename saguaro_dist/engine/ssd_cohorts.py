"""SSD's rounds of two cohorts without trees (a part of engine/ssd_loop.py's SSDLoop; the choice is
spec/cohorts.py's): the first cohort verifies while the second's drafts are made, and the first's next
drafts are made while the second verifies."""
from __future__ import annotations

from saguaro_dist.config import FallbackPolicy
from saguaro_dist.engine.messages import Outcome
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.spec.tree_gate import RoundMode


class CohortRounds:
    """SSDLoop's two cohorts (mixed into it, before SDLoop, whose verify each cohort runs): they use its
    cohort_gate, config, draft and metrics, and this round's _mode, _cohorts and _in_flight."""

    def _cohort_choice(self, batch_size: int) -> bool | None:
        """Whether this round, without trees, verifies two cohorts (spec/cohorts.py); None where there is
        no choice: trees, one sequence, misses proposed by the fast backup alone, or a draft side that
        cannot draft beside the verify (over gRPC, for now)."""
        if (self._mode is not RoundMode.JUST_IN_TIME or self.cohort_gate is None or batch_size < 2
                or self.config.fallback in (FallbackPolicy.FAST, FallbackPolicy.RANDOM) or not self.draft.drafts_beside):
            return None
        return self.cohort_gate.split(batch_size)

    def _split_cohorts(self, seqs: list[Sequence], new: list[Sequence], untreed: list[Sequence]) -> list[Outcome]:
        """Rows without a tree that take their n-gram proposal join the first cohort (with those whose drafts
        landed); the others' drafts are made beside it."""
        outcomes, untreed = self._take_lookups(untreed, hit_rate=1.0) if untreed else ([], [])
        return outcomes + self._start_cohorts(seqs, new + untreed)

    def _start_cohorts(self, seqs: list[Sequence], need: list[Sequence]) -> list[Outcome]:
        """Split the round: a first cohort of those holding their speculation (landed, looked up), a second
        of the rest, whose drafts are asked for now, to be drafted while the first verifies."""
        self.metrics.cohort_rounds += 1
        needed = {s.seq_id for s in need}
        ready, outcomes = [s for s in seqs if s.seq_id not in needed], []
        if not ready:  # the cohorts start: the first one's drafts now
            ready, need = need[:len(need) // 2], need[len(need) // 2:]
            outcomes = self._draft_or_fast(ready, FallbackPolicy.FAST)
        half = max(1, len(seqs) // 2)
        self._cohorts = (ready[:half], ready[half:] + need, self._ask_drafts(need, beside=True))
        return outcomes

    def _verify_cohorts(self, seqs: list[Sequence]) -> list[list[int]]:
        """The first cohort verifies while the second's drafts are made; then the first's next drafts are
        asked for (taken next round, _land) while the second verifies."""
        first, second, asked = self._cohorts
        self._cohorts = None
        gained = dict(zip([s.seq_id for s in first], super().verify(first)))
        self._in_flight = self._ask_drafts(first, beside=True)
        outcomes = self._take_drafts(asked, FallbackPolicy.FAST)
        if outcomes:
            self.draft.send_outcomes(outcomes)
        gained.update(zip([s.seq_id for s in second], super().verify(second)))
        return [gained[s.seq_id] for s in seqs]

    def _land(self, seqs: list[Sequence]) -> tuple[list[Outcome], set[int]]:
        """The drafts asked for the last round's first cohort: their outcomes (fast backups) to send and
        the ids of the sequences that now hold this round's speculation."""
        if self._in_flight is None:
            return [], set()
        # Not those prefilled again since (_readmit: no speculation): the drafts were asked of their earlier life.
        # Taken, an earlier life's outcome or speculation went to the new one, and the draft's stream failed.
        again = {s.seq_id for s in seqs if s.speculation is None}
        asked, self._in_flight = self._in_flight.among({s.seq_id for s in seqs} - again), None
        return self._take_drafts(asked, FallbackPolicy.FAST), {s.seq_id for s in asked.seqs}
