"""The one-host engine's draft in a child process, spoken to over a pipe: the parent's side (the child's:
engine/draft_process.py).

Why a process: a draft thread shares the target's GIL, and the draft's tree build is many small
forwards whose Python holds it. Measured on the demo pair, one torch thread each: a 5-token target
verify takes 7.5 ms alone, 13.7 ms beside a busy draft thread, 7.8 ms beside a busy draft process.
Why a pipe, not the distributed runtime's gRPC: a loopback gRPC call costs ~0.9 ms here, a pipe
round trip a tenth of that, and one host needs neither deadlines nor a service.

The child is `python -m saguaro_dist.engine.draft_process`, not a multiprocessing spawn (spawn
re-imports the user's __main__, which breaks scripts without an `if __name__ == "__main__"` guard).
It reads calls from stdin and writes replies and pushed trees to stdout. The engine's own thread
reads the pipe whenever it waits (for a reply or for trees): a background reader would have to win
the GIL from the verifying engine thread first, which cost milliseconds a round. The child ends
on a STOP post (the parent's close), or when its stdin closes, so also when the parent dies. Why both:
a child the user's process forks (a DataLoader worker, a multiprocessing fork pool) holds copies of
the pipe, and while it lives the draft child sees no EOF (the parent's shutdown waited out its 10 s grace
and killed it); such a forked child closes its copies at fork (_close_in_forked_child), and STOP covers
forks that run no Python at-fork handlers. If it dies, its sequences fall back to the fast backup and the next prefill (the
engine re-admits them) starts a new child: speed is lost, never a token.
"""
from __future__ import annotations

import itertools
import logging
import os
import select
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection

from saguaro_dist.config import Config
from saguaro_dist.distributed.errors import DraftUnavailable
from saguaro_dist.engine.draft_backend import DraftLater, FailedDrafts, TreeInbox
from saguaro_dist.engine.messages import Outcome
from saguaro_dist.engine.pipe_wire import Msg, framed, recv, send, spin_until_readable, widen, write_some

log = logging.getLogger(__name__)
CHILD_MODULE = "saguaro_dist.engine.draft_process"  # the child: python -m CHILD_MODULE (tools find it by this name)
START_TIMEOUT_S = 120.0  # the child imports torch and loads the draft
CALL_TIMEOUT_S = 120.0   # a child that answers no call (or takes no message) this long is treated as dead
WAIT_SPIN_S = 0.01       # the engine busy-polls the pipe this long (at most draft_spin_s) before it blocks
STOP = "stop"            # the POST that ends the child (draft_process.py: _Child.serve): the parent's close


