"""The draft pool: sequences spread over draft workers, and cache-parallel speculation.

When the pool is larger than the batch needs, one sequence lives on several workers (shards); each
builds a disjoint slice of a tree num_shards times the configured budget, so at batch 1 a bigger pool
means a bigger speculation cache. Shard 0 answers just-in-time drafts; the other shards learn those
tokens as an Outcome, and every Outcome names the tokens verified next, so all shards stay in step.

A worker found dead (a failed call, a missed deadline, or no tree by the deadline in
LATE_TREE_WAITS_BEFORE_DEAD tree waits in a row) is left out of placement; given `revive`, the pool waits
for it in the background (on Ray: the actor restarted at a new address, or the same process answering
again) and takes it back into placement once it serves again, having released there what it held. Those
sequences are lost with it (`lost`): the engine prefills them again wherever there is room.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Callable

from saguaro_dist.distributed.draft_health import (LATE_TREE_WAITS_BEFORE_DEAD, REVIVAL_RESET_S, revival_delay_s,
                                                   revivals_counted)
from saguaro_dist.distributed.errors import DraftOutOfSync, DraftUnavailable
from saguaro_dist.engine.draft_backend import DraftLater, FailedDrafts, Lives
from saguaro_dist.engine.messages import (
    JitDraftRequest, Outcome, PrefillRequest, Proposal, Release, ResetPrefixCache, SpeculationTree, TreePlan,
)

log = logging.getLogger(__name__)


class DraftPool:
    """A DraftBackend over several single-worker backends (engine/draft_backend.py's interface)."""

    def __init__(self, backends: list, max_batch_size: int, max_model_len: int = sys.maxsize,
                 revive: Callable[[int], object] | None = None, revival_reset_s: float = REVIVAL_RESET_S):
        """max_model_len: the longest sequence the workers hold (the DraftFit they were built to).
        revive(i): blocks until worker i serves again and returns a fresh backend for it (a GrpcDraftBackend:
        the pool releases there what the worker held, release_held_before), or raises when it never will
        (called on a thread of its own). revival_reset_s: see REVIVAL_RESET_S."""
        if revival_reset_s < 0:
            raise ValueError(f"revival_reset_s must be >= 0, got {revival_reset_s}")
        self.backends = backends
        self.drafts_beside = all(b.drafts_beside for b in backends)
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.groups: dict[int, list[int]] = {}   # seq_id -> backend indices; [0] is shard 0
        # Each sequence's life as placed here: what goes to its workers is stamped with it, so a worker drops one
        # that its re-prefill overtook (a unary prefill beside the stream the others travel on).
        self._lives = Lives()
        self.dead: set[int] = set()
        self._revive = revive
        self._revived: queue.SimpleQueue = queue.SimpleQueue()  # (i, backend) from the revival threads
        self.revivals = [0] * len(backends)  # per worker: revivals in a row (revivals_counted), its backoff
        self.revival_reset_s = revival_reset_s
        self._taken_back_at: list[float | None] = [None] * len(backends)  # per worker: monotonic time, or never
        # Closing: set under _hand_back_lock, so a revival thread never queues a backend after close() drained them.
        self._closing = threading.Event()
        self._hand_back_lock = threading.Lock()
        self.late_waits = [0] * len(backends)  # per worker: tree waits in a row that reached their deadline empty
        # Per worker: the keys its last plan wait reached the deadline without (counted as a late wait). The
        # same round's tree wait then takes what is there: one stall costs a round one timeout, counted once.
        self._late_plans: dict[int, set] = {}
        self._calls = ThreadPoolExecutor(max_workers=max(1, len(backends)), thread_name_prefix="saguaro-pool")

    # ---- placement ----------------------------------------------------------------------------------
    def _live(self) -> list[int]:
        self._take_back_revived()
        for i in range(len(self.backends)):
            if i not in self.dead and self.backends[i].dead_addresses:  # found dead by its stream, not yet here
                self._mark_dead(i)
        return [i for i in range(len(self.backends)) if i not in self.dead]

    def accepting(self) -> bool:
        """Whether a prefill now finds a live worker."""
        return bool(self._live())

    def _load(self, i: int) -> int:
        return sum(i in g for g in self.groups.values())

    def _place(self, seq_ids: list[int]) -> None:
        """Shards per sequence: the live workers shared out over the sequences that will be running."""
        live = self._live()
        if not live:
            raise DraftUnavailable("no live draft worker", seq_ids)
        active = len(set(self.groups) | set(seq_ids))
        shards = max(1, min(len(live), len(live) // max(1, min(active, self.max_batch_size))))
        for seq_id in seq_ids:
            self.groups[seq_id] = sorted(live, key=self._load)[:shards]

    # ---- DraftBackend -------------------------------------------------------------------------------
    def prefill(self, reqs: list[PrefillRequest]) -> None:
        """Place and prefill; a worker found dead on the way costs a retry on the others."""
        self.start_prefill(reqs).result()

    def start_prefill(self, reqs: list[PrefillRequest]) -> DraftLater | FailedDrafts:
        """Place now and start every worker's part (the target prefills meanwhile); result() waits for
        them, retrying on the others what a worker found dead had."""
        previous = {r.seq_id: self.groups.pop(r.seq_id, []) for r in reqs}
        try:
            self._place([r.seq_id for r in reqs])
        except DraftUnavailable as exc:
            return FailedDrafts(exc)
        self._release_moved(previous)  # of the earlier life: before the new one begins
        self._lives.begin(reqs)
        parts = defaultdict(list)
        for r in reqs:
            group = self.groups[r.seq_id]
            for shard, i in enumerate(group):
                parts[i].append(PrefillRequest(r.seq_id, r.prompt_token_ids, r.sampling, shard, len(group), r.prompt_len,
                                               r.generation, r.cache_salt))  # one life: every shard's slices answer its rounds
        pending = {i: self.backends[i].start_prefill(part) for i, part in parts.items()}
        return DraftLater(partial(self._prefilled, pending=pending), reqs)

    def _prefilled(self, reqs: list[PrefillRequest], pending: dict) -> None:
        failed, refused = set(), None
        for i, part in pending.items():  # every part taken: each backend settles its own (a refused part unplaced)
            try:
                part.result()
            except DraftUnavailable:
                self._mark_dead(i)
                failed.add(i)
            except Exception as exc:  # noqa: BLE001 - raised once every part is in: the engine prefills them again
                refused = refused or exc
        if refused is not None:
            raise refused
        retry = [r for r in reqs if set(self.groups[r.seq_id]) & failed]
        if retry:
            self.prefill(retry)

    def jit_draft(self, reqs: list[JitDraftRequest]) -> list[Proposal]:
        """Shard 0 drafts; the other shards are told the tokens as the outcome they follow from."""
        return self.start_jit_draft(reqs).result()

    def start_jit_draft(self, reqs: list[JitDraftRequest]) -> DraftLater:
        """Each worker's part asked at once (its backend drafts beside the caller); result() gathers them."""
        # A lost sequence (`lost`: a worker it was placed on marked dead, or taken back since without it) fails
        # at once, alone, so the engine prefills it again on a live worker: asked of a worker that stalled (its
        # trees late) it waited out the draft deadline, and asked of one taken back (which released it there)
        # its UnknownSequence failed the whole batch, every worker's drafts, to the fast backup and a re-prefill.
        reqs = self._lives.stamp(reqs)  # the other shards' outcomes (_tell_other_shards) copy their lives
        lost = set(self.lost([r.seq_id for r in reqs]))
        parts = defaultdict(list)
        for r in reqs:
            parts[None if r.seq_id in lost else self.groups[r.seq_id][0]].append(r)
        homeless = [r.seq_id for r in parts.pop(None, [])]
        pending = {i: self.backends[i].start_jit_draft(part) for i, part in parts.items()}
        return DraftLater(partial(self._answers, parts=parts, pending=pending, homeless=homeless), reqs)

    def _answers(self, reqs: list[JitDraftRequest], parts: dict, pending: dict, homeless: list[int]) -> list[Proposal]:
        found, failed = self._collect_jit(parts, pending)
        failed += homeless
        # (a sequence released since the draft was asked, two cohorts in flight, has no shards left to tell)
        self._tell_other_shards([r for r in reqs if r.seq_id in found and r.seq_id in self.groups], found)
        if failed:
            raise DraftUnavailable(f"draft worker unavailable for sequences {failed}", failed, found)
        return [found[r.seq_id] for r in reqs]

    def send_outcomes(self, outcomes: list[Outcome]) -> None:
        self._send(self._by_worker(self._lives.stamp(outcomes)))

    def catch_up(self, rounds: list[list[Outcome]]) -> None:
        """Rounds of outcomes that want no tree, in order, to every shard of their sequences."""
        parts = defaultdict(list)
        for outcomes in rounds:
            for i, part in self._by_worker(self._lives.stamp(outcomes)).items():
                parts[i].append(part)
        for i, part in parts.items():
            self.backends[i].catch_up(part)

    def lost(self, seq_ids: list[int]) -> list[int]:
        """Those of seq_ids not held by every worker they were placed on: prefill them again."""
        return [sid for sid in seq_ids if not self.groups.get(sid)
                or any(i in self.dead or self.backends[i].lost([sid]) for i in self.groups[sid])]

    def wait_plans(self, keys, timeout_s: float) -> dict[int, TreePlan]:
        """The plans among keys by one deadline, each from the worker its sequence lives on. A sequence split
        over several workers is not asked for: the draft couples a tree's bonus draws only when one worker
        builds all of it, so its slices' plans never carry a guess. A worker that brings none of its plans by the
        deadline has a late wait counted, as for trees, and is not waited for again for this round's trees."""
        deadline = time.monotonic() + timeout_s
        parts = defaultdict(list)
        for key in keys:
            group = self.groups.get(key[0], [])
            if len(group) == 1 and group[0] not in self.dead:
                parts[group[0]].append(key)
        plans, self._late_plans = {}, {}
        for i, part in parts.items():  # the later workers' plans arrive while the first one's are waited for
            found = self.backends[i].wait_plans(part, max(0.0, deadline - time.monotonic()))
            plans.update(found)
            if not found and 0 < timeout_s and deadline <= time.monotonic():
                self._late_plans[i] = set(part)
                self._note_tree_wait(i, in_time=False)
        return plans

    def wait_trees(self, keys, timeout_s: float, outcomes=None) -> dict[int, SpeculationTree]:
        """Each worker's slices, gathered by one deadline; a worker that keeps bringing none by it is dead.
        A worker whose plan lacks a sequence's outcome is not waited for: another slice may hold it."""
        deadline = time.monotonic() + timeout_s
        parts = defaultdict(list)
        for key in keys:
            for i in self.groups.get(key[0], []):
                if i not in self.dead:  # its sequences are lost: they are prefilled again before their next draft
                    parts[i].append(key)
        slices = defaultdict(list)
        for i, part in parts.items():
            # Its plans for this round, built in the same batch as every tree it owes, ran out: a stall.
            counted = not self._late_plans.pop(i, set()).isdisjoint(part)
            trees = self.backends[i].wait_trees(part, 0.0 if counted else max(0.0, deadline - time.monotonic()), outcomes)
            if trees or not counted:
                self._note_tree_wait(i, bool(trees) or timeout_s <= 0 or time.monotonic() < deadline)
            for seq_id, tree in trees.items():
                slices[seq_id].append(tree)
        return {seq_id: SpeculationTree.concat(trees) for seq_id, trees in slices.items()}

    def _note_tree_wait(self, i: int, in_time: bool) -> None:
        """Count worker i's waits that reached the deadline with none of its trees in; too many in a row:
        dead (the revival thread takes it back once it serves again, as after a missed draft deadline)."""
        self.late_waits[i] = 0 if in_time else self.late_waits[i] + 1
        if self.late_waits[i] >= LATE_TREE_WAITS_BEFORE_DEAD:
            log.warning("draft worker %d sent no speculation tree within the timeout %d times in a row",
                        i, self.late_waits[i])
            self.late_waits[i] = 0
            self._mark_dead(i)

    def release(self, reqs: list[Release]) -> None:
        self._forget(self._lives.stamp(reqs))
        self._lives.end(r.seq_id for r in reqs)

    def reset_prefix_cache(self, msg: ResetPrefixCache) -> None:
        for i in self._live():
            self.backends[i].reset_prefix_cache(msg)

    def workers(self) -> tuple[int, int]:
        """(in placement, all): a dead worker counts from when the pool marks it, a revived one from when it
        is taken back (both at the latest by the next prefill)."""
        return len(self.backends) - len(self.dead), len(self.backends)

    def graph_captures(self) -> int:
        return sum(b.graph_captures() for b in self.backends)

    def close(self) -> None:
        """A revival thread waiting out its delay ends at once; one inside revive() closes what it gets."""
        with self._hand_back_lock:
            self._closing.set()
        while not self._revived.empty():  # revived but never taken back
            self._revived.get_nowait()[1].close()
        # At once: each lets its stream's releases out and waits (up to ~2 s) for its server to end it; not on
        # self._calls, whose threads may be inside calls that only this close ends.
        closing = [threading.Thread(target=b.close, name="saguaro-draft-close", daemon=True) for b in self.backends]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()
        self._calls.shutdown(wait=False, cancel_futures=True)

    # ---- helpers ------------------------------------------------------------------------------------
    def _run(self, parts: dict, call) -> dict[int, Future]:
        """call(backend, part) for every part at once; a lone part runs inline (no thread hand-off:
        at batch 1 with one worker, every just-in-time draft would pay two wake-ups for nothing)."""
        if len(parts) != 1:
            return {i: self._calls.submit(call, self.backends[i], part) for i, part in parts.items()}
        ((i, part),) = parts.items()
        done: Future = Future()
        try:
            done.set_result(call(self.backends[i], part))
        except Exception as exc:  # raised where the caller reads it, as from a pool thread
            done.set_exception(exc)
        return {i: done}

    def _collect_jit(self, parts: dict, pending: dict) -> tuple[dict, list[int]]:
        found, failed = {}, []
        for i, answer in pending.items():
            try:
                found.update({r.seq_id: p for r, p in zip(parts[i], answer.result())})
            except DraftUnavailable as err:
                if not isinstance(err, DraftOutOfSync):  # out of sync: its sequences re-prefill, it stays
                    self._mark_dead(i)
                found.update(err.partial)
                failed += [r.seq_id for r in parts[i] if r.seq_id not in err.partial]
        return found, failed

    def _tell_other_shards(self, reqs: list[JitDraftRequest], proposals: dict) -> None:
        outcomes = [Outcome(r.seq_id, max(0, r.round - 1), r.accepted, r.bonus_token, generation=r.generation,
                            next_tokens=proposals[r.seq_id].tokens.tolist(), skip_tree=r.skip_tree) for r in reqs]
        parts = defaultdict(list)
        for o in outcomes:
            for i in self.groups[o.seq_id][1:]:
                parts[i].append(o)
        self._send(parts)

    def _send(self, parts: dict) -> None:
        """Outcomes to every worker at once: a gRPC backend returns once they are sent (its hand-off),
        so one worker after another would add those waits up."""
        for fut in self._run(parts, lambda backend, part: backend.send_outcomes(part)).values():
            fut.result()

    def _by_worker(self, outcomes: list[Outcome]) -> dict[int, list[Outcome]]:
        """Each worker's part: the outcomes of the sequences it holds a shard of."""
        parts = defaultdict(list)
        for o in outcomes:
            for i in self.groups.get(o.seq_id, []):
                parts[i].append(o)
        return parts

    def _mark_dead(self, i: int) -> None:
        if i in self.dead:
            return
        log.warning("draft worker %d is gone; its sequences move to the others", i)
        self.dead.add(i)
        if self._revive is not None and not self._closing.is_set():
            # Each in the life it has now: a later life of it there (however it got there) is not the revival's to end.
            # With them, those released there whose releases it may not have read (lost with a stream, say).
            held = [Release(seq_id, self._lives.of(seq_id)) for seq_id, group in self.groups.items() if i in group]
            held += self.backends[i].unconfirmed_releases()
            self.revivals[i] = revivals_counted(self.revivals[i], self._served_s(i), self.revival_reset_s)
            threading.Thread(target=self._await_revival, args=(i, held), daemon=True, name=f"saguaro-revive-{i}").start()

    def _served_s(self, i: int) -> float | None:
        """How long worker i has been in placement since it was last taken back (None: never taken back)."""
        since = self._taken_back_at[i]
        return None if since is None else time.monotonic() - since

    def _await_revival(self, i: int, held: list[Release]) -> None:
        """Wait (backing off for a worker taken back before) until worker i serves again without `held`:
        Ray restarted it (a fresh process holds nothing), or it only missed a deadline and still held them."""
        while not self._closing.wait(revival_delay_s(self.revivals[i])):  # close() ends the wait at once
            try:
                backend = self._revive(i)
            except Exception as exc:  # noqa: BLE001 - gone for good: the pool goes on without it
                log.warning("draft worker %d will not be back (%s); the pool goes on without it", i, exc)
                return
            self.revivals[i] += 1
            if self._released_stale(i, backend, held):
                self._hand_back(i, backend)
                return

    def _hand_back(self, i: int, backend) -> None:
        """Queue the revived backend for the engine's thread; closed instead once the pool closes."""
        with self._hand_back_lock:
            if not self._closing.is_set():
                self._revived.put((i, backend))
                return
        backend.close()  # the engine shut down meanwhile: nobody would take it back

    def _released_stale(self, i: int, backend, held: list[Release]) -> bool:
        try:
            backend.release_held_before(held)
            return True
        except Exception as exc:  # noqa: BLE001 - not serving after all: try again later
            log.info("draft worker %d answered but could not release its old sequences (%s)", i, exc)
            backend.close()
            return False

    def _take_back_revived(self) -> None:
        """Revived workers rejoin placement (on the engine's thread: the pool's state is its own). The
        sequences of the old one stay lost: the new backend does not hold them."""
        while not self._revived.empty():
            i, backend = self._revived.get_nowait()
            old, self.backends[i] = self.backends[i], backend
            old.close()
            self.dead.discard(i)
            self.late_waits[i] = 0  # the old backend's count (one marked dead otherwise keeps it): not this one's
            self._taken_back_at[i] = time.monotonic()
            log.warning("draft worker %d serves again; it takes new and re-prefilled sequences", i)

    def _release_moved(self, previous: dict[int, list[int]]) -> None:
        """Release a re-placed sequence on the live workers it left (a worker it stays on re-prefills it)."""
        parts = defaultdict(list)
        for seq_id, old in previous.items():
            for i in set(old) - set(self.groups[seq_id]) - self.dead:
                parts[i].append(Release(seq_id, self._lives.of(seq_id)))
        for i, part in parts.items():
            self.backends[i].release(part)

    def _forget(self, reqs: list[Release]) -> None:
        parts = defaultdict(list)
        for r in reqs:
            for i in self.groups.pop(r.seq_id, []):
                parts[i].append(Release(r.seq_id, r.generation))
        for i, part in parts.items():
            self.backends[i].release(part)
