"""One daemon thread that runs the calls submitted to it, one at a time and in order."""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable


class SerialThread:
    """submit(fn, *args) -> a Future of fn(*args), run on this object's one daemon thread after every call submitted
    before it. Why not a one-worker ThreadPoolExecutor: concurrent.futures refuses new work in every pool once the
    interpreter begins to exit, before it joins non-daemon threads, so a generate() on a user's non-daemon thread
    failed for good once the main thread returned ("cannot schedule new futures after interpreter shutdown").
    Daemon, so nothing waits for it at exit: its owner shuts it down (an LLM's finalizer runs at exit)."""

    def __init__(self, name: str):
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable, *args) -> Future:
        done: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is shut down")
            # Started on first use (making one starts nothing), and again in a child forked since: a thread does not
            # survive fork, and a call queued for it would wait forever.
            if self._thread is None or not self._thread.is_alive():
                self._calls = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, args=(self._calls,), name=self.name, daemon=True)
                self._thread.start()
            self._calls.put((fn, args, done))
        return done

    def shutdown(self) -> None:
        """Cancel the calls not started, let the one running end, and stop the thread (waited for, unless this is it)."""
        with self._lock:
            self._closed = True
            calls, thread = self._calls, self._thread
        if thread is None:
            return
        while True:
            try:
                call = calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:  # (None: an earlier shutdown's)
                call[2].cancel()
        calls.put(None)
        if thread is not threading.current_thread():
            thread.join()

    @staticmethod
    def _serve(calls: queue.SimpleQueue) -> None:
        while (call := calls.get()) is not None:
            fn, args, done = call
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - the Future hands it to whoever waits
                done.set_exception(err)
            del call, fn, args, done  # (else the last call's arguments and result lived on while the thread waits)
