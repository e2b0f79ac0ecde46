"""One round loop per mode. The Engine drives: admit -> prepare -> verify, every step.

- admit(seqs):   prefill new sequences; returns each one's first token.
- prepare(seqs): give every sequence the speculation it verifies this round.
- verify(seqs):  one batched target pass; returns the tokens each sequence gained.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from saguaro_dist.config import Config, FallbackPolicy, Mode, TreePolicy
from saguaro_dist.distributed.errors import DraftRpcError, DraftUnavailable, OutOfOrder, UnknownSequence
from saguaro_dist.engine.draft_backend import DraftLater, PendingDrafts
from saguaro_dist.engine.draftless import ARLoop, NgramLoop, lookup_proposal, verify_speculations
from saguaro_dist.engine.messages import JitDraftRequest, Outcome, PrefillRequest, Proposal, Release, ResetPrefixCache
from saguaro_dist.engine.metrics import EngineMetrics
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.engine.target import TargetScorer
from saguaro_dist.model.cuda_graphs import graph_captures
from saguaro_dist.spec import (
    ProposalSource, SpecStats, SpeculationCache, Timing, choose_fallback, explore_fallback, random_proposal,
)
from saguaro_dist.spec.cohorts import CohortGate
from saguaro_dist.spec.fallback import ngram_lookup
from saguaro_dist.spec.lookup_pick import Guess, LookupPicker, pick_lookup_rows
from saguaro_dist.spec.tree_gate import RoundMode, RoundYield, TreeGate

log = logging.getLogger(__name__)
LATE_TREE_WARN_EVERY_S = 60.0


class SDLoop(ARLoop):
    """Speculative decoding: the draft drafts K tokens just in time, then the target verifies."""

    def __init__(self, target: TargetScorer, draft, metrics: EngineMetrics, config: Config):
        super().__init__(target, metrics)
        self.draft, self.config = draft, config
        # A sequence longer than this leaves the draft (_leave_draft): a tree's branch reaches K + 1 tokens
        # past it (K accepted and the bonus), then K draft tokens more, inside the draft's context.
        self._draft_room = draft.max_model_len - 2 * (config.k + 1)
        self._drafted_this_round = False

    def admit(self, seqs):
        """Prefill target and draft: a draft on other hardware (a process, a node) prefills from before the
        target's prefill to after it, a draft on the target's thread after it."""
        drafted = [s for s in seqs if s.num_tokens + 1 <= self._draft_room]  # once prefill adds the first token
        pending = self.draft.start_prefill([PrefillRequest(s.seq_id, s.prompt_token_ids, s.draft_sampling())
                                            for s in drafted]) if drafted else None
        try:
            first = self.target.prefill(seqs)
        except BaseException:
            self._abandon_prefill(pending, drafted)
            raise
        held = {s.seq_id for s in drafted}
        for s, t in zip(seqs, first):
            s.last_outcome, s.speculation = (0, t), None
            s.beyond_draft = s.draft_lost = s.seq_id not in held
        self._finish_prefill(pending, drafted)
        return first

    def _finish_prefill(self, pending, drafted: list[Sequence]) -> None:
        try:
            if pending is not None:
                pending.result()
        except DraftUnavailable as err:  # no draft worker left: speculate with the fast backup until one is
            log.warning("draft prefill failed (%s): fast backup for %d new sequences", err, len(drafted))
            for s in drafted:
                s.draft_lost = True

    def _abandon_prefill(self, pending, drafted: list[Sequence]) -> None:
        """The target's prefill failed: the draft forgets what it began to hold (the engine drops them)."""
        if pending is None:
            return
        try:
            pending.result()
        except Exception as exc:  # noqa: BLE001 - the target's failure is the one to report; release anyway
            log.info("the draft's prefill failed too: %s", exc)
        try:
            self.draft.release([Release(s.seq_id) for s in drafted])
        except Exception:  # noqa: BLE001 - the target's failure is the one to report
            log.exception("could not release the draft's sequences after a failed prefill")

    def prepare(self, seqs):
        self._drafted_this_round = False
        self._track_draft(seqs)
        self._draft_or_fast(seqs, FallbackPolicy.FAST)

    def verify(self, seqs):
        gained = verify_speculations(self.target, self.metrics, seqs)
        if self._drafted_this_round:
            self.metrics.jit_round_tokens += sum(map(len, gained))
        return gained

    def release(self, seqs):
        super().release(seqs)
        self.draft.release([Release(s.seq_id) for s in seqs if not s.beyond_draft])

    def reset_prefix_cache(self):
        super().reset_prefix_cache()
        self.draft.reset_prefix_cache(ResetPrefixCache())

    def close(self):
        self.draft.close()

    def _draft_or_fast(self, seqs: list[Sequence], fast_kind: FallbackPolicy) -> list[Outcome]:
        """Neural drafts for `seqs`; the ones whose draft worker is gone get the fast backup."""
        return self._take_drafts(self._ask_drafts(seqs, beside=False), fast_kind)

    def _ask_drafts(self, seqs: list[Sequence], beside: bool) -> AskedDrafts:
        """Ask the draft for `seqs`' next speculations (not of those whose worker is lost). beside: it
        drafts while this thread verifies others; else when taken, on this thread if the backend can."""
        live = [s for s in seqs if not s.draft_lost]
        reqs = [JitDraftRequest(s.seq_id, self._next_round(s), *s.last_outcome, skip_tree=not s.wants_tree) for s in live]
        if not reqs:
            return AskedDrafts(seqs, live, reqs, None)
        self.metrics.jit_rounds += not self._drafted_this_round
        self._drafted_this_round = True
        pending = self.draft.start_jit_draft(reqs) if beside else DraftLater(self.draft.jit_draft, reqs)
        return AskedDrafts(seqs, live, reqs, pending)

    def _take_drafts(self, asked: AskedDrafts, fast_kind: FallbackPolicy) -> list[Outcome]:
        """Adopt what the draft answered; sequences it could not draft for get the fast backup."""
        live_ids = {s.seq_id for s in asked.live}
        outcomes = self._fast([s for s in asked.seqs if s.seq_id not in live_ids], fast_kind)
        if asked.pending is None:
            return outcomes
        start = time.perf_counter()
        try:
            self._adopt(asked.live, dict(zip((r.seq_id for r in asked.reqs), asked.pending.result())))
            return outcomes
        except DraftUnavailable as err:  # a dead draft worker costs speed, never tokens
            log.warning("draft unavailable (%s): fast backup for %d sequences", err, len(err.seq_ids))
            for s in asked.live:
                s.draft_lost = s.seq_id in err.seq_ids
            self._adopt(asked.live, err.partial)
            return outcomes + self._fast([s for s in asked.live if s.seq_id not in err.partial], fast_kind)
        except (OutOfOrder, UnknownSequence) as err:  # the draft lost track of them (a lost message): restart them
            log.warning("draft out of step (%s): fast backup, then a fresh prefill, for %d sequences", err, len(asked.live))
            for s in asked.live:
                s.draft_lost = True
            return outcomes + self._fast(asked.live, fast_kind)
        finally:
            self.metrics.draft_wait_s += time.perf_counter() - start

    def _track_draft(self, seqs: list[Sequence]) -> None:
        """Before a round: sequences outgrowing the draft leave it, those whose worker was lost rejoin one."""
        self._leave_draft(seqs)
        self._readmit([s for s in seqs if s.draft_lost and not s.beyond_draft])

    def _outgrows_draft(self, s: Sequence) -> bool:
        return s.num_tokens > self._draft_room

    def _leave_draft(self, seqs: list[Sequence]) -> None:
        """Sequences about to outgrow the draft's context (a draft trained on a shorter one than the
        target's) are released there; the fast backup speculates for them until they end. (vLLM stops
        speculating for them; n-gram proposals cost nothing and still accept on repetitive text.)"""
        leaving = [s for s in seqs if not s.beyond_draft and self._outgrows_draft(s)]
        if not leaving:
            return
        for s in leaving:
            s.beyond_draft = s.draft_lost = True
            s.wants_tree = False
            self.forget(s)
        self.draft.release([Release(s.seq_id) for s in leaving])

    def _readmit(self, seqs: list[Sequence]) -> None:
        """Sequences whose draft worker died or lost track of them: prefill them on a live one, to
        restart at round 0."""
        if not seqs:
            return
        try:
            self.draft.prefill([PrefillRequest(s.seq_id, s.tokens[:-1], s.draft_sampling(),
                                               prompt_len=len(s.prompt_token_ids)) for s in seqs])
        except DraftUnavailable as err:  # no worker to take them yet (the pool says so once); again next round
            log.debug("re-prefill of %d sequences failed (%s): staying on the fast backup", len(seqs), err)
            return
        except DraftRpcError as err:
            log.warning("re-prefill of %d sequences failed (%s): staying on the fast backup", len(seqs), err)
            return
        for s in seqs:
            s.draft_lost, s.speculation, s.last_outcome = False, None, (0, s.tokens[-1])
            self.forget(s)

    def forget(self, s: Sequence) -> None:
        """Drop target-side speculation state of a sequence (SSD keeps a cache)."""

    @staticmethod
    def _next_round(s: Sequence) -> int:
        """A just-in-time draft follows the real outcome: the first speculation is round 0, then one a round."""
        return s.round + 1 if s.speculation is not None else 0

    def _adopt(self, seqs: list[Sequence], proposals: dict) -> None:
        for s in seqs:
            if s.seq_id in proposals:
                s.round, s.speculation, s.speculation_kind = self._next_round(s), proposals[s.seq_id], ProposalSource.NEURAL

    def _fast(self, seqs: list[Sequence], kind: FallbackPolicy) -> list[Outcome]:
        """The fast backup's proposals; the outcomes tell the draft side what is verified next."""
        outcomes = []
        for s in seqs:
            outcomes += self._propose_here(s, self._fast_proposal(s, kind), ProposalSource.FAST)
            s.metrics.record_fallback(kind.value)
            self.metrics.fallbacks[kind.value] += 1
        return outcomes

    def _propose_here(self, s: Sequence, proposal: Proposal, source: ProposalSource) -> list[Outcome]:
        """s verifies a target-side proposal next; the outcome to stream, if the draft holds s (it learns
        what is verified next)."""
        outcome = [] if s.beyond_draft else [Outcome(s.seq_id, s.round, *s.last_outcome, skip_tree=not s.wants_tree,
                                                     next_tokens=proposal.tokens.tolist(), target_proposed=True)]
        s.round, s.speculation, s.speculation_kind = self._next_round(s), proposal, source
        return outcome

    def _fast_proposal(self, s: Sequence, kind: FallbackPolicy) -> Proposal:
        k, vocab = self.config.k, self.target.vocab_size
        if kind is FallbackPolicy.RANDOM:
            tokens = torch.tensor(random_proposal(vocab, k, s.generator), dtype=torch.long)
            return Proposal(tokens, torch.full((k, vocab), 1.0 / vocab))  # drawn uniformly: q is uniform
        return lookup_proposal(s.tokens, self.config)


