"""SSD's draft split in two: just-in-time drafts on a thread of the engine's process, trees elsewhere
(config.draft_executor = "split"): one host, in a child process (DraftProcess); on Ray, in the pool of
draft actors (DraftPool), the target's rank 0 holding the draft copy.

Why: a round the tree gate runs without trees is SD's round, and SD drafts on its own thread. Sent to
the child instead, each such draft pays a pipe round trip and its q's copy (b = 8, T = 0.7: 0.7 ms a
round more draft wait than SD's, docs/benchmark-history.md, session 34). Here both halves hold every sequence and see every
outcome: the thread's worker drafts, the tree side builds trees; each runs the committed tokens it has not
seen in its next forward (the DraftWorker's KV invariant), so switching between the two costs no
extra forward pass. The price is a second copy of the draft's weights and KV in the engine's process.
On Ray it also saves every such draft its gRPC round trip (b = 1, T = 0.7: a 3.7 ms wait against 2.5).

A sequence the tree side cannot take (its prefill there failed: every pool worker dead, say) is held by
the thread's worker alone and drafted there, SD's rounds at SD's speed instead of the fast backup's, until
the tree side accepts sequences again; its next draft then fails (DraftUnavailable), and the engine
prefills it again on both halves. One the tree side refuses on its own (a ValueError: what it holds, not the
moment's; sd_loop.refused_for_good) is drafted here without trees to its end; a batch the tree side refuses is
refused whole (the engine then prefills each sequence on its own, and finds the one).
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Protocol

from saguaro_dist.distributed.errors import DraftUnavailable
from saguaro_dist.engine.draft_backend import DraftBackend, DraftLater, Lives, LocalDraftBackend
from saguaro_dist.engine.messages import JitDraftRequest, Outcome, Proposal

log = logging.getLogger(__name__)


class TreeSide(DraftBackend, Protocol):
    """Where the trees are built (DraftProcess, DraftPool): a DraftBackend that also takes held-back rounds."""

    def catch_up(self, rounds: list[list[Outcome]]) -> None: ...  # rounds that want no tree, in order
    def lost(self, seq_ids: list[int]) -> list[int]: ...  # those it no longer holds (restarted, worker dead)
    def accepting(self) -> bool: ...  # whether a prefill now could hold sequences (a live worker, a child to start)

MAX_UNOBSERVED = 1024  # rounds of outcomes the thread's worker may lag behind before it is sent them anyway
MAX_DEFERRED = 1024    # rounds without trees the tree side may lag behind before it is sent them anyway


class SplitDraftBackend:
    """A DraftBackend: `jit` drafts, `trees` builds; both observe every outcome (and the tree side drafts the
    cohorts, beside the engine's verify)."""

    drafts_beside = True

    def __init__(self, jit: LocalDraftBackend, trees: TreeSide):
        self.jit, self.trees = jit, trees
        self.max_model_len = min(jit.max_model_len, trees.max_model_len)
        self._unsent: list[Outcome] = []  # the just-in-time drafts' outcomes, sent with the next outcomes
        # Rounds that asked the tree side for no tree, not yet sent: it learns them (in order) with the next
        # outcomes that want one. Why: a post a round wakes the tree side's core, and a woken or spinning core
        # slows the target's on the other by ~4% here (b = 1, T = 0.7: ssd without trees 0.95 of sd, 0.99 so).
        self._deferred: list[list[Outcome]] = []
        # Outcomes the thread's worker has not observed, one batch a round (a batch holds a sequence once,
        # as DraftWorker.observe expects): it learns them right before its next draft, so a round with
        # trees costs the engine's process nothing (no work beside its verify, no GIL taken).
        self._unobserved: list[list[Outcome]] = []
        self._here_only: set[int] = set()  # sequences the tree side failed to take: drafted here, no trees
        self._trees_refused: set[int] = set()  # of those, the ones it refused on their own: never offered again
        self._held: set[int] = set()  # sequences the thread's worker holds (prefilled here, not released)
        # Each sequence's life as prefilled here: what goes to either half is stamped with it (the thread's half is
        # prefilled past its backend's own record), so a late one of an earlier life is dropped there.
        self._lives = Lives()

    def prefill(self, reqs):
        self.start_prefill(reqs).result()

    def start_prefill(self, reqs):
        """The tree side prefills from now on (beside the target's prefill); this half when taken, on the
        caller's thread, as SD's draft does (a worker thread woken for it cost ~1.3 ms a call here)."""
        self._forget([r.seq_id for r in reqs])  # a re-prefill restarts the sequence
        self._lives.begin(reqs)
        return DraftLater(partial(self._prefill_here, self.trees.start_prefill(reqs)), reqs)

    def _prefill_here(self, trees, reqs) -> None:
        try:
            self.jit.call(self.jit.worker.prefill, reqs)
        except BaseException:
            _settle(trees)  # this half's failure is the one to report
            raise
        self._held.update(r.seq_id for r in reqs)
        try:
            trees.result()
        except DraftUnavailable as err:  # no tree side for them now: this half drafts them alone meanwhile
            failed = err.seq_ids or [r.seq_id for r in reqs]
            log.log(logging.DEBUG if self._here_only else logging.WARNING, "the tree-building draft cannot take "
                    "sequences %s (%s): drafted beside the target, without trees, until it can", failed, err)
            self._here_only.update(failed)
        except ValueError as err:  # refused (sd_loop.refused_for_good); a batch: the engine finds which one, alone
            if len(reqs) > 1:
                raise
            log.warning("the tree-building draft refused sequence %d (%s): drafted beside the target, without trees",
                        reqs[0].seq_id, err)
            self._here_only.add(reqs[0].seq_id)
            self._trees_refused.add(reqs[0].seq_id)

    def jit_draft(self, reqs: list[JitDraftRequest]) -> list[Proposal]:
        reqs = self._lives.stamp(reqs)
        lost = self.lost([r.seq_id for r in reqs])
        if lost:  # the tree side lost them (restarted, a worker died) or can take them back: the engine
            raise DraftUnavailable(f"the tree-building draft lost sequences {lost}", lost)  # re-prefills both halves
        observed, self._unobserved = self._unobserved, []
        proposals = self.jit.call(self._observe_then_draft, (observed, reqs))
        self._unsent += [_as_outcome(r, p) for r, p in zip(reqs, proposals)]
        if all(r.skip_tree for r in reqs):  # no tree wanted: no send_outcomes need follow this round
            self._flush([])
        return proposals

    def start_jit_draft(self, reqs: list[JitDraftRequest]) -> "_TreeSideDrafts | DraftLater":
        """The tree side drafts these while the engine verifies others (two cohorts in flight); the thread's
        worker learns them as outcomes before its next draft. Sequences held here alone are drafted here,
        when taken."""
        reqs = self._lives.stamp(reqs)
        if self._here_only.intersection(r.seq_id for r in reqs):
            return DraftLater(self.jit_draft, reqs)
        self._flush([])  # the tree side drafts after every outcome before these
        return _TreeSideDrafts(self, reqs, self.trees.start_jit_draft(reqs))

    def learn_drafted(self, reqs: list[JitDraftRequest], proposals: list[Proposal]) -> None:
        """Drafts the tree side made (start_jit_draft): the thread's worker observes them before its next
        draft (those of sequences released meanwhile dropped: that worker no longer holds them). A sequence
        the tree side lost since is learned all the same: the engine verifies its draft, and the outcomes that
        follow reach this worker (a batch holding one it cannot follow fails whole, the others' drafts too)."""
        learned = [_as_outcome(r, p) for r, p in zip(reqs, proposals) if r.seq_id in self._held]
        if learned:
            self._unobserved.append(learned)

    def send_outcomes(self, outcomes):
        outcomes = self._lives.stamp(outcomes)
        if outcomes:
            self._unobserved.append(outcomes)
        if len(self._unobserved) > MAX_UNOBSERVED:  # a long run of rounds with trees: keep the list short
            observed, self._unobserved = self._unobserved, []
            self.jit.submit(self._observe, observed)
        self._flush(outcomes)

    def wait_trees(self, keys, timeout_s, outcomes=None):
        return self.trees.wait_trees(keys, timeout_s, outcomes)

    def wait_plans(self, keys, timeout_s):
        return self.trees.wait_plans(keys, timeout_s)

    def release(self, reqs):
        reqs = self._lives.stamp(reqs)
        self._forget([r.seq_id for r in reqs])
        self._lives.end(r.seq_id for r in reqs)
        self._held.difference_update(r.seq_id for r in reqs)
        self.jit.release(reqs)
        self.trees.release(reqs)

    def reset_prefix_cache(self, msg):
        self.jit.reset_prefix_cache(msg)
        self._send_deferred()
        self.trees.reset_prefix_cache(msg)

    def workers(self) -> tuple[int, int]:
        """The tree side's (this half drafts whenever the engine runs)."""
        return self.trees.workers()

    def graph_captures(self) -> int:
        return self.trees.graph_captures()  # the just-in-time half's are this process's own

    def close(self) -> None:
        self.jit.close()
        self.trees.close()

    def _observe_then_draft(self, arg: tuple[list[list[Outcome]], list[JitDraftRequest]]) -> list[Proposal]:
        observed, reqs = arg
        self._observe(observed)
        return self.jit.worker.jit_draft(reqs)

    def _observe(self, rounds: list[list[Outcome]]) -> None:
        for outcomes in rounds:  # in order: a later round's outcome of a sequence needs the earlier one
            self.jit.worker.observe(outcomes)

    def lost(self, seq_ids: list[int]) -> list[int]:
        """Those to prefill again: lost by the tree side, or held here alone while it accepts sequences (asked
        every round, and before each just-in-time draft)."""
        if not self._here_only:
            return self.trees.lost(seq_ids)
        here = [sid for sid in seq_ids if sid in self._here_only and sid not in self._trees_refused]
        lost = self.trees.lost([sid for sid in seq_ids if sid not in self._here_only])
        return lost + here if here and self.trees.accepting() else lost

    def _forget(self, seq_ids: list[int]) -> None:
        """Drop what waits to go out of these sequences (released, or re-prefilled: a new life)."""
        self._unobserved, self._deferred = _without(self._unobserved, seq_ids), _without(self._deferred, seq_ids)
        gone = set(seq_ids)
        self._unsent = [o for o in self._unsent if o.seq_id not in gone]
        self._here_only.difference_update(seq_ids)
        self._trees_refused.difference_update(seq_ids)

    def _flush(self, outcomes: list[Outcome]) -> None:
        """One message: the tree side then builds this round's trees, drafted or cached, in one batch. A round
        that wants no tree is kept back (up to MAX_DEFERRED rounds) and goes with the next that does."""
        batch, self._unsent = self._unsent + outcomes, []
        if self._here_only:  # the tree side does not hold them
            batch = [o for o in batch if o.seq_id not in self._here_only]
        if batch and all(o.skip_tree for o in batch) and len(self._deferred) < MAX_DEFERRED:
            self._deferred.append(batch)
            return
        self._send_deferred()
        if batch:
            self.trees.send_outcomes(batch)

    def _send_deferred(self) -> None:
        rounds, self._deferred = self._deferred, []
        if rounds:
            self.trees.catch_up(rounds)


class _TreeSideDrafts:
    """PendingDrafts drafted by the tree side: once taken, queued for the thread's worker to observe."""

    def __init__(self, split: SplitDraftBackend, reqs: list[JitDraftRequest], pending):
        self._split, self._reqs, self._pending = split, reqs, pending

    def result(self) -> list[Proposal]:
        try:
            proposals = self._pending.result()
        except DraftUnavailable as err:
            # The engine verifies the drafts that did come (err.partial, another worker's failure aside): the
            # thread's worker must learn them too. Unlearned, a first draft left it at round 0 with no
            # speculation, where the next round's draft (k* = 0) passed its round check and committed the bonus
            # without the first token: a wrong context, drafting at a length the tree side had drawn at.
            drafted = [r for r in self._reqs if r.seq_id in err.partial]
            self._split.learn_drafted(drafted, [err.partial[r.seq_id] for r in drafted])
            raise
        self._split.learn_drafted(self._reqs, proposals)
        return proposals


def _settle(pending) -> None:
    """Wait for pending work whose outcome no longer matters (its failure is logged, not raised)."""
    try:
        pending.result()
    except Exception as exc:  # noqa: BLE001 - the caller reports another failure
        log.info("the tree side's part failed too: %s", exc)


def _without(rounds: list[list[Outcome]], seq_ids: list[int]) -> list[list[Outcome]]:
    """The rounds less the outcomes of seq_ids (rounds left empty dropped)."""
    gone = set(seq_ids)
    kept = ([o for o in outcomes if o.seq_id not in gone] for outcomes in rounds)
    return [outcomes for outcomes in kept if outcomes]


def _as_outcome(r: JitDraftRequest, p: Proposal) -> Outcome:
    """The tree side learns a just-in-time draft as an outcome whose next speculation is its tokens (round
    R's draft follows round R - 1's outcome; a sequence's first draft is round 0 on both sides), of the draft's life."""
    return Outcome(r.seq_id, max(r.round - 1, 0), r.accepted, r.bonus_token, next_tokens=p.tokens.tolist(),
                   skip_tree=r.skip_tree, generation=r.generation)
