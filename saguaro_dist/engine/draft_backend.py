"""What the target-side round loop talks to: the draft side, wherever it runs."""
from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Protocol

from saguaro_dist.engine.messages import (
    JitDraftRequest, Outcome, PrefillRequest, Proposal, Release, ResetPrefixCache, SpeculationTree, TreePlan,
)
from saguaro_dist.engine.serial_thread import SerialThread
from saguaro_dist.model.device import OwnStream

log = logging.getLogger(__name__)
TreeKey = tuple[int, int]  # (seq_id, round)
Outcomes = dict[int, tuple[int, int]]  # seq_id -> the outcome (k, t) it looks up in its tree


class PendingDrafts(Protocol):
    def result(self) -> list[Proposal]: ...  # what jit_draft would have returned, or raised


class DraftBackend(Protocol):
    max_model_len: int  # the longest sequence the draft side holds (longer ones: the fast backup, engine/sd_loop.py)
    drafts_beside: bool  # start_jit_draft drafts while the caller goes on (else only when taken: no cohorts)

    def prefill(self, reqs: list[PrefillRequest]) -> None: ...
    # The same prefill, begun now and finished when taken (result() returns None or raises), so a draft
    # on other hardware prefills while the target does (engine/sd_loop.py: admit).
    def start_prefill(self, reqs: list[PrefillRequest]) -> PendingDrafts: ...
    def jit_draft(self, reqs: list[JitDraftRequest]) -> list[Proposal]: ...
    # The same draft, begun now and taken later, so the target can verify other sequences meanwhile
    # (engine/ssd_loop.py: two cohorts). A backend that cannot draft beside its caller (drafts_beside
    # False) drafts when the result is taken (DraftLater).
    def start_jit_draft(self, reqs: list[JitDraftRequest]) -> PendingDrafts: ...
    def send_outcomes(self, outcomes: list[Outcome]) -> None: ...
    # The trees among keys that arrive by the deadline. With `outcomes`, a key whose TreePlan has come
    # and lacks its outcome is not waited for (its tree could not answer it).
    def wait_trees(self, keys: list[TreeKey], timeout_s: float, outcomes: Outcomes | None = None
                   ) -> dict[int, SpeculationTree]: ...
    # The plans among keys that arrive by the deadline (a key whose tree came without a plan settles too):
    # the target draws a sampled row's bonus against its plan's candidates (coupled bonus draws).
    def wait_plans(self, keys: list[TreeKey], timeout_s: float) -> dict[int, TreePlan]: ...
    def release(self, reqs: list[Release]) -> None: ...
    # Those of seq_ids to prefill again: their worker or child died, or restarted without them. Asked every
    # round: a loop that asks for no draft (trees every round, misses on the fast backup) learns it only here.
    def lost(self, seq_ids: list[int]) -> list[int]: ...
    def reset_prefix_cache(self, msg: ResetPrefixCache) -> None: ...  # fire and forget, after what came before
    def workers(self) -> tuple[int, int]: ...  # (live, all) draft workers the engine places sequences on
    # CUDA-graph captures of the draft's other processes (their starts and ends, as last heard; this
    # process's own are cuda_graphs.graph_captures): a round during which either count moved timed a
    # capture, and the tree gate leaves it out (engine/ssd_loop.py). 0 where every draft is in-process.
    def graph_captures(self) -> int: ...
    def close(self) -> None: ...


class DraftLater:
    """PendingDrafts of a backend that drafts on its caller's thread: the draft runs when it is taken."""

    def __init__(self, jit_draft, reqs: list[JitDraftRequest]):
        self._jit_draft, self._reqs = jit_draft, reqs

    def result(self) -> list[Proposal]:
        return self._jit_draft(self._reqs)


class FailedDrafts:
    """PendingDrafts that failed before the draft was asked: result() raises it."""

    def __init__(self, error: Exception):
        self._error = error

    def result(self) -> list[Proposal]:
        raise self._error