class SSDLoop(SDLoop):
    """Speculative speculative decoding: trees are prepared while the target verifies, in the rounds
    the tree gate (spec/tree_gate.py) finds them faster than just-in-time drafts or n-gram proposals."""

    def __init__(self, target: TargetScorer, draft, metrics: EngineMetrics, config: Config):
        super().__init__(target, draft, metrics, config)
        self.stats = SpecStats(config.k)  # feeds the batch-aware fallback choice (Theorem 17)
        self.cache = SpeculationCache()
        self.gate = TreeGate(gate_modes(config)) if config.tree_policy is TreePolicy.AUTO else None
        # Rows of tree rounds may take their n-gram proposal where it measures better, as whole rounds may.
        self.picker = LookupPicker() if self.gate and RoundMode.FAST in gate_modes(config) else None
        self._wait_at_start = 0.0  # metrics.draft_wait_s as this round began: its wait for trees and drafts is the growth
        self._batch_size = 0  # this round's rows
        self.cohort_gate = CohortGate() if config.jit_cohorts == 2 else None
        self._mode, self._round_start, self._captures = RoundMode.TREES, 0.0, 0
        self._split: bool | None = None  # this round verifies two cohorts (None: not a choice this round)
        self._sampled = False  # a row of this round samples (T > 0)
        self._cohorts: tuple[list[Sequence], list[Sequence], AskedDrafts] | None = None  # first, second, the second's drafts
        self._in_flight: AskedDrafts | None = None  # the last round's first cohort's drafts, asked beside the second's verify
        self._fallback_choices = 0  # automatic fallback choices made (explore_fallback)
        self._late_warned_at = -LATE_TREE_WARN_EVERY_S

    def prepare(self, seqs):
        self._round_start, self._drafted_this_round = time.perf_counter(), False
        self._wait_at_start, self._captures = self.metrics.draft_wait_s, graph_captures()
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
            outcomes += self._draft_or_fast(new, FallbackPolicy.FAST)
            outcomes += self._next_speculations(treed) if treed else []
            outcomes += self._without_tree(untreed) if untreed else []
        # Even when empty if a tree is wanted: a one-host draft builds the trees of this round's
        # just-in-time drafts on it. The draft starts the next trees now, while we verify.
        if outcomes or self._mode is RoundMode.TREES:
            self.draft.send_outcomes(outcomes)

    def verify(self, seqs):
        verified_s = self.metrics.verify_s
        gained = self._verify_cohorts(seqs) if self._cohorts else super().verify(seqs)
        self._count_round(seqs, sum(map(len, gained)))
        # The target's forwards only: a round of two cohorts also waits for the second one's drafts.
        self.stats.record_time(Timing.VERIFY, self.metrics.verify_s - verified_s)
        for source in ProposalSource:
            self.stats.record_verify([s.last_outcome[0] for s in seqs if s.speculation_kind is source], source)
        if graph_captures() == self._captures:  # a round that captured a graph timed the capture
            seconds = time.perf_counter() - self._round_start
            if self.gate:
                self.gate.record(len(seqs), self._mode, round_yield(seqs, gained), seconds, self._sampled)
            if self._split is not None:
                self.cohort_gate.record(len(seqs), self._split, seconds)
            if self.picker and self._mode is not RoundMode.FAST:
                waited = self.metrics.draft_wait_s - self._wait_at_start
                self.picker.record_round((self._mode, self._sampled, len(seqs)), seconds, waited or None)
        return gained

    def _count_round(self, seqs: list[Sequence], tokens: int) -> None:
        """Count the round by kind: n-gram proposals alone, waiting for no tree and no draft (the gate's
        RoundMode.FAST, or a round whose every row took its n-gram proposal; a sequence admitted in the
        round was drafted: not such a round), else the gate's rounds without trees."""
        alone = not self._drafted_this_round
        if alone and self._mode is RoundMode.FAST:
            self.metrics.fast_rounds += 1
            self.metrics.fast_round_tokens += tokens
        elif alone and all(s.speculation_kind is ProposalSource.LOOKUP for s in seqs):
            self.metrics.lookup_rounds += 1
            self.metrics.lookup_round_tokens += tokens
        elif self._mode is RoundMode.JUST_IN_TIME:
            self.metrics.just_in_time_rounds += 1

    def _round_mode(self, seqs: list[Sequence]) -> RoundMode:
        if self.gate:
            self._sampled = any(not s.params.greedy for s in seqs)  # the gate measures such batches apart
            return self.gate.mode(len(seqs), self._sampled)
        return RoundMode.JUST_IN_TIME if self.config.tree_policy is TreePolicy.NEVER else RoundMode.TREES

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
        asked, self._in_flight = self._in_flight.among({s.seq_id for s in seqs}), None
        return self._take_drafts(asked, FallbackPolicy.FAST), {s.seq_id for s in asked.seqs}

    def _without_tree(self, seqs: list[Sequence]) -> list[Outcome]:
        """No tree was asked for: the draft drafts now (SD's round), but for the rows whose n-gram proposal
        should gain more; or the fast backup (forced, or the tree gate measured its rounds faster:
        RoundMode.FAST)."""
        if self.config.fallback in (FallbackPolicy.FAST, FallbackPolicy.RANDOM):
            return self._fast(seqs, self.config.fallback)
        if self._mode is RoundMode.FAST:
            return self._fast(seqs, FallbackPolicy.FAST)
        outcomes, rest = self._take_lookups(seqs, hit_rate=1.0)  # a just-in-time draft always answers
        return outcomes + (self._draft_or_fast(rest, FallbackPolicy.FAST) if rest else [])

    def _next_speculations(self, seqs: list[Sequence]) -> list[Outcome]:
        """Rows whose n-gram proposal should gain more take it; the others' hits take their cached branch,
        their misses go to the fallback. Returns the outcomes to stream."""
        outcomes, rest = self._take_lookups(seqs, self.stats.hit_rate)
        return outcomes + (self._take_trees(rest) if rest else [])

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
        proposal is offered, to be scored once its tokens are known."""
        guesses = [self._offer_lookup(s) for s in seqs]
        where, whole = (self._mode, self._sampled, self._batch_size), len(seqs) == self._batch_size
        busy_s, wait_s = self.picker.round_times(where)
        picks = pick_lookup_rows([self.picker.expected(g.key) for g in guesses],
                                 self.gate.draft_tokens_per_row(self._batch_size, self._sampled), hit_rate,
                                 busy_s, wait_s if whole else None)
        return {s.seq_id: Proposal(torch.tensor(g.tokens, dtype=torch.long), None)
                for s, g, pick in zip(seqs, guesses, picks) if pick}

    def _offer_lookup(self, s: Sequence) -> Guess:
        """s's n-gram proposal, offered to the picker to be scored (whether it is verified or not)."""
        tokens, n = ngram_lookup(s.tokens, self.config.k, self.config.prompt_lookup_max, self.config.prompt_lookup_min)
        guess = Guess(s.num_tokens, tuple(tokens), (n, s.params.greedy))
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

    def _take_trees(self, seqs: list[Sequence]) -> list[Outcome]:
        """Hits take their cached branch; misses go to the fallback. Returns the outcomes to stream."""
        start = time.perf_counter()
        # A sequence whose tree's plan lacks its outcome missed: its fallback need not wait for the tree.
        trees = self.draft.wait_trees([(s.seq_id, s.round) for s in seqs], self.config.tree_timeout_s,
                                      {s.seq_id: s.last_outcome for s in seqs})
        waited = time.perf_counter() - start
        self.metrics.draft_wait_s += waited
        if len(trees) < len(seqs) and 0 < self.config.tree_timeout_s <= waited:
            self._note_late_trees(len(seqs) - len(trees))
        self.stats.record_time(Timing.TREE_WAIT, waited)
        for tree in trees.values():
            self.cache.put_tree(tree)
        if trees:  # one build per draft worker, in parallel: the round waited on the slowest
            self.metrics.tree_build_s += max(t.build_s for t in trees.values())
            self.metrics.tree_builds += 1
        outcomes, misses = [], []
        for s in seqs:
            branch = self.cache.lookup(s.seq_id, s.round, *s.last_outcome)
            if branch is None:
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
        now = time.monotonic()
        if now - self._late_warned_at >= LATE_TREE_WARN_EVERY_S:
            self._late_warned_at = now
            log.warning("%d speculation tree(s) did not arrive within tree_timeout_s = %.1f s (%d so far): those "
                        "sequences fell back; is the draft side stalled or overloaded?", late,
                        self.config.tree_timeout_s, self.metrics.late_trees)

    def _count_lookups(self, lookups: int, hits: int) -> None:
        self.stats.record_lookups([1] * lookups, [True] * hits + [False] * (lookups - hits))
        self.metrics.cache_hits += hits
        self.metrics.cache_misses += lookups - hits

    def release(self, seqs):
        super().release(seqs)
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
            kind, self._fallback_choices = explore_fallback(kind, self._fallback_choices), self._fallback_choices + 1
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


@dataclass
class AskedDrafts:
    """Just-in-time drafts asked for: of `seqs`, the `live` ones were sent as `reqs` and `pending` will
    answer; the others (their draft worker lost) get the fast backup when the drafts are taken."""
    seqs: list[Sequence]
    live: list[Sequence]
    reqs: list[JitDraftRequest]
    pending: PendingDrafts | None

    def among(self, seq_ids: set[int]) -> AskedDrafts:
        """Only the sequences still running (the answer still covers every request: it is taken whole)."""
        return AskedDrafts([s for s in self.seqs if s.seq_id in seq_ids], [s for s in self.live if s.seq_id in seq_ids],
                           self.reqs, self.pending)


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


def build_loop(config: Config, target: TargetScorer, draft, metrics: EngineMetrics):
    """The round loop for the configured mode."""
    loops = {
        Mode.AR: lambda: ARLoop(target, metrics),
        Mode.SD: lambda: SDLoop(target, draft, metrics, config),
        Mode.SSD: lambda: SSDLoop(target, draft, metrics, config),
        Mode.NGRAM: lambda: NgramLoop(target, metrics, config),
    }
    return loops[config.mode]()