class DraftProcess:
    """A DraftBackend (engine/draft_backend.py) whose DraftWorker runs in a child process.

    Used from one thread at a time (the engine's), like every DraftBackend."""

    drafts_beside = True  # in the child, on its own core

    def __init__(self, config: Config, fit=None):
        """fit: the DraftFit the child builds its draft to (engine/build.py: fit_draft; None: its own)."""
        self.config, self.fit = config, fit
        self.max_model_len = fit.max_model_len if fit else sys.maxsize  # the longest sequence the draft holds
        self._ids = itertools.count()
        self._known: set[int] = set()  # sequences the current child holds
        self._gone = True
        self._captures = 0  # the child's CUDA-graph capture count, as its last message said
        # Why the engine spins too: its wait for a tree (~1 ms a round) halted its vCPU, and waking it cost
        # more than the spin takes from the draft's core (b = 1 greedy +5-7%, b = 8 T = 0.7 cohorts +7%).
        self._spin_s = min(config.draft_spin_s, WAIT_SPIN_S)
        _LIVE.add(self)  # weakly: a forked child of this process closes its copies of our pipe
        self._start()

    # ---- DraftBackend ------------------------------------------------------------------------------
    def prefill(self, reqs):
        self.start_prefill(reqs).result()

    def start_prefill(self, reqs):
        """The child prefills while the caller goes on (the target's own prefill); result() waits for it."""
        seq_ids = [r.seq_id for r in reqs]
        if self._gone:
            try:
                self._restart(seq_ids)
            except DraftUnavailable as exc:
                return FailedDrafts(exc)
        self.inbox.begin(reqs)  # the inbox of this child (a restart makes a new one)
        call_id = self._ask("prefill", reqs)
        return DraftLater(lambda _: self._prefilled(call_id, seq_ids), reqs)

    def _prefilled(self, call_id: int, seq_ids: list[int]) -> None:
        self._reply(call_id, "prefill", seq_ids)
        self._known.update(seq_ids)

    def jit_draft(self, reqs):
        return self.start_jit_draft(reqs).result()

    def start_jit_draft(self, reqs):
        """The child drafts while the caller goes on; result() reads its reply (pushed trees on the way)."""
        lost = self.lost([r.seq_id for r in reqs])
        if lost:
            return FailedDrafts(DraftUnavailable(f"the draft process restarted without sequences {lost}", lost))
        return _Reply(self, self._ask("jit_draft", self.inbox.stamp(reqs)), "jit_draft", [r.seq_id for r in reqs])

    def send_outcomes(self, outcomes):
        self._post("send_outcomes", self.inbox.stamp([o for o in outcomes if o.seq_id in self._known]))

    def catch_up(self, rounds: list[list[Outcome]]) -> None:
        """Rounds of outcomes that want no tree, in order, in one message: the child only observes them."""
        known = [self.inbox.stamp([o for o in outcomes if o.seq_id in self._known]) for outcomes in rounds]
        if any(known):
            self._post("catch_up", [outcomes for outcomes in known if outcomes])

    def wait_trees(self, keys, timeout_s, outcomes=None):
        live = [k for k in keys if k[0] in self._known]
        late = self.inbox.late_plans(live)  # the plan wait already waited out a stalled child (TreeInbox)
        self._pump(lambda: self.inbox.has(live, outcomes), time.monotonic() + (0.0 if late else timeout_s))
        return self.inbox.take(live, 0.0, outcomes)

    def wait_plans(self, keys, timeout_s):
        live = [k for k in keys if k[0] in self._known]
        if not self._pump(lambda: self.inbox.has_plans(live), time.monotonic() + timeout_s) and timeout_s > 0:
            self.inbox.note_late_plans(live)
        return self.inbox.plans(live, 0.0)

    def release(self, reqs):
        held = self.inbox.stamp([r for r in reqs if r.seq_id in self._known])  # before forget ends their lives
        self._known.difference_update(r.seq_id for r in reqs)
        self.inbox.forget([r.seq_id for r in reqs])
        if held:
            self._post("release", held)

    def reset_prefix_cache(self, msg):
        self._post("reset_prefix_cache", msg)  # a child that restarted holds nothing to forget

    def workers(self) -> tuple[int, int]:
        return (0 if self._gone else 1), 1

    def graph_captures(self) -> int:
        return self._captures

    def close(self) -> None:
        self._stop()

    def lost(self, seq_ids: list[int]) -> list[int]:
        """Those of seq_ids the child does not hold (it restarted without them, or it has ended: the split
        draft, whose drafts are made on the engine's thread, would otherwise never re-prefill them, and they
        went without trees until another request's prefill restarted the child)."""
        return list(seq_ids) if self._gone else [sid for sid in seq_ids if sid not in self._known]

    def accepting(self) -> bool:
        """Always: a prefill starts a new child when this one has ended."""
        return True

    # ---- the pipe ----------------------------------------------------------------------------------
    def _call(self, method: str, arg, seq_ids: list[int]):
        return self._reply(self._ask(method, arg), method, seq_ids)

    def _ask(self, method: str, arg) -> int:
        """Post a call; returns its id, for _reply."""
        call_id = next(self._ids)
        self._post(method, arg, call_id)
        return call_id

    def _reply(self, call_id: int, method: str, seq_ids: list[int]):
        """The result of call `call_id` (raised if it failed), reading the pipe until it comes."""
        if call_id < self._first_call_id:  # posted to a child that has since been replaced
            raise DraftUnavailable(f"the draft process restarted during {method}", seq_ids)
        if not self._pump(lambda: call_id in self._replies, time.monotonic() + CALL_TIMEOUT_S) and not self._gone:
            log.error("draft process pid %d answered no %s in %.0f s: stopping it", self._proc.pid, method, CALL_TIMEOUT_S)
            self._stop(grace_s=0.0)
        if call_id not in self._replies:
            raise DraftUnavailable(f"the draft process ended during {method}", seq_ids)
        ok, result = self._replies.pop(call_id)
        if not ok:
            raise result
        return result

    def _post(self, method: str, arg, call_id: int | None = None) -> None:
        if self._gone:
            return  # the caller's call (if any) finds no reply: DraftUnavailable
        try:
            self._send(*((Msg.CALL, call_id, method, arg) if call_id is not None else (Msg.POST, method, arg)))
        except TimeoutError:  # stalled (stopped, deadlocked): the caller's call finds no reply, as for a dead one
            log.error("draft process pid %d took no %s in %.0f s: stopping it", self._proc.pid, method, CALL_TIMEOUT_S)
            self._stop(grace_s=0.0)
        except (EOFError, OSError):  # the child died: its pipe is broken
            self._child_ended()

    def _send(self, *msg) -> None:
        """Write msg within CALL_TIMEOUT_S (TimeoutError): a blocking write to a stalled child would hang the
        engine past every deadline once a message outgrew the pipe (a long prompt's prefill). While the pipe
        is full its messages are read, as it may itself be blocked writing a large push to us."""
        chunks, deadline = framed(*msg), time.monotonic() + CALL_TIMEOUT_S
        while not write_some(self._tx.fileno(), chunks):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            poller = select.poll()  # not select.select: a server's fds may pass FD_SETSIZE
            poller.register(self._tx.fileno(), select.POLLOUT)
            poller.register(self._rx.fileno(), select.POLLIN)
            if any(fd == self._rx.fileno() for fd, _ in poller.poll(left * 1000)):
                self._dispatch(recv(self._rx))

    def _pump(self, done, deadline: float) -> bool:
        """Read the child's messages until done() or the deadline (False), or its end (False)."""
        while not done():
            left = deadline - time.monotonic()
            try:
                if self._gone or left <= 0 or not self._readable(left):
                    return False
                self._dispatch(recv(self._rx))
            except (EOFError, OSError):
                self._child_ended()
                return False
        return True

    def _readable(self, timeout_s: float) -> bool:
        """Whether the child wrote within timeout_s: busy-polled for its first _spin_s, then blocked."""
        start = time.monotonic()
        return (spin_until_readable(self._rx, min(timeout_s, self._spin_s))
                or self._rx.poll(max(0.0, timeout_s - (time.monotonic() - start))))

    def _dispatch(self, msg: tuple) -> None:
        kind, self._captures, *rest = msg
        if kind == Msg.TREES:  # a late tree of a released sequence would never leave the inbox
            self.inbox.put([t for t in rest[0] if t.seq_id in self._known])
        elif kind == Msg.PLANS:
            self.inbox.put_plans([p for p in rest[0] if p.seq_id in self._known])
        elif kind == Msg.REPLY:
            call_id, ok, result = rest
            self._replies[call_id] = (ok, result)
        elif kind == Msg.POST_FAILED:  # a failed build costs misses (the trees never come), never tokens
            log.warning("draft %s failed: %s", *rest)

    # ---- the child's life --------------------------------------------------------------------------
    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._tx = Connection(os.dup(self._proc.stdin.fileno()), readable=False)
        self._rx = Connection(os.dup(self._proc.stdout.fileno()), writable=False)
        self._proc.stdin.close()
        self._proc.stdout.close()
        for conn in (self._tx, self._rx):
            widen(conn.fileno())
        self.inbox, self._replies = TreeInbox(), {}
        self._first_call_id = next(self._ids)  # calls before it went to an earlier child
        send(self._tx, self.config, self.fit)  # blocking: the child reads it first thing
        os.set_blocking(self._tx.fileno(), False)  # later messages are written by _send, against a deadline
        self._handshake()
        self._gone = False
        log.info("draft process pid %d ready", self._proc.pid)

    def _handshake(self) -> None:
        """The child's first message says whether the draft loaded; a bad draft fails here, clearly."""
        try:
            ready = self._rx.poll(START_TIMEOUT_S)
            _, ok, detail = recv(self._rx) if ready else (None, False, f"no answer within {START_TIMEOUT_S:.0f} s")
        except (EOFError, OSError):
            ok, detail = False, "it exited (its log is above)"
        if not ok:
            self._stop()
            raise RuntimeError(f"the draft process could not start: {detail}")

    def _restart(self, seq_ids: list[int]) -> None:
        log.warning("draft process exited (code %s): starting a new one", self._proc.poll())
        self._stop()
        self._known.clear()
        try:
            self._start()
        except RuntimeError as exc:  # the loop keeps these sequences on the fast backup
            raise DraftUnavailable(str(exc), seq_ids) from exc

    def _child_ended(self) -> None:
        if not self._gone:
            log.error("draft process pid %d ended (code %s): its sequences use the fast backup until re-admitted",
                      self._proc.pid, self._proc.poll())
        self._gone = True

    def _stop(self, grace_s: float = 10.0) -> None:
        """grace_s: how long the child may take to exit on its own (0: a stalled one, killed at once)."""
        self._gone = True
        if grace_s > 0:
            self._post_stop()
        for conn in (self._tx, self._rx):
            conn.close()  # the child's EOF: its signal to stop where STOP did not go (or it was never read)
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _post_stop(self) -> None:
        """Tell the child to exit, without waiting: the EOF of the pipe's close never comes while a forked
        child of ours holds a copy of it. Only if the pipe has room for all of STOP at once: a full pipe
        means a child that is not reading, which the grace wait then kills."""
        try:
            write_some(self._tx.fileno(), framed(Msg.POST, STOP, None))
        except OSError:  # it has died (a broken pipe), or the pipe is closed already (a fork's copy, a second stop)
            pass

    def _close_pipe_in_fork(self) -> None:
        """In a forked child of this process: the draft child is the parent's, so this copy forgets it."""
        self._gone = True
        for conn in (self._tx, self._rx):
            conn.close()


_LIVE: weakref.WeakSet[DraftProcess] = weakref.WeakSet()  # weak: a DraftProcess ends as it would without it


def _close_in_forked_child() -> None:
    """os.register_at_fork's after_in_child: close every DraftProcess's pipe ends in a forked child, so that
    the parent's close is its draft child's EOF even while forked children live, and a forked child cannot
    write into (or read from) the parent's conversation with it."""
    for process in list(_LIVE):
        if hasattr(process, "_tx"):  # not one forked in the midst of its first _start
            process._close_pipe_in_fork()


os.register_at_fork(after_in_child=_close_in_forked_child)  # once, at import: not one handler per DraftProcess


class _Reply:
    """PendingDrafts: a call the child is answering."""

    def __init__(self, process: DraftProcess, call_id: int, method: str, seq_ids: list[int]):
        self._process, self._call_id, self._method, self._seq_ids = process, call_id, method, seq_ids

    def result(self):
        return self._process._reply(self._call_id, self._method, self._seq_ids)
