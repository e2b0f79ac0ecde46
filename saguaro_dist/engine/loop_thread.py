"""Runs an Engine on its own thread so concurrent callers share one continuously batched batch."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Callable

from saguaro_dist.engine.engine import Engine, ReleaseError, Update
from saguaro_dist.engine.lora_slots import AdapterReadError
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.engine.stats_log import StatsLogger

log = logging.getLogger(__name__)

Listener = Callable[[Update | BaseException], None]
CHORE_TIMEOUT_S = 60.0  # a caller's wait for its chore (remove_lora, add_lora, ...) to run between two steps


def cause(err: Exception) -> BaseException:
    """What failed: a ReleaseError's release failure, else err."""
    return err.__cause__ if isinstance(err, ReleaseError) else err


def deliver(listener: Listener, item) -> bool:
    """listener(item), False if it raised: a caller that went away (e.g. its event loop closed) must not
    take the engine, or the updates of every other request, down with it."""
    try:
        listener(item)
        return True
    except Exception:  # noqa: BLE001
        log.debug("a request listener failed; dropping it", exc_info=True)
        return False


class EngineError(RuntimeError):
    """The engine failed while serving this request; the request may be retried."""
    retriable = True


class EngineThread:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._listeners: dict[str, Listener] = {}
        self._inbox: list[tuple[Sequence, Listener]] = []
        self._aborts: list[str] = []
        self._chores: list[tuple[Callable[[], object], Future]] = []  # run on the loop thread between steps
        self.chore_timeout_s = CHORE_TIMEOUT_S
        self._cond = threading.Condition()
        self._stopped = False
        self._closes_itself = False  # stop() came from the loop's own thread: the loop closes the engine as it ends
        self._stats = StatsLogger(engine.config.log_stats_interval_s)
        self.load = engine.load()  # a snapshot, replaced after each step: read from any thread without a lock
        self._thread = threading.Thread(target=self._run, name="saguaro-engine", daemon=True)
        self._thread.start()

    @property
    def metrics(self):
        return self.engine.metrics

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.engine.eos_token_ids)

    def check_health(self) -> None:
        """Raise EngineError when this engine can serve no more (shut down, or its loop thread gone)."""
        if self._stopped or not self._thread.is_alive():
            raise EngineError("the engine is shut down")

    def submit(self, seq: Sequence, listener: Listener) -> None:
        self.submit_many([(seq, listener)])

    def submit_many(self, requests: list[tuple[Sequence, Listener]]) -> None:
        """All at once: the loop takes them in one step, in this order (an offline batch enters whole)."""
        with self._cond:
            self._check_running()
            self._inbox.extend(requests)
            self._cond.notify()

    async def submit_async(self, seq: Sequence, listener: Listener) -> None:
        """submit, for an event loop (LLM.stream): here it never blocks, so it needs no await."""
        self.submit(seq, listener)

    def abort(self, request_id: str) -> None:
        self.abort_many([request_id])

    def abort_many(self, request_ids: list[str]) -> None:
        """After every submit before it (the loop takes its inbox first); an id it does not hold is ignored."""
        with self._cond:
            self._aborts.extend(request_ids)
            self._cond.notify()

    def reset_prefix_cache(self) -> None:
        self._on_loop(self.engine.reset_prefix_cache)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Engine.remove_lora between two steps: whether the engine held anything of the adapter."""
        return self._on_loop(lambda: self.engine.remove_lora(lora_int_id))

    def add_lora(self, request) -> bool:
        """vLLM's add_lora: the adapter read here (off the engine's thread: a long read stalls no step), then put in
        the engine's host memory (its LRU of max_cpu_loras) between two steps. ValueError: why it cannot run (LoRA
        off, unreadable files)."""
        loras = self.engine.target.loras
        if loras is None:
            raise ValueError("add_lora, but LoRA is off for this engine: start it with enable_lora=True")
        if loras.holds(request) and self._on_loop(lambda: loras.touch(request)):  # (a peek, then asked on the loop)
            return True  # held already from this path: only its LRU place changes (vLLM's)
        try:
            adapter = loras.read(request)
        except ValueError as err:
            raise AdapterReadError(str(err)) from None
        except OSError as err:  # a Hub id that cannot be fetched
            raise AdapterReadError(f"lora_request {request.lora_name!r}: {err}") from None
        return self._on_loop(lambda: loras.add(request, adapter))

    def _on_loop(self, chore: Callable[[], object]):
        """chore() on the engine's own thread between two steps (the engine has no locks); its result. TimeoutError
        after chore_timeout_s (one long step): the chore still runs later."""
        done: Future = Future()
        with self._cond:
            self._check_running()
            self._chores.append((chore, done))
            self._cond.notify()
        return done.result(timeout=self.chore_timeout_s)

    def _check_running(self) -> None:
        """Under _cond: raise EngineError where no loop will take the work (stopped; or gone, as in a child forked
        since the engine started: a thread does not survive fork, and its callers waited forever)."""
        if self._stopped or not self._thread.is_alive():
            raise EngineError("the engine is shut down" if self._stopped else
                              "the engine's loop thread is gone (is this a child process forked since it started?)")

    def stop(self) -> None:
        """Stop the loop and close the engine; from the loop's own thread (an LLM's finalizer run by a listener that
        dropped the last reference to it), the loop closes it as it ends."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is self._thread:
            self._closes_itself = True
            return
        self._thread.join(timeout=30)
        self.engine.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                # (timed out: no work, and the stats line owed since the last burst is due; _step logs it)
                self._cond.wait_for(lambda: self._stopped or self._inbox or self._aborts or self._chores
                                    or self.engine.has_work(), timeout=self._stats.idle_wait_s())
                if self._stopped:
                    break
                inbox, aborts, chores = self._inbox, self._aborts, self._chores
                self._inbox, self._aborts, self._chores = [], [], []
            self._take(inbox, aborts)
            self._run_chores(chores)
            self._step()
        self._shut_down()
        if self._closes_itself:
            self.engine.close()

    def _shut_down(self) -> None:
        """Tell everyone still waiting: requests in flight, requests submitted before the stop that the
        loop never took (their callers waited forever: only taken ones have a listener in _listeners), and
        chores. Nothing joins these lists now: submit and _on_loop refuse once _stopped is set."""
        err = EngineError("the engine was shut down")
        self._fail_all(err)
        with self._cond:
            inbox, chores, self._inbox, self._chores = self._inbox, self._chores, [], []
        for _, listener in inbox:
            deliver(listener, err)
        for _, done in chores:
            done.set_exception(err)

    @staticmethod
    def _run_chores(chores) -> None:
        for chore, done in chores:
            try:
                done.set_result(chore())
            except Exception as err:  # noqa: BLE001 - the caller raises it
                done.set_exception(err)

    def _take(self, inbox, aborts) -> None:
        for seq, listener in inbox:
            if seq.request_id in self._listeners:  # it would take the other's listener: that caller waited forever
                deliver(listener, ValueError(f"request id {seq.request_id!r} is already running"))  # (vLLM's)
                continue
            try:
                self.engine.add(seq)
            except ValueError as err:  # a request the engine cannot take (say its grammar): its caller learns why
                deliver(listener, err)
                continue
            except Exception as err:  # noqa: BLE001 - anything else: uncaught, it ended this thread for every caller
                log.exception("the engine could not take request %r", seq.request_id)
                deliver(listener, EngineError(f"the engine could not take the request: {err!r}"))
                continue
            self._listeners[seq.request_id] = listener
        for request_id in aborts:
            try:
                self._publish(self.engine.abort(request_id))
            except Exception as err:  # noqa: BLE001 - freeing its state failed (a draft or TP rank gone?)
                # As a failed step: uncaught, it ended this thread, and every caller waited forever.
                self._recover(EngineError(f"abort of {request_id!r} failed: {err!r}"), err)

    def _step(self) -> None:
        """One engine step if it has work; the load snapshot is refreshed either way (an abort may have
        emptied it), and the stats line logged if due (idle: the last burst's tail)."""
        if not self.engine.has_work():
            self.load = self.engine.load()
            self._stats.maybe_log(self.engine.metrics, self.load)
            return
        try:
            self._stats.working()
            updates = self.engine.step()
            self.load = self.engine.load()  # before the updates: a caller woken by its last one sees it gone
            self._publish(updates)
            self._stats.maybe_log(self.engine.metrics, self.load)
        except Exception as err:  # noqa: BLE001 - every in-flight request learns of it
            self._recover(EngineError(f"engine step failed: {cause(err)!r}"), err)

    def _recover(self, err: EngineError, failure: Exception) -> None:
        """After the engine failed (its state may be half changed): every in-flight request fails with err,
        and the engine drops them all, to serve new ones. A failed release (ReleaseError) came after its step
        had finished requests: the step's updates go out first (one that completed is not failed)."""
        log.exception("%s; failing in-flight requests", err)
        if isinstance(failure, ReleaseError):
            self._publish(failure.updates)
        self._fail_all(err)
        self.engine.reset()
        self.load = self.engine.load()

    def _publish(self, updates: list[Update]) -> None:
        for u in updates:
            listener = self._listeners.get(u.seq.request_id)
            if u.finished:
                self._listeners.pop(u.seq.request_id, None)
            if listener is not None and not deliver(listener, u if u.error is None else u.error):
                self._listeners.pop(u.seq.request_id, None)
                self.abort(u.seq.request_id)  # nobody is listening: free the slot

    def _fail_all(self, err: BaseException) -> None:
        listeners, self._listeners = self._listeners, {}
        for listener in listeners.values():
            deliver(listener, err)
