"""Speculative speculative decoding's round loop: trees prepared while the target verifies, chosen
round by round against just-in-time drafts and n-gram proposals (spec/tree_gate.py), row by row
against n-gram proposals (spec/lookup_pick.py; the rows' part of the loop: engine/ssd_lookup_rows.py), with
two cohorts for rounds without trees (spec/cohorts.py; engine/ssd_cohorts.py) and the batch-aware fallback
for misses (spec/fallback.py).
"""
from __future__ import annotations

import logging
import time

from saguaro_dist.config import BonusDraw, Config, FallbackPolicy, TreePolicy
from saguaro_dist.engine.coupling import plan_coupling
from saguaro_dist.engine.lookup_rounds import LookupRounds
from saguaro_dist.engine.messages import Outcome
from saguaro_dist.engine.metrics import EngineMetrics, RoundTokens
from saguaro_dist.engine.sd_loop import AskedDrafts, SDLoop
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.engine.ssd_cohorts import CohortRounds
from saguaro_dist.engine.ssd_lookup_rows import LookupRows
from saguaro_dist.engine.stats_log import Throttle
from saguaro_dist.engine.target import TargetScorer
from saguaro_dist.model.cuda_graphs import graph_captures
from saguaro_dist.spec import ProposalSource, SpecStats, SpeculationCache, Timing, choose_fallback, explore_fallback
from saguaro_dist.spec.cohorts import CohortGate
from saguaro_dist.spec.lookup_pick import LookupPicker
from saguaro_dist.spec.tree_gate import RoundMode, RoundYield, TreeGate

log = logging.getLogger(__name__)
LATE_TREE_WARN_EVERY_S = 60.0
SOURCES = tuple(ProposalSource)  # the fixed order of _record_outcomes (iterating the enum costs more a round)


