"""The one-host engine's draft in a child process, spoken to over a pipe.

Why a process: a draft thread shares the target's GIL, and the draft's tree build is many small
forwards whose Python holds it. Measured on the demo pair, one torch thread each: a 5-token target
verify takes 7.5 ms alone, 13.7 ms beside a busy draft thread, 7.8 ms beside a busy draft process.
Why a pipe, not the distributed runtime's gRPC: a loopback gRPC call costs ~0.9 ms here, a pipe
round trip a tenth of that, and one host needs neither deadlines nor a service.

The child is `python -m saguaro_dist.engine.draft_process`, not a multiprocessing spawn (spawn
re-imports the user's __main__, which breaks scripts without an `if __name__ == "__main__"` guard).
It reads (call id, method, argument) from stdin and writes (call id, ok, result) to stdout; trees
built after outcomes arrive unasked, with call id None. It ends when its stdin closes, so also when
the parent dies. If it dies, its sequences fall back to the fast backup and the next prefill (the
engine re-admits them) starts a new child: speed is lost, never a token.
"""
from __future__ import annotations

import itertools
import logging
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection

from saguaro_dist.config import Config
from saguaro_dist.distributed.errors import DraftUnavailable
from saguaro_dist.engine.draft_backend import TreeInbox

log = logging.getLogger(__name__)
TREES = None  # call id of the unasked messages: trees built after outcomes arrived
START_TIMEOUT_S = 120.0  # the child imports torch and loads the draft


def _send(conn: Connection, obj) -> None:
    # Plain pickle: Connection.send's ForkingPickler would move tensors through shared-memory fds.
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


class DraftProcess:
    """A DraftBackend (engine/draft_backend.py) whose DraftWorker runs in a child process."""

    def __init__(self, config: Config):
        self.config = config
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the pipe's write end and the calls in flight
        self._life = threading.Lock()  # serialises start, restart and close
        self._calls: dict[int, tuple[Future, list[int]]] = {}
        self._known: set[int] = set()  # sequences the current child holds (the engine's thread only)
        self._closed, self._gone, self._reader = False, True, None
        self._start()

    # ---- DraftBackend ------------------------------------------------------------------------------
    def prefill(self, reqs):
        if self._gone:
            try:
                self._restart()
            except RuntimeError as exc:  # the loop keeps these sequences on the fast backup
                raise DraftUnavailable(str(exc), [r.seq_id for r in reqs]) from exc
        self._call("prefill", reqs, [r.seq_id for r in reqs]).result()
        self._known.update(r.seq_id for r in reqs)

    def jit_draft(self, reqs):
        lost = [r.seq_id for r in reqs if r.seq_id not in self._known]
        if lost:
            raise DraftUnavailable(f"the draft process restarted without sequences {lost}", lost)
        return self._call("jit_draft", reqs, [r.seq_id for r in reqs]).result()

    def send_outcomes(self, outcomes):
        self._call("send_outcomes", [o for o in outcomes if o.seq_id in self._known], [])

    def wait_trees(self, keys, timeout_s):
        return self.inbox.take([k for k in keys if k[0] in self._known], timeout_s)

    def release(self, reqs):
        held = [r for r in reqs if r.seq_id in self._known]
        self._known.difference_update(r.seq_id for r in reqs)
        if held:
            self._call("release", held, [])

    def close(self) -> None:
        with self._life:
            self._closed = True
            self._stop()

    # ---- the child ---------------------------------------------------------------------------------
    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._tx = Connection(os.dup(self._proc.stdin.fileno()), readable=False)
        rx = Connection(os.dup(self._proc.stdout.fileno()), writable=False)
        self._proc.stdin.close()
        self._proc.stdout.close()
        self.inbox = TreeInbox()
        _send(self._tx, self.config)
        self._handshake(rx)
        self._gone = False
        self._reader = threading.Thread(target=self._read, args=(rx, self._proc, self.inbox), daemon=True,
                                        name="saguaro-draft-pipe")
        self._reader.start()
        log.info("draft process pid %d ready", self._proc.pid)

    def _handshake(self, rx: Connection) -> None:
        """The child's first message says whether the draft loaded; a bad draft fails here, clearly."""
        ready = rx.poll(START_TIMEOUT_S)
        try:
            _, ok, detail = _recv(rx) if ready else (None, False, f"no answer within {START_TIMEOUT_S:.0f} s")
        except EOFError:
            ok, detail = False, "it exited (its log is above)"
        if not ok:
            rx.close()
            self._stop()
            raise RuntimeError(f"the draft process could not start: {detail}")

    def _restart(self) -> None:
        with self._life:
            if self._closed or not self._gone:
                return
            log.warning("draft process exited (code %s): starting a new one", self._proc.poll())
            self._stop()
            self._known.clear()
            self._start()

    def _stop(self) -> None:
        if not self._tx.closed:
            self._tx.close()  # the child's signal to stop
        try:
            self._proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5.0)

    def _call(self, method: str, arg, seq_ids: list[int]) -> Future:
        fut = Future()
        with self._lock:
            if self._gone:
                fut.set_exception(DraftUnavailable("the draft process ended", seq_ids))
                return fut
            call_id = next(self._ids)
            self._calls[call_id] = (fut, seq_ids)
            try:
                _send(self._tx, (call_id, method, arg))
            except (OSError, ValueError) as exc:  # the child died: its pipe is broken
                del self._calls[call_id]
                fut.set_exception(DraftUnavailable(f"the draft process ended ({exc})", seq_ids))
        return fut

    def _read(self, rx: Connection, proc: subprocess.Popen, inbox: TreeInbox) -> None:
        """Replies to their futures, unasked trees to the inbox; at EOF every open call fails."""
        try:
            while True:
                call_id, ok, result = _recv(rx)
                if call_id is TREES:
                    inbox.put(result)
                    continue
                with self._lock:
                    fut, _ = self._calls.pop(call_id)
                fut.set_result(result) if ok else fut.set_exception(result)
        except (EOFError, OSError):
            pass
        finally:
            rx.close()
            self._child_ended(proc, inbox)

    def _child_ended(self, proc: subprocess.Popen, inbox: TreeInbox) -> None:
        with self._lock:
            self._gone = True
            calls, self._calls = self._calls, {}
        if not self._closed:
            log.error("draft process pid %d ended (code %s): its sequences use the fast backup until re-admitted",
                      proc.pid, proc.poll())
        for fut, seq_ids in calls.values():
            fut.set_exception(DraftUnavailable("the draft process ended", seq_ids))
        inbox.abandon()  # a waiter's trees will not come


