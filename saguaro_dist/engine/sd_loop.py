"""Speculative decoding's round loop: the draft drafts K tokens just in time, then the target verifies.

SSD's loop (engine/ssd_loop.py) builds on it: its just-in-time drafts, fast backup, and the draft's
bookkeeping when a worker dies or a sequence outgrows the draft's context.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from saguaro_dist.config import Config, FallbackPolicy
from saguaro_dist.distributed.errors import (
    DraftRpcError,
    DraftUnavailable,
    OutOfOrder,
    UnknownSequence,
)
from saguaro_dist.engine.draft_backend import DraftLater, PendingDrafts
from saguaro_dist.engine.draftless import ARLoop, lookup_proposal, verify_speculations
from saguaro_dist.engine.messages import (
    DraftSampling,
    JitDraftRequest,
    Outcome,
    PrefillRequest,
    Proposal,
    Release,
    ResetPrefixCache,
    proposal_fits,
)
from saguaro_dist.engine.metrics import EmittedTokens, EngineMetrics, RoundTokens
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.engine.stats_log import Throttle
from saguaro_dist.engine.target import TargetScorer
from saguaro_dist.spec import ProposalSource, random_proposal

log = logging.getLogger(__name__)
UNFIT_WARN_EVERY_S = 60.0
# Failed draft prefills in a row (out of memory, INTERNAL: not a refusal) after which a sequence goes on without a
# draft: a draft that keeps failing must not cost a prefill of it every round, for ever.
PREFILL_TRIES = 3


def refused_for_good(err: Exception) -> bool:
    """Whether a failed draft prefill fails again when sent again: the draft refused what it holds (the DraftWorker's
    ValueError; over gRPC INVALID_ARGUMENT, errors.DraftRefused). Anything else (out of memory, INTERNAL,
    RESOURCE_EXHAUSTED) may pass on a later try."""
    return isinstance(err, ValueError)


class SDLoop(ARLoop):
    """Speculative decoding: the draft drafts K tokens just in time, then the target verifies."""

    def __init__(self, target: TargetScorer, draft, metrics: EngineMetrics, config: Config):
        super().__init__(target, metrics)
        self.draft, self.config = draft, config
        # A sequence longer than this leaves the draft (_leave_draft): a tree's branch reaches K + 1 tokens
        # past it (K accepted and the bonus), then K draft tokens more, inside the draft runner's position
        # slack of 2 (K + 1) (engine/build.py position_slack): to the draft's own max_model_len.
        self._draft_room = draft.max_model_len
        self._drafted_this_round = False
        self._unfit_warning = Throttle(UNFIT_WARN_EVERY_S)
        self.emitted = EmittedTokens(metrics)  # rounds' tokens by kind, counted once the engine kept them
        self._failed_prefills: dict[int, int] = {}  # seq_id -> its draft prefills failed in a row (PREFILL_TRIES)

    def admit(self, seqs):
        """Prefill target and draft: a draft on other hardware (a process, a node) prefills from before the
        target's prefill to after it, a draft on the target's thread after it."""
        drafted = [s for s in seqs if s.num_tokens + 1 <= self._draft_room]  # once prefill adds the first token
        pending = self.draft.start_prefill([self._draft_prefill(s, s.prompt_token_ids)
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
        except DraftUnavailable as err:  # no draft worker left: the fast backup until a fresh prefill takes (_readmit)
            log.warning("draft prefill failed (%s): fast backup for %d new sequences", err, len(drafted))
            self._lose(drafted)
        except Exception as err:  # noqa: BLE001 - the draft refused or failed (DraftRpcError over gRPC; in this process
            # a bug, out of memory, a request it cannot take): raised, it failed the step, every request in flight
            self._prefill_failed(drafted, err, lambda s: self._draft_prefill(s, s.prompt_token_ids))

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
        self.emitted.settle()
        gained = verify_speculations(self.target, self.metrics, seqs, self._coupling(seqs))
        if self._drafted_this_round:
            self.emitted.note(seqs, RoundTokens.JIT)
        return gained

    def _coupling(self, seqs: list[Sequence]):
        """What the verify draws sampled rows' bonus against (SSD's coupled bonus draws); SD: nothing."""
        return None

    def release(self, seqs):
        try:
            super().release(seqs)  # the target's rows, one by one (Engine._retire frees those a failure left)
        finally:  # the draft's side for all of them, whatever the target's did: it is freed nowhere else
            self.emitted.settle()
            for s in seqs:
                self._failed_prefills.pop(s.seq_id, None)
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
            unfit = self._adopt(asked.live, dict(zip((r.seq_id for r in asked.reqs), asked.pending.result())))
            return outcomes + self._fast(unfit, fast_kind)
        except DraftUnavailable as err:  # a dead draft worker costs speed, never tokens
            log.warning("draft unavailable (%s): fast backup for %d sequences", err, len(err.seq_ids))
            for s in asked.live:
                s.draft_lost = s.seq_id in err.seq_ids
            unfit = self._adopt(asked.live, err.partial)
            return outcomes + self._fast([s for s in asked.live if s.seq_id not in err.partial] + unfit, fast_kind)
        except (OutOfOrder, UnknownSequence, DraftRpcError) as err:  # the draft lost track of them (a lost
            # message), or failed (INTERNAL, out of memory; raised, it failed every request in flight): restart them
            log.warning("draft out of step (%s): fast backup, then a fresh prefill, for %d sequences", err, len(asked.live))
            return outcomes + self._fast(self._lose(asked.live), fast_kind)
        except Exception:  # noqa: BLE001 - a draft in this process failed (out of memory, a bug): speculation is
            # optional, so as above (raised, it failed every request in flight), with the traceback
            log.exception("draft failed: fast backup, then a fresh prefill, for %d sequences", len(asked.live))
            return outcomes + self._fast(self._lose(asked.live), fast_kind)
        finally:
            self.metrics.draft_wait_s += time.perf_counter() - start

    @staticmethod
    def _lose(seqs: list[Sequence]) -> list[Sequence]:
        """The draft no longer holds seqs as they are: the fast backup until a fresh prefill (_readmit)."""
        for s in seqs:
            s.draft_lost = True
        return seqs

    def _track_draft(self, seqs: list[Sequence]) -> None:
        """Before a round: sequences outgrowing the draft leave it, those whose worker was lost rejoin one (a
        failed draft tells of a loss, and so does the backend: no draft is asked of a sequence whose trees
        hit every round, or whose misses take the fast backup, and it ran without trees to its end)."""
        self._leave_draft(seqs)
        drafted = [s for s in seqs if not s.draft_lost and not s.beyond_draft]
        lost = set(self.draft.lost([s.seq_id for s in drafted])) if drafted else ()
        for s in drafted:
            s.draft_lost = s.seq_id in lost
        self._readmit([s for s in seqs if s.draft_lost and not s.beyond_draft])

    def _outgrows_draft(self, s: Sequence) -> bool:
        return s.num_tokens > self._draft_room

    def _told(self, s: Sequence) -> DraftSampling:
        """What the draft is told of s's sampling, with the ends the target holds back for min_tokens."""
        return s.draft_sampling(self.target.eos_token_ids, self.target.vocab_size)

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
            self.draft.prefill([self._draft_prefill(s, s.tokens[:-1]) for s in seqs])
        except DraftUnavailable as err:  # no worker to take them yet (the pool says so once); again next round
            log.debug("re-prefill of %d sequences failed (%s): staying on the fast backup", len(seqs), err)
            return
        except Exception as err:  # noqa: BLE001 - as in _finish_prefill
            seqs = self._prefill_failed(seqs, err, lambda s: self._draft_prefill(s, s.tokens[:-1]))
        for s in seqs:  # a new life on the draft, as admit starts one: round 0, the last token its first outcome's
            s.draft_lost, s.speculation, s.last_outcome, s.round = False, None, (0, s.tokens[-1]), 0
            self._failed_prefills.pop(s.seq_id, None)
            self.forget(s)

    def _draft_prefill(self, s: Sequence, tokens: list[int]) -> PrefillRequest:
        """The draft's prefill of s: `tokens` are its prompt at admission, all but its last token on a re-prefill."""
        return PrefillRequest(s.seq_id, tokens, self._told(s), prompt_len=len(s.prompt_token_ids),
                              cache_salt=s.cache_salt)

    def _prefill_failed(self, seqs: list[Sequence], err: Exception, request) -> list[Sequence]:
        """The draft's prefill of seqs failed (not a lost worker: DraftUnavailable). Refused (refused_for_good): each
        again on its own now, so one it cannot take costs only its own speculation. Else (out of memory, INTERNAL:
        perhaps gone in a moment) lost, prefilled again on a later round (_readmit); retried at once, a failure of
        milliseconds took every one of them off the draft for good. Those failed PREFILL_TRIES times in a row are
        tried once on their own, then go without a draft. Returns those the draft now holds."""
        if refused_for_good(err):
            return self._prefill_alone(seqs, err, request)
        log.warning("draft prefill of %d sequences failed (%s): fast backup, then a fresh prefill", len(seqs), err)
        for s in self._lose(seqs):
            self._failed_prefills[s.seq_id] = self._failed_prefills.get(s.seq_id, 0) + 1
        spent = [s for s in seqs if self._failed_prefills[s.seq_id] >= PREFILL_TRIES]
        if len(seqs) == 1:  # alone already: tried as often as it may be
            for s in spent:
                self._refused(s, err)
            return []
        return self._prefill_alone(spent, err, request) if spent else []

    def _prefill_alone(self, seqs: list[Sequence], err: Exception, request) -> list[Sequence]:
        """Each of seqs prefilled on its own (request(s): its PrefillRequest) after their batch failed with err.
        Returns those the draft now holds; one whose worker was lost meanwhile, or whose failure may pass, is
        prefilled again later (_readmit)."""
        log.warning("draft prefill of %d sequences failed (%s): each on its own", len(seqs), err)
        held = []
        for s in seqs:
            try:
                self.draft.prefill([request(s)])
            except DraftUnavailable:
                self._lose([s])
            except Exception as exc:  # noqa: BLE001 - alone: this sequence's own doing, or the draft's moment
                self._failed_alone(s, exc)
            else:
                held.append(s)
                self._failed_prefills.pop(s.seq_id, None)
        return held

    def _failed_alone(self, s: Sequence, err: Exception) -> None:
        """s's prefill on its own failed: refused, or failed PREFILL_TRIES times in a row, it goes without a
        draft; else it is lost (prefilled again on a later round)."""
        tries = self._failed_prefills[s.seq_id] = self._failed_prefills.get(s.seq_id, 0) + 1
        if refused_for_good(err) or tries >= PREFILL_TRIES:
            self._refused(s, err)
        else:
            self._lose([s])

    def _refused(self, s: Sequence, err: Exception) -> None:
        """The draft refused s on its own (or kept failing it): the fast backup speculates for it to its end, as
        for one that outgrew the draft (_leave_draft). Never asked again: it would fail again, every round."""
        log.warning("the draft cannot take sequence %d (%s): it goes on without a draft", s.seq_id, err)
        self._failed_prefills.pop(s.seq_id, None)
        s.beyond_draft = s.draft_lost = True
        s.wants_tree = False
        self.forget(s)
        self.draft.release([Release(s.seq_id)])  # its placement on the draft side (the draft holds none of it)

    def forget(self, s: Sequence) -> None:
        """Drop target-side speculation state of a sequence (SSD keeps a cache)."""

    @staticmethod
    def _next_round(s: Sequence) -> int:
        """A just-in-time draft follows the real outcome: the first speculation is round 0, then one a round."""
        return s.round + 1 if s.speculation is not None else 0

    def _adopt(self, seqs: list[Sequence], proposals: dict) -> list[Sequence]:
        """Take the drafts that fit (proposal_fits); returns those that do not, to be drafted afresh (their
        draft worker is taken for lost: a fresh prefill on it, the fast backup meanwhile)."""
        unfit = []
        for s in seqs:
            if s.seq_id not in proposals:
                continue
            if not self._fits(proposals[s.seq_id]):
                s.draft_lost = True
                unfit.append(s)
                continue
            s.round, s.speculation, s.speculation_kind = self._next_round(s), proposals[s.seq_id], ProposalSource.NEURAL
        return unfit

    def _fits(self, proposal: Proposal) -> bool:
        """proposal_fits, said at most once a minute when it does not (a mismatched draft says it every round)."""
        if proposal_fits(proposal, self.config.k, self.target.vocab_size):
            return True
        if self._unfit_warning.due():
            log.error("the draft side sent a speculation of shape %s (q %s) for K = %d over a %d-token vocabulary: "
                      "a miss, never a token; is a draft worker built with another model or config?",
                      list(proposal.tokens.shape), None if proposal.probs is None else list(proposal.probs.shape),
                      self.config.k, self.target.vocab_size)
        return False

    def _fast(self, seqs: list[Sequence], kind: FallbackPolicy) -> list[Outcome]:
        """The fast backup's proposals; the outcomes tell the draft side what is verified next."""
        return self._take_fast(seqs, [self._fast_proposal(s, kind) for s in seqs], kind)

    def _take_fast(self, seqs: list[Sequence], proposals: list[Proposal], kind: FallbackPolicy) -> list[Outcome]:
        """seqs verify the fast backup's `proposals` next (counted as its fallbacks); the outcomes to stream."""
        outcomes = []
        for s, proposal in zip(seqs, proposals):
            outcomes += self._propose_here(s, proposal, ProposalSource.FAST)
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
