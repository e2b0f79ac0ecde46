"""A one-host LLM's life around the user's process (session 93's lifecycle review): Ctrl-C, the main thread returning
while another thread generates, an LLM dropped without shutdown(), and a fork.

Old: Ctrl-C during generate() ended the script with SIGABRT ("terminate called without an active exception": the
engine's threads ran torch while the interpreter finalized); a generate() on a non-daemon thread failed once the main
thread returned (concurrent.futures refuses work in every pool from then on: "cannot schedule new futures after
interpreter shutdown"); a dropped LLM kept its threads, draft process and memory for the life of the process; and a
generate() in a child forked since the engine started waited forever (its loop thread is not in the child)."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine_helpers import close_pair
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.engine.loop_thread import EngineError

HERE = Path(__file__).parent
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

SCRIPT_HEAD = r'''
import os, sys, threading, time
import torch
torch.set_num_threads(1)
from saguaro_dist import LLM, SamplingParams
target, draft, executor = sys.argv[1:4]
llm = LLM(model=target, draft=draft, mode="ssd", k=3, draft_executor=executor, target_threads=1, draft_threads=1)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
'''

CTRL_C = SCRIPT_HEAD + r'''
threading.Timer(0.5, lambda: os.kill(os.getpid(), __import__("signal").SIGINT)).start()
llm.generate(prompt_token_ids=[[1, 2, 3]] * 32, sampling_params=LONG, use_tqdm=False)
print("generate ended before the Ctrl-C", flush=True)
'''

MAIN_RETURNS = SCRIPT_HEAD + r'''
def work():
    outs = llm.generate(prompt_token_ids=[[1, 2, 3]] * 8, sampling_params=LONG, use_tqdm=False)
    print("worker:", len(outs), flush=True)
    outs = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=20), use_tqdm=False)
    print("worker:", len(outs), flush=True)  # (submitted after the main thread returned, whatever the first took)
threading.Thread(target=work).start()  # not a daemon: the interpreter waits for it once the main thread returns
time.sleep(0.3)
'''


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pair = close_pair(tmp_path_factory.mktemp("lifecycle_pair"))
    return pair["target"], pair["close"]


def run(script: str, pair, executor: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script, *pair, executor], capture_output=True, text=True, timeout=240,
                          env=env, cwd=HERE)


@pytest.mark.slow
def test_ctrl_c_during_generate_ends_the_script_with_keyboard_interrupt_not_an_abort(pair):
    """On the CPU's default executor (split); the draft thread's ("thread") aborted alike."""
    done = run(CTRL_C, pair, "split")
    assert "generate ended before the Ctrl-C" not in done.stdout, "the generation was too short to be interrupted"
    assert done.returncode == -signal.SIGINT, (done.returncode, done.stderr[-2000:])
    assert "terminate called" not in done.stderr and "cannot schedule new futures" not in done.stderr


@pytest.mark.slow
def test_a_thread_generating_after_the_main_thread_returned_finishes(pair):
    """With the draft on a thread of this process ("thread"; split's draft pool failed alike)."""
    done = run(MAIN_RETURNS, pair, "thread")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["worker: 8", "worker: 1"], done.stderr[-2000:]


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_an_llm_dropped_without_shutdown_frees_its_engine(pair, executor):
    before = _child_pids()
    llm = LLM(model=pair[0], draft=pair[1], mode="ssd", k=3, draft_executor=executor, target_threads=1, draft_threads=1)
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SHORT, use_tqdm=False)
    loop, its_children = llm._thread._thread, _child_pids() - before  # (the draft process, if any)
    assert bool(its_children) == (executor == "process")
    del llm
    gc.collect()
    deadline = time.monotonic() + 30
    while (loop.is_alive() or its_children & _child_pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not loop.is_alive(), "the dropped LLM's engine thread still runs"
    assert not its_children & _child_pids(), "the dropped LLM's draft process still runs"


def _child_pids() -> set[int]:
    """This process's live children, whichever of its threads started them (/proc lists them per thread)."""
    pids = set()
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        try:
            pids |= {int(p) for p in children.read_text().split()}
        except OSError:  # (a thread that ended meanwhile)
            pass
    return pids


def test_generate_in_a_child_forked_since_the_engine_started_fails_at_once(pair):
    with LLM(model=pair[0], draft=pair[1], mode="ssd", k=3, draft_executor="thread", target_threads=1,
             draft_threads=1) as llm:
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SHORT, use_tqdm=False)
        time.sleep(0.2)  # idle: the loop waits on its condition, holding no lock the child would inherit held
        pid = os.fork()
        if pid == 0:  # the child: 0 if generate raises the engine error at once, 1 otherwise, 2 if it hangs
            signal.signal(signal.SIGALRM, lambda *_: os._exit(2))
            signal.alarm(10)
            try:
                llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SHORT, use_tqdm=False)
            except EngineError as err:
                os._exit(0 if "forked" in str(err) else 1)
            os._exit(1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        pid = os.fork()
        if pid == 0:  # the child's shutdown (its exit's finalizer too) leaves the parent's engine alone
            llm.shutdown()
            os._exit(0 if not llm._thread._stopped else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SHORT, use_tqdm=False)[0].token_ids


def test_a_second_shutdown_at_the_same_time_returns_once_the_engine_is_stopped(pair):
    """Old: the finalizer runs once, so a second shutdown() racing the first returned at once, while the first was
    still closing the engine (a caller that then built an engine needing the same CPUs or memory found them held)."""
    target, draft = pair
    llm = LLM(model=target, draft=draft, mode="ssd", k=2, draft_executor="thread")
    engine, closed = llm._thread.engine, []
    plain_close = engine.close
    engine.close = lambda: (time.sleep(1.0), plain_close(), closed.append(time.monotonic()))
    returned = []
    callers = [threading.Thread(target=lambda: (llm.shutdown(), returned.append(time.monotonic()))) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=30)
    assert len(closed) == 1 and len(returned) == 2
    assert min(returned) >= closed[0], "a shutdown() returned before the engine was closed"


def test_a_shutdown_reached_again_on_the_same_thread_returns(pair):
    """shutdown() re-entered on its own thread while it stops the engine (a serve app's __del__, collected then, calls
    it) returns: a plain lock there waited on itself forever."""
    target, draft = pair
    llm = LLM(model=target, draft=draft, mode="ssd", k=2, draft_executor="thread")
    engine = llm._thread.engine
    plain_close = engine.close
    engine.close = lambda: (llm.shutdown(), plain_close())
    caller = threading.Thread(target=llm.shutdown, daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "shutdown() waited on itself"