def _picklable(exc: Exception) -> Exception:
    """The exception itself if it survives pickling (the engine tells its types apart), else its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Child:
    """The child's side: one DraftWorker, one call at a time, in arrival order."""

    def __init__(self, worker, tx: Connection):
        self.worker, self.tx = worker, tx

    def serve(self, rx: Connection) -> None:
        while True:
            try:
                call_id, method, arg = _recv(rx)
            except EOFError:
                return
            try:
                _send(self.tx, (call_id, True, getattr(self, method)(arg)))
            except Exception as exc:  # the parent raises it where the call was made
                log.info("draft %s failed: %s", method, exc)
                _send(self.tx, (call_id, False, _picklable(exc)))

    def prefill(self, reqs):
        return self.worker.prefill(reqs)

    def jit_draft(self, reqs):
        return self.worker.jit_draft(reqs)

    def release(self, reqs):
        return self.worker.release(reqs)

    def send_outcomes(self, outcomes):
        """Observe, build, and push the trees before answering (the answer is not waited for)."""
        self.worker.observe(outcomes)
        _send(self.tx, (TREES, True, self.worker.build_trees()))


def main() -> None:
    """Child entry point: the pipe is the original stdin/stdout; prints go to stderr from here on."""
    from saguaro_dist.engine.build import build_draft_worker
    logging.basicConfig(level=logging.WARNING, format="saguaro-draft %(levelname)s %(name)s: %(message)s")
    rx, tx = Connection(os.dup(0), writable=False), Connection(os.dup(1), readable=False)
    os.dup2(sys.stderr.fileno(), 1)
    try:
        worker = build_draft_worker(_recv(rx))
    except Exception as exc:
        _send(tx, (None, False, f"{type(exc).__name__}: {exc}"))
        raise
    _send(tx, (None, True, "ready"))
    _Child(worker, tx).serve(rx)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: nothing to save, and torch's pools can abort in it


if __name__ == "__main__":
    main()
