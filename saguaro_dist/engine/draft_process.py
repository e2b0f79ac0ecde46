"""The one-host engine's draft in a child process: the child's side, run as `python -m
saguaro_dist.engine.draft_process`. The parent's side, DraftProcess, and why a process and a pipe:
engine/draft_process_parent.py (re-exported here, its old home).
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
from collections import deque
from multiprocessing.connection import Connection

from saguaro_dist.engine.draft_process_parent import (  # noqa: F401  re-exported: the old import paths
    CALL_TIMEOUT_S, START_TIMEOUT_S, STOP, WAIT_SPIN_S, DraftProcess, _Reply,
)
from saguaro_dist.engine.pipe_wire import Msg, recv, send, spin_until_readable
from saguaro_dist.model.cuda_graphs import graph_captures

log = logging.getLogger(__name__)


def _picklable(exc: Exception) -> Exception:
    """The exception itself if it survives pickling (the engine tells its types apart), else its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def named_seq_ids(msg: tuple, stale=None) -> set[int]:
    """The sequences a parent -> child message (CALL or POST) is about; stale(m): an outcome, draft or release m
    of an earlier life (the worker drops it), which is about none."""
    method, arg = msg[-2:]
    stale = stale or _never
    if method == "catch_up":
        return {o.seq_id for outcomes in arg for o in outcomes if not stale(o)}
    if method == "prefill":
        return {r.seq_id for r in arg}
    if method in ("jit_draft", "send_outcomes", "release"):
        return {r.seq_id for r in arg if not stale(r)}
    return set()


def _never(_) -> bool:
    return False


class _Child:
    """The child's side: one DraftWorker, one message at a time, in arrival order."""

    def __init__(self, worker, rx: Connection, tx: Connection, spin_s: float = 0.0):
        self.worker, self.rx, self.tx, self.spin_s = worker, rx, tx, spin_s
        # Whether the parent will want us again within a round: after trees or a draft it will, so we
        # spin; after anything else we block, as a spinning core slows the target's (~4% here).
        self.wanted_soon = False
        self.backlog: deque[tuple] = deque()  # messages read during a tree build (_superseded), not yet run

    def serve(self) -> None:
        """Until the parent posts STOP, closes the pipe, or is gone: then exit quietly. STOP because the
        pipe's EOF never comes while a process forked from the parent holds a copy of it."""
        try:
            while True:
                kind, *rest = self._next_message()
                self.wanted_soon = False
                if kind == Msg.POST and rest[0] == STOP:
                    return
                if kind == Msg.CALL:
                    self._answer(*rest)
                else:
                    self._run_posted(*rest)
        except (EOFError, BrokenPipeError):
            return

    def _next_message(self) -> tuple:
        if self.backlog:
            return self.backlog.popleft()
        if self.wanted_soon:
            spin_until_readable(self.rx, self.spin_s)
        return recv(self.rx)

    def _superseded(self, seq_ids: list[int]) -> bool:
        """Whether messages the parent has already sent name every one of seq_ids (an outcome, a draft, a
        release): it has moved on from the trees being built for them, which its plans told it missed."""
        while self.rx.poll(0):
            self.backlog.append(recv(self.rx))
        lives = getattr(self.worker, "lives", None)  # a late message of an earlier life moves nobody on
        named = set().union(*(named_seq_ids(m, lives.stale if lives else None) for m in self.backlog))
        return all(sid in named for sid in seq_ids)

    def _answer(self, call_id: int, method: str, arg) -> None:
        try:
            self._send(Msg.REPLY, call_id, True, getattr(self, method)(arg))
        except BrokenPipeError:
            raise  # the parent is gone: serve() ends
        except Exception as exc:  # the parent raises it where the call was made
            self._send(Msg.REPLY, call_id, False, _picklable(exc))

    def _run_posted(self, method: str, arg) -> None:
        try:
            getattr(self, method)(arg)
        except (BrokenPipeError, EOFError):  # the parent is gone (EOFError: read ahead mid-build): serve() ends
            raise
        except Exception as exc:
            log.warning("draft %s failed", method, exc_info=exc)
            self._send(Msg.POST_FAILED, method, f"{type(exc).__name__}: {exc}")

    def _send(self, kind: str, *rest) -> None:
        """With this process's capture count: the parent's tree gate leaves out a round during which it
        moved (the round timed a capture; engine/ssd_loop.py)."""
        send(self.tx, kind, graph_captures(), *rest)

    def prefill(self, reqs):
        return self.worker.prefill(reqs)

    def jit_draft(self, reqs):
        self.wanted_soon = True
        return self.worker.jit_draft(reqs)

    def release(self, reqs):
        return self.worker.release(reqs)

    def reset_prefix_cache(self, msg):
        return self.worker.reset_prefix_cache()

    def send_outcomes(self, outcomes):
        """Observe, build, push the trees (SSD's draft-side round)."""
        self.worker.observe(outcomes)
        plans = self.worker.plan_trees()
        if plans:
            self._send(Msg.PLANS, plans)
        trees = self.worker.finish_trees(self._superseded)
        if trees:  # none when the target asked for no tree (skip_tree)
            self._send(Msg.TREES, trees)
        self.wanted_soon = bool(trees)

    def catch_up(self, rounds):
        for outcomes in rounds:  # in order: a later round's outcome of a sequence needs the earlier one
            self.worker.observe(outcomes)


def main() -> None:
    """Child entry point: the pipe is the original stdin/stdout; prints go to stderr from here on."""
    import torch

    from saguaro_dist.engine.build import build_draft_worker
    from saguaro_dist.engine.heap import freeze_startup_heap
    logging.basicConfig(level=logging.WARNING, format="saguaro-draft %(levelname)s %(name)s: %(message)s")
    rx, tx = Connection(os.dup(0), writable=False), Connection(os.dup(1), readable=False)
    os.dup2(sys.stderr.fileno(), 1)
    try:
        config, fit = recv(rx)
        if config.draft_threads:
            torch.set_num_threads(config.draft_threads)
        worker = build_draft_worker(config, fit)
    except Exception as exc:
        send(tx, Msg.READY, False, f"{type(exc).__name__}: {exc}")
        raise
    freeze_startup_heap()
    send(tx, Msg.READY, True, "ready")
    _Child(worker, rx, tx, config.draft_spin_s).serve()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: nothing to save, and torch's pools can abort in it


if __name__ == "__main__":
    main()