class Lives:
    """The life each sequence is in on the draft side, as this side last prefilled it (its
    PrefillRequest.generation). A re-prefill restarts the rounds at 0, so a message is told apart from an
    earlier life's of the same round by its generation alone, whatever order the transport delivers it in:
    the target drops such trees and plans, and stamps its outcomes, drafts and releases (stamp); the draft
    worker drops those of an earlier life. Not thread-safe: its owner's lock guards it."""

    def __init__(self):
        self._generation: dict[int, int] = {}

    def of(self, seq_id: int) -> int:
        """The sequence's current life; 0 (none named) for one without a life here."""
        return self._generation.get(seq_id, 0)

    def stamp(self, msgs: list) -> list:
        """msgs, each that names no life (0: built where the life is not known, as the round loops build them)
        as a copy stamped with its sequence's current one (a copy: the caller's message stays as built, and may go
        to another draft side). Done as they go out, on the thread that also prefills: a message built for a life
        goes out before any re-prefill of its sequence, so the life current then is the one it was built in (one
        made later from an earlier message, a shard's outcome from a draft, copies that one's)."""
        return [m if m.generation or not self.of(m.seq_id) else _with_generation(m, self.of(m.seq_id)) for m in msgs]

    def begin(self, reqs: list[PrefillRequest]) -> None:
        """Called before the prefills go out: a life's trees can only come after its prefill."""
        self._generation.update((r.seq_id, r.generation) for r in reqs)

    def end(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._generation.pop(seq_id, None)

    def stale(self, msg) -> bool:
        """Whether msg (any message with a seq_id and a generation) is of another life than its sequence's current
        one. Not one of a sequence without a life here (the owner filters released sequences by what it holds),
        nor one that carries none (0: a peer that keeps no lives, whose stale trees only the drop at begin
        catches, as before lives)."""
        current = self._generation.get(msg.seq_id)
        return msg.generation != 0 and current is not None and current != msg.generation


def _with_generation(msg, generation: int):
    """A shallow copy of msg naming that life (copy.copy: a third of dataclasses.replace's time, per message)."""
    stamped = copy.copy(msg)
    stamped.generation = generation
    return stamped


class TreeInbox:
    """Trees as they arrive, and the plans announcing them, keyed by (seq_id, round), those of a sequence's
    earlier life dropped (Lives); waiters wake when theirs land."""

    def __init__(self):
        self._trees: dict[TreeKey, SpeculationTree] = {}
        self._plans: dict[TreeKey, TreePlan] = {}
        self._late: set[TreeKey] = set()  # this round's keys whose plans did not come by the plan wait's deadline
        self._lives = Lives()
        self._cond = threading.Condition()

    def begin(self, reqs: list[PrefillRequest]) -> None:
        """New lives, before their prefills go out: what is here of their sequences is of earlier lives, and
        what comes of those from now on is dropped as it arrives."""
        with self._cond:
            self._lives.begin(reqs)
            self._drop([r.seq_id for r in reqs])

    def stamp(self, msgs: list) -> list:
        """Outcomes, drafts or releases going out, stamped with their sequences' lives (Lives.stamp)."""
        with self._cond:
            return self._lives.stamp(msgs)

    def put(self, trees: list[SpeculationTree]) -> None:
        with self._cond:
            for t in trees:
                if not self._lives.stale(t):
                    self._trees[(t.seq_id, t.round)] = t
            self._cond.notify_all()

    def put_plans(self, plans: list[TreePlan]) -> None:
        with self._cond:
            for p in plans:
                if not self._lives.stale(p):
                    self._plans[(p.seq_id, p.round)] = p
            self._cond.notify_all()

    def take(self, keys: list[TreeKey], timeout_s: float, outcomes: Outcomes | None = None) -> dict[int, SpeculationTree]:
        """Wait until every key is settled (its tree in, or its plan lacking its outcome) or the deadline
        passes; return (and forget) the trees that came. No wait where the round's plans ran out (late_plans)."""
        deadline = time.monotonic() + (0.0 if self.late_plans(keys) else timeout_s)
        with self._cond:
            while not self._settled(keys, outcomes):
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    break
            found = {k[0]: self._trees.pop(k) for k in keys if k in self._trees}
            self._drop_older_than(keys)
            return found

    def plans(self, keys: list[TreeKey], timeout_s: float) -> dict[int, TreePlan]:
        """Wait until every key has its plan (or its tree, which came unannounced) or the deadline passes;
        return the plans that came, keeping them (take settles the round). Keys still unplanned after a
        wait (timeout_s > 0) have late plans (note_late_plans)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._planned(keys):
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    break
            if timeout_s > 0:
                self.note_late_plans(keys)
            return {k[0]: self._plans[k] for k in keys if k in self._plans}

    def note_late_plans(self, keys: list[TreeKey]) -> None:
        """After a plan wait that reached its deadline: the keys still without a plan (or tree). A draft sends
        a round's plans before its trees, so none of their trees is in either: a stall, which the plan wait
        has already waited out once; the round's take does not wait for it a second time."""
        with self._cond:
            self._late = {k for k in keys if not (k in self._plans or k in self._trees)}

    def late_plans(self, keys: list[TreeKey]) -> bool:
        """Whether any of keys had late plans this round (note_late_plans); forgets them."""
        with self._cond:
            late, self._late = self._late, set()
            return not late.isdisjoint(keys)

    def has_plans(self, keys: list[TreeKey]) -> bool:
        with self._cond:
            return self._planned(keys)

    def _planned(self, keys: list[TreeKey]) -> bool:
        return all(k in self._plans or k in self._trees for k in keys)

    def forget(self, seq_ids) -> None:
        """Released sequences: drop their trees (the last round's tree always arrives unasked)."""
        gone = set(seq_ids)
        with self._cond:
            self._lives.end(gone)
            self._drop(gone)

    def _drop(self, seq_ids) -> None:
        gone = set(seq_ids)
        for store in (self._trees, self._plans):
            for key in [k for k in store if k[0] in gone]:
                del store[key]

    def __len__(self) -> int:
        with self._cond:
            return len(self._trees)

    def has(self, keys: list[TreeKey], outcomes: Outcomes | None = None) -> bool:
        with self._cond:
            return self._settled(keys, outcomes)

    def _settled(self, keys: list[TreeKey], outcomes: Outcomes | None) -> bool:
        """Every key's tree is in, or its plan is and lacks the outcome looked up (a miss, known early)."""
        return all(k in self._trees or plan_misses(self._plans.get(k), outcomes, k[0]) for k in keys)

    def _drop_older_than(self, keys: list[TreeKey]) -> None:
        """Late trees (and plans) of past rounds will never be asked for again."""
        current = dict(keys)
        for store in (self._trees, self._plans):
            for key in [k for k in store if k[0] in current and k[1] <= current[k[0]]]:
                del store[key]


def plan_misses(plan: TreePlan | None, outcomes: Outcomes | None, seq_id: int) -> bool:
    """Whether `plan` says its tree will not answer the outcome sequence seq_id looks up."""
    if plan is None or outcomes is None or seq_id not in outcomes:
        return False
    return not plan.holds(*outcomes[seq_id])


class LocalDraftBackend:
    """A DraftWorker on its own thread in this process: the one-host engine.

    Every call is serialised (one at a time, in order), so the worker needs no locks of its own. Tree
    building runs on the worker thread while the target verifies on the caller's thread (torch releases
    the GIL in its ops). A call the caller waits for (a just-in-time draft, a prefill) runs on the
    caller's thread when nothing is queued: there is nothing to overlap, and waking the idle worker
    thread cost 1.3 ms on this project's VM (a thread that slept 5 ms: 1.55 ms a call against 0.27 ms
    inline, median of 300), more than SD's whole draft at b = 1. On a GPU the calls run on a CUDA
    stream of their own, so tree kernels overlap the target's.
    """

    drafts_beside = True  # on the worker thread (torch ops release the GIL) or its CUDA stream

    def __init__(self, worker):
        self.worker = worker
        self.max_model_len = worker.runner.max_model_len
        self.stream = OwnStream(worker.runner.device)
        self.inbox = TreeInbox()
        self.busy_s = 0.0  # time the draft worker spent working (on either thread)
        self._pool = SerialThread("saguaro-draft")
        self._queued = 0                   # calls submitted and not finished (under _lock)
        self._lock = threading.Lock()
        self._running = threading.Lock()   # held by the one call running, on whichever thread

    def prefill(self, reqs):
        self.inbox.begin(reqs)
        self.call(self.worker.prefill, reqs)

    def start_prefill(self, reqs):
        return DraftLater(self.prefill, reqs)  # on the caller's thread when taken (after the target's, as SD's draft)

    def jit_draft(self, reqs):
        return self.call(self.worker.jit_draft, self.inbox.stamp(reqs))

    def start_jit_draft(self, reqs):
        return self.submit(self.worker.jit_draft, self.inbox.stamp(reqs))  # a Future: torch ops release the GIL

    def send_outcomes(self, outcomes):
        self.submit(self._observe_and_build, self.inbox.stamp(outcomes))

    def wait_trees(self, keys, timeout_s, outcomes=None):
        return self.inbox.take(keys, timeout_s, outcomes)

    def wait_plans(self, keys, timeout_s):
        return self.inbox.plans(keys, timeout_s)

    def release(self, reqs):
        self.submit(self._release, self.inbox.stamp(reqs))  # on the worker thread: after any build that puts their trees

    def lost(self, seq_ids):
        return []  # the worker lives in this process: it dies with the engine

    def reset_prefix_cache(self, msg):
        self.submit(lambda _: self.worker.reset_prefix_cache(), msg)

    def workers(self) -> tuple[int, int]:
        return 1, 1

    def graph_captures(self) -> int:
        return 0  # in this process: cuda_graphs.graph_captures counts them

    def close(self):
        self._pool.shutdown()

    def _release(self, reqs):
        self.worker.release(reqs)
        self.inbox.forget([r.seq_id for r in reqs])

    def _observe_and_build(self, outcomes):
        self.worker.observe(outcomes)
        self.inbox.put_plans(self.worker.plan_trees())
        self.inbox.put(self.worker.finish_trees())

    def submit(self, fn, arg):
        """fn(arg) on the worker thread, after every call before it; returns its Future."""
        with self._lock:
            self._queued += 1
        return self._pool.submit(self._run, fn, arg)

    def call(self, fn, arg):
        """fn(arg) after every call before it; its result. On this thread when none is queued."""
        with self._lock:
            inline = self._queued == 0
            self._queued += inline
        return self._run(fn, arg) if inline else self.submit(fn, arg).result()

    def _run(self, fn, arg):
        start = time.perf_counter()
        try:
            with self._running, self.stream():
                return fn(arg)
        except Exception:
            # A failed tree build costs a miss (the target falls back), never a token.
            log.exception("draft worker call %s failed", getattr(fn, "__name__", fn))
            raise
        finally:
            self.busy_s += time.perf_counter() - start
            with self._lock:
                self._queued -= 1
