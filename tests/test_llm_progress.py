"""LLM.generate's wait: its progress bar (vLLM's use_tqdm), shown on a terminal, never elsewhere, same
outputs; and an interrupt (Ctrl-C) that ends the wait early."""
from __future__ import annotations

import io
import signal
import sys
import threading
import time

import pytest

from engine_helpers import Terminal
from saguaro_dist import LLM, SamplingParams


def test_the_bar_counts_prompts_on_a_terminal_and_changes_nothing(tiny_checkpoint, monkeypatch):
    prompts, params = [[3, 4, 5], [6, 7, 8, 9], [10, 11]], SamplingParams(temperature=0, max_tokens=5)
    terminal = Terminal()
    with LLM(model=tiny_checkpoint("llama"), mode="ar") as llm:
        monkeypatch.setattr(sys, "stderr", terminal)
        shown = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        bar = terminal.getvalue()
        hidden = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar by default
        piped = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert sys.stderr.getvalue() == ""
    assert "Processed prompts" in bar and "3/3" in bar and "toks/s" in bar
    assert terminal.getvalue() == bar  # use_tqdm=False wrote nothing
    assert [o.token_ids for o in shown] == [o.token_ids for o in hidden] == [o.token_ids for o in piped]


class CtrlC:
    """Ctrl-C pressed until the test has seen KeyboardInterrupt: SIGINT to the main thread once the engine
    runs the batch, again every `every_s` while none came out. One signal can be lost to the test, not to
    the engine: CPython runs a handler at its next check, and one that lands in a finaliser (gc in the main
    thread) has its exception printed and dropped. A press landing once the with-block ends is ignored (the
    runner's own handler is back after it), so none escapes into the test runner."""

    def __init__(self, llm, every_s: float = 0.25, tries: int = 20):
        self.llm, self.every_s, self.tries = llm, every_s, tries
        self.sent, self.handled, self.done = 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._press, daemon=True)

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)  # a test runner may have its own
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self._thread.join()
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame):
        self.handled += 1
        if not self.done.is_set():
            raise KeyboardInterrupt

    def _press(self):
        while self.llm.load.num_running == 0 and not self.done.wait(0.01):
            pass  # the batch has not started yet
        while self.sent < self.tries and not self.done.wait(0 if self.sent == 0 else self.every_s):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            self.sent += 1


def test_an_interrupted_generate_aborts_what_it_had_not_finished(tiny_checkpoint):
    """Ctrl-C in generate() (a real SIGINT to this, the main, thread: a notebook's interrupt) raises
    KeyboardInterrupt and aborts the unfinished requests, so the next call does not wait behind the rest
    of the old batch (~60 requests of 200 tokens, two at a time: seconds of work had it gone on)."""
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with LLM(model=tiny_checkpoint("llama"), mode="ar", max_batch_size=2) as llm:
        with CtrlC(llm) as ctrl_c, pytest.raises(KeyboardInterrupt):
            outputs = llm.generate(prompt_token_ids=[[3, 4, 5]] * 64, sampling_params=long, use_tqdm=False)
            pytest.fail(f"generate finished ({sum(len(o.token_ids) for o in outputs)} tokens) after "
                        f"{ctrl_c.sent} SIGINTs sent, {ctrl_c.handled} handled")
        deadline = time.monotonic() + 2.0
        while (llm.load.num_running or llm.load.num_waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (llm.load.num_running, llm.load.num_waiting) == (0, 0)
        after = llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=SamplingParams(temperature=0, max_tokens=4))
        assert len(after[0].token_ids) == 4
