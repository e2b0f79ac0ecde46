"""The one-host draft's pipe when a message outgrows it (engine/draft_process_parent.py: DraftProcess._send).

A real model's long prompts make a prefill message of megabytes; the tiny pair's are a few KiB, so these
tests shrink the real pipe to one page (pipe_wire.PIPE_BYTES, which widen sets) to outgrow it the same way."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from engine_helpers import PROMPTS, assert_greedy_equal, close_pair, hf_greedy
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.engine import draft_process_parent, pipe_wire

PAGE = 4096
LONG_PROMPTS = [[(7 * i + j) % 90 + 1 for i in range(200)] for j in range(12)]  # 12 x 200 tokens: ~7.5 KiB


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("pipe_stall_pair"))


def run_bounded(fn, within_s: float, on_hang) -> dict:
    """fn() on a thread; if it is still running after within_s, on_hang() (which must end it) and fail."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(value=fn()), daemon=True)
    worker.start()
    worker.join(within_s)
    hung = worker.is_alive()
    if hung:
        on_hang()
        worker.join(60)
    assert not hung, f"still blocked after {within_s:.0f} s"
    return result


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_a_prefill_to_a_stalled_child_fails_over_at_the_call_timeout(pair, monkeypatch):
    """A stopped child takes nothing from the pipe: the prefill's write must give up at CALL_TIMEOUT_S as
    an unanswered call does (the child killed, its sequences on the fast backup), not block the engine
    for good. Tokens stay the target's, and the next request starts a new child."""
    monkeypatch.setattr(pipe_wire, "PIPE_BYTES", PAGE)
    monkeypatch.setattr(draft_process_parent, "CALL_TIMEOUT_S", 3.0)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [hf_greedy(pair["model"], p, params.max_tokens) for p in LONG_PROMPTS]
    with LLM(model=pair["target"], draft=pair["close"], mode="ssd", k=3, max_batch_size=12,
             draft_executor="process", draft_threads=1) as llm:
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        draft = llm._thread.engine.loop.draft
        stalled = draft._proc.pid
        os.kill(stalled, signal.SIGSTOP)
        result = run_bounded(lambda: llm.generate(prompt_token_ids=LONG_PROMPTS, sampling_params=params), 90,
                             lambda: os.kill(stalled, signal.SIGKILL))
        for prompt, out, ref in zip(LONG_PROMPTS, result["value"], want):
            assert_greedy_equal(out.token_ids, ref, prompt, pair["model"])
        assert llm.metrics.fallbacks["fast"] > 0 and gone(stalled)
        again = llm.generate(prompt_token_ids=LONG_PROMPTS[:1], sampling_params=params)[0]
        assert_greedy_equal(again.token_ids, want[0], LONG_PROMPTS[0], pair["model"])
        assert not draft._gone and draft._proc.pid != stalled


def test_a_child_blocked_writing_a_large_reply_still_takes_a_large_message(pair, monkeypatch):
    """Both ways full: the child blocks writing a reply larger than the pipe while the parent writes it a
    message larger than the pipe. The parent reads the child's messages while it waits to write, so both
    go through: no deadlock, and no restart either."""
    from saguaro_dist.config import Config
    from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
    monkeypatch.setattr(pipe_wire, "PIPE_BYTES", PAGE)
    monkeypatch.setattr(draft_process_parent, "CALL_TIMEOUT_S", 60.0)  # a deadlock would outlast the bound below
    sampled = DraftSampling(0.8, 0, 1.0, 0)  # q [K, V] in each proposal: 12 of them outgrow a page
    process = draft_process_parent.DraftProcess(Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3,
                                                       draft_threads=1))
    child = process._proc.pid
    try:
        process.prefill([PrefillRequest(s, PROMPTS[s % len(PROMPTS)], sampled) for s in range(12)])
        pending = process.start_jit_draft([JitDraftRequest(s, 0, 0, 5) for s in range(12)])
        assert process._rx.poll(30)  # the child has begun its reply, and blocks on the full pipe
        more = [PrefillRequest(100 + j, p, sampled) for j, p in enumerate(LONG_PROMPTS)]
        run_bounded(lambda: process.prefill(more), 30, lambda: os.kill(child, signal.SIGKILL))
        proposals = pending.result()
        assert [len(p.tokens) for p in proposals] == [3] * 12
        assert not process._gone and process._proc.pid == child
    finally:
        process.close()