class SSDLoop(LookupRows, CohortRounds, SDLoop):
    """Speculative speculative decoding: trees are prepared while the target verifies, in the rounds
    the tree gate (spec/tree_gate.py) finds them faster than just-in-time drafts or n-gram proposals.
    TreeGate, LookupPicker and graph_captures are looked up in this module (tests swap them here)."""

    def __init__(self, target: TargetScorer, draft, metrics: EngineMetrics, config: Config):
        super().__init__(target, draft, metrics, config)
        self.stats = SpecStats(config.k)  # feeds the batch-aware fallback choice (Theorem 17)
        self.cache = SpeculationCache()
        self.gate = TreeGate(gate_modes(config)) if config.tree_policy is TreePolicy.AUTO else None
        # Rows of tree rounds may take their n-gram proposal where it measures better, as whole rounds may.
        self.picker = LookupPicker() if self.gate and RoundMode.FAST in gate_modes(config) else None
        # Whole rounds of n-gram proposals (RoundMode.FAST) propose the length that measures fastest.
        self.lookup_rounds = LookupRounds(config, target.runner.max_positions) if self.picker else None
        self._lookup_round = False  # this round is one: LookupRounds measures its verify
        self._wait_at_start = 0.0  # metrics.draft_wait_s as this round began: its wait for trees and drafts is the growth
        self._batch_size = 0  # this round's rows
        self.cohort_gate = CohortGate() if config.jit_cohorts == 2 else None
        self._mode, self._round_start, self._captures = RoundMode.TREES, 0.0, 0
        self._split: bool | None = None  # this round verifies two cohorts (None: not a choice this round)
        self._sampled = False  # a row of this round samples (T > 0)
        self._cohorts: tuple[list[Sequence], list[Sequence], AskedDrafts] | None = None  # first, second, the second's drafts
        self._in_flight: AskedDrafts | None = None  # the last round's first cohort's drafts, asked beside the second's verify
        self._fallback_choices = 0  # automatic fallback choices made (explore_fallback)
        self._late_warning = Throttle(LATE_TREE_WARN_EVERY_S)
        self._plan_wait_s = 0.0  # the last verify's wait for tree plans: with the wait for those trees, the round's
                                 # wait on the draft side (SpecStats.round_cost)

    def prepare(self, seqs):
        self._round_start, self._drafted_this_round, self._lookup_round = time.perf_counter(), False, False
        self._wait_at_start, self._captures = self.metrics.draft_wait_s, self._graph_captures()
        self._track_draft(seqs)
        self._score_lookups(seqs)
        outcomes, landed = self._land(seqs)
        self._mode, self._batch_size = self._round_mode(seqs), len(seqs)
        # Rounds that admit a sequence are measured too: its first draft is just in time in either mode,
        # and under steady arrivals skipping them could leave a mode unmeasured, hence chosen, for good.
        waiting = [s for s in seqs if s.seq_id not in landed]
        new = [s for s in waiting if s.speculation is None]
        treed = [s for s in waiting if s.speculation is not None and s.wants_tree]
        untreed = [s for s in waiting if s.speculation is not None and not s.wants_tree]
        for s in seqs:  # what the draft prepares while this round verifies (a landed draft asked for no tree)
            s.wants_tree = self._mode is RoundMode.TREES and not s.beyond_draft and s.seq_id not in landed
        self._split = self._cohort_choice(len(seqs))
        if self._split:
            outcomes += self._next_speculations(treed) if treed else []
            outcomes += self._split_cohorts(seqs, new, untreed)
        else:
            outcomes += self._draft_or_fast(new, FallbackPolicy.FAST) if new else []
            outcomes += self._next_speculations(treed) if treed else []
            outcomes += self._without_tree(untreed) if untreed else []
        # Even when empty if a tree is wanted: a one-host draft builds the trees of this round's
        # just-in-time drafts on it. The draft starts the next trees now, while we verify.
        if outcomes or self._mode is RoundMode.TREES:
            self.draft.send_outcomes(outcomes)

    def verify(self, seqs):
        verified_s, self._plan_wait_s = self.metrics.verify_s, 0.0
        gained = self._verify_cohorts(seqs) if self._cohorts else super().verify(seqs)
        self._count_round(seqs)
        # The target's forwards only: a round of two cohorts also waits for the second one's drafts.
        self.stats.record_time(Timing.VERIFY, self.metrics.verify_s - verified_s)
        if self._lookup_round:
            self.lookup_rounds.record(seqs, self.metrics.verify_s - verified_s)
        self._record_outcomes(seqs)
        if self._graph_captures() == self._captures:  # a round that captured a graph timed the capture
            seconds = time.perf_counter() - self._round_start
            if self.gate:
                self.gate.record(len(seqs), self._mode, round_yield(seqs, gained), seconds, self._sampled)
            if self._split is not None:
                self.cohort_gate.record(len(seqs), self._split, seconds)
            if self.picker and self._mode is not RoundMode.FAST:
                waited = self.metrics.draft_wait_s - self._wait_at_start
                self.picker.record_round((self._mode, self._sampled, len(seqs)), seconds, waited or None)
        return gained

    def _record_outcomes(self, seqs: list[Sequence]) -> None:
        """Each row's k* to the stats of the source that proposed it, sources in a fixed order (the decayed
        estimates are order-sensitive); one pass over the rows, a call per source present (~6 us each)."""
        accepted: dict[ProposalSource, list[int]] = {}
        for s in seqs:
            accepted.setdefault(s.speculation_kind, []).append(s.last_outcome[0])
        for source in SOURCES if len(accepted) > 1 else accepted:
            if source in accepted:
                self.stats.record_verify(accepted[source], source)

    def _coupling(self, seqs: list[Sequence]):
        """Coupled bonus draws (spec/coupled.py): after the forward, wait for the plans of the trees the draft
        builds beside this verify for its sampled rows, and draw their bonus against the candidates there."""
        if self.config.bonus_draw is not BonusDraw.COUPLED:
            return None
        keys = [(s.seq_id, s.round) for s in seqs
                if s.wants_tree and not s.params.greedy and not s.beyond_draft and not s.draft_lost]
        if not keys:
            return None

        def coupling():
            start = time.perf_counter()
            plans = self.draft.wait_plans(keys, self.config.tree_timeout_s)
            waited = time.perf_counter() - start
            self.metrics.plan_wait_s += waited
            self.metrics.draft_wait_s += waited
            self._plan_wait_s = waited
            coupling = plan_coupling(seqs, plans, self.config.k, self.target.vocab_size, self.target.runner.device)
            self.metrics.coupled_draws += 0 if coupling is None else int((coupling.candidates >= 0).any(-1).any(-1).sum())
            return coupling
        return coupling

    def _graph_captures(self) -> int:
        """CUDA-graph capture starts and ends so far, here and in the draft's own processes (a split or
        process draft's child, draft servers): a capture anywhere stalls the round that waits on it."""
        return graph_captures() + self.draft.graph_captures()

    def _count_round(self, seqs: list[Sequence]) -> None:
        """Count the round by kind: n-gram proposals alone, waiting for no tree and no draft (the gate's
        RoundMode.FAST, or a round whose every row took its n-gram proposal; a sequence admitted in the
        round was drafted: not such a round), else the gate's rounds without trees. Its tokens count once
        the engine kept them (EmittedTokens: not those past an end inside the round)."""
        alone = not self._drafted_this_round
        if alone and self._mode is RoundMode.FAST:
            self.metrics.fast_rounds += 1
            self.emitted.note(seqs, RoundTokens.FAST)
        elif alone and all(s.speculation_kind is ProposalSource.LOOKUP for s in seqs):
            self.metrics.lookup_rounds += 1
            self.emitted.note(seqs, RoundTokens.LOOKUP)
        elif self._mode is RoundMode.JUST_IN_TIME:
            self.metrics.just_in_time_rounds += 1

    def _round_mode(self, seqs: list[Sequence]) -> RoundMode:
        if self.gate:
            self._sampled = any(not s.params.greedy for s in seqs)  # the gate measures such batches apart
            return self.gate.mode(len(seqs), self._sampled, lambda: self._fast_estimate(len(seqs)))
        return RoundMode.JUST_IN_TIME if self.config.tree_policy is TreePolicy.NEVER else RoundMode.TREES

    def _fast_estimate(self, rows: int) -> float | None:
        """For a sampled batch, tokens per second a round of n-gram proposals alone would run at: every sampled
        row's K-token proposal scored against the text (LookupPicker.pooled_yield) over the busy part of an SD
        round here, a verify and no wait; None before both are measured. Not for greedy batches: there a long
        match is proposed 2K or 3K tokens deep (engine/lookup_rounds.py) and gains more than its K-token
        score, while at T > 0 a proposal rarely runs past its first tokens."""
        if self.picker is None or not self._sampled:
            return None
        tokens = self.picker.pooled_yield(greedy=False)
        busy_s, _ = self.picker.round_times((RoundMode.JUST_IN_TIME, True, rows))
        return rows * tokens / busy_s if tokens and busy_s else None

    def _without_tree(self, seqs: list[Sequence]) -> list[Outcome]:
        """No tree was asked for: the draft drafts now (SD's round), but for the rows whose n-gram proposal
        should gain more; or the fast backup (forced, or the tree gate measured its rounds faster:
        RoundMode.FAST)."""
        if self.config.fallback in (FallbackPolicy.FAST, FallbackPolicy.RANDOM):
            return self._fast(seqs, self.config.fallback)
        if self._mode is RoundMode.FAST:
            return self._lookups_alone(seqs) if len(seqs) == self._batch_size else self._fast(seqs, FallbackPolicy.FAST)
        outcomes, rest = self._take_lookups(seqs, hit_rate=1.0)  # a just-in-time draft always answers
        return outcomes + (self._draft_or_fast(rest, FallbackPolicy.FAST) if rest else [])

    def _next_speculations(self, seqs: list[Sequence]) -> list[Outcome]:
        """Rows whose n-gram proposal should gain more take it; the others' hits take their cached branch,
        their misses go to the fallback. Returns the outcomes to stream."""
        outcomes, rest = self._take_lookups(seqs, self.stats.hit_rate)
        return outcomes + (self._take_trees(rest) if rest else [])

    def _take_trees(self, seqs: list[Sequence]) -> list[Outcome]:
        """Hits take their cached branch; misses go to the fallback. Returns the outcomes to stream."""
        start = time.perf_counter()
        # A sequence whose tree's plan lacks its outcome missed: its fallback need not wait for the tree.
        trees = self.draft.wait_trees([(s.seq_id, s.round) for s in seqs], self.config.tree_timeout_s,
                                      {s.seq_id: s.last_outcome for s in seqs})
        waited = time.perf_counter() - start
        self.metrics.draft_wait_s += waited
        # Late: the round waited the timeout out, here or for the plans (whose trees are then not waited for).
        if len(trees) < len(seqs) and 0 < self.config.tree_timeout_s <= waited + self._plan_wait_s:
            self._note_late_trees(len(seqs) - len(trees))
        self.stats.record_time(Timing.TREE_WAIT, waited + self._plan_wait_s)
        for tree in trees.values():
            self.cache.put_tree(tree)
        if trees:  # one build per draft worker, in parallel: the round waited on the slowest
            self.metrics.tree_build_s += max(t.build_s for t in trees.values())
            self.metrics.tree_builds += 1
        outcomes, misses = [], []
        for s in seqs:
            branch = self.cache.lookup(s.seq_id, s.round, *s.last_outcome)
            if branch is None or not self._fits(branch):
                misses.append(s)
                continue
            s.metrics.cache_hits += 1
            # The tokens travel too (K ints): a cache-parallel shard may not hold this branch.
            outcomes.append(Outcome(s.seq_id, s.round, *s.last_outcome, next_tokens=branch.tokens.tolist(),
                                    cache_hit=True, skip_tree=not s.wants_tree))
            s.speculation, s.speculation_kind, s.round = branch, ProposalSource.CACHE, s.round + 1
        self._count_lookups(len(seqs), len(seqs) - len(misses))
        outcomes += self._fallback(misses, len(seqs))
        for o in outcomes:  # the draft's budget signal: did its last trees make the target wait?
            o.tree_wait_s = waited
        return outcomes

    def _note_late_trees(self, late: int) -> None:
        """Trees that outlasted tree_timeout_s: a miss each, never a wrong token, but a round that waited the
        whole timeout; said at most once a minute, as a stalled or overloaded draft side causes it."""
        self.metrics.late_trees += late
        if self._late_warning.due():
            log.warning("%d speculation tree(s) did not arrive within tree_timeout_s = %.1f s (%d so far): those "
                        "sequences fell back; is the draft side stalled or overloaded?", late,
                        self.config.tree_timeout_s, self.metrics.late_trees)

    def _count_lookups(self, lookups: int, hits: int) -> None:
        self.stats.record_lookups([1] * lookups, [True] * hits + [False] * (lookups - hits))
        self.metrics.cache_hits += hits
        self.metrics.cache_misses += lookups - hits

    def release(self, seqs):
        try:
            super().release(seqs)
        finally:  # (as SDLoop's draft side: whatever the target's release did)
            for s in seqs:
                self.forget(s)

    def forget(self, s: Sequence) -> None:
        self.cache.drop(s.seq_id)
        if self.picker:
            self.picker.forget(s.seq_id)

    def _fallback(self, misses: list[Sequence], batch_size: int) -> list[Outcome]:
        if not misses:
            return []
        for s in misses:
            s.metrics.cache_misses += 1
        kind = choose_fallback(self.config.fallback, batch_size, self.stats.critical_batch_size())
        if self.config.fallback is FallbackPolicy.AUTO:
            every = self.stats.fallback_explore_every(batch_size)
            kind, self._fallback_choices = explore_fallback(kind, self._fallback_choices, every), self._fallback_choices + 1
        if kind is not FallbackPolicy.NEURAL:
            return self._fast(misses, kind)
        start = time.perf_counter()
        outcomes = self._draft_or_fast(misses, FallbackPolicy.FAST)
        self.stats.record_time(Timing.NEURAL_BACKUP, time.perf_counter() - start)
        for s in misses:
            if s.speculation_kind is ProposalSource.NEURAL:
                s.metrics.record_fallback(FallbackPolicy.NEURAL.value)
                self.metrics.fallbacks[FallbackPolicy.NEURAL.value] += 1
        return outcomes


def gate_modes(config: Config) -> tuple[RoundMode, ...]:
    """The round modes SSD's tree gate chooses among: rounds of the fast backup's proposals too where the
    config leaves the backup to the engine (fallback "auto", ngram_rounds): a forced backup already
    speculates every round without trees (fast, random), or is to be the draft's (neural)."""
    if config.fallback is FallbackPolicy.AUTO and config.ngram_rounds:
        return RoundMode.TREES, RoundMode.JUST_IN_TIME, RoundMode.FAST
    return RoundMode.TREES, RoundMode.JUST_IN_TIME


def round_yield(seqs: list[Sequence], gained: list[list[int]]) -> RoundYield:
    """The round's tokens for the tree gate, with those of the rows the fast backup proposed apart."""
    fast = [len(g) for s, g in zip(seqs, gained) if s.speculation_kind is ProposalSource.FAST]
    lookup = [len(g) for s, g in zip(seqs, gained) if s.speculation_kind is ProposalSource.LOOKUP]
    return RoundYield(len(seqs), sum(map(len, gained)), len(fast), sum(fast), len(lookup), sum(lookup))
