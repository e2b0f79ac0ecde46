"""The one-host draft in a child process: exact, survives the child dying, leaves nothing behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from engine_helpers import DEVICE, PROMPTS, assert_greedy_equal, close_pair, hf_greedy, wait_for
from saguaro_dist import LLM, SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
CHILD_MARK = "saguaro_dist.engine.draft_process"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("process_pair"))


@pytest.fixture(scope="module")
def long_reference(pair):
    """transformers' greedy tokens of PROMPTS under LONG, computed once for the tests that check them."""
    return [hf_greedy(pair["model"], p, LONG.max_tokens) for p in PROMPTS]


def draft_children() -> set[int]:
    """Pids of this process's draft children (read from /proc: no private handles). Other tests'
    long-lived engines may own some: compare before and after."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if ppid == os.getpid() and CHILD_MARK in cmdline:
            pids.add(int(entry))
    return pids


@pytest.mark.parametrize("executor", ["process", "split"])
@pytest.mark.parametrize("tree_policy", ["auto", "never"])  # never: two cohorts, one's drafts in flight at the kill
def test_killed_draft_process_costs_speed_not_tokens(pair, long_reference, executor, tree_policy):
    want = long_reference
    before = draft_children()
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=12, max_batch_size=4,
             draft_executor=executor, tree_policy=tree_policy) as llm:
        [child] = draft_children() - before
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            outs=llm.generate(prompt_token_ids=PROMPTS, sampling_params=LONG)))
        worker.start()
        wait_for(lambda: (m := llm.metrics).cache_hits + m.cache_misses + m.cohort_rounds >= 3, within_s=30)  # mid-generation
        os.kill(child, signal.SIGKILL)
        worker.join(timeout=120)
        assert not worker.is_alive()
        for prompt, out, ref in zip(PROMPTS, result["outs"], want):
            assert_greedy_equal(out.token_ids, ref, prompt, pair["model"])
        assert llm.metrics.fallbacks["fast"] > 0, "the kill landed after the generation"
        # The next request re-admits its sequence: a new child, drafting again.
        drafts = llm.metrics.jit_rounds
        again = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=LONG)[0]
        assert_greedy_equal(again.token_ids, want[0], PROMPTS[0], pair["model"])
        assert llm.metrics.jit_rounds > drafts  # the draft drafts again (a lost one never is asked)
        assert len(draft_children() - before) == 1 and child not in draft_children()


@pytest.mark.parametrize("mode, extra", [("sd", {}), ("ssd", {}), ("ssd", {"tree_policy": "never"})])
def test_a_draft_out_of_step_costs_speed_not_the_request(pair, long_reference, mode, extra):
    """A draft that lost track of a sequence's round (a lost outcome, say) answers OutOfOrder; the
    engine gives those sequences the fast backup and prefills them again, as for a dead draft."""
    want = long_reference
    with LLM(model=pair["target"], draft=pair["close"], mode=mode, k=3, draft_executor="thread", **extra) as llm:
        draft = llm._thread.engine.loop.draft.worker
        calls = []

        def out_of_step(method):  # on the draft's own thread, once: the 3rd call of either kind
            def call(reqs):
                calls.append(method)
                if len(calls) == 3:
                    for s in draft.seqs.values():
                        s.round += 5  # as if it had observed outcomes the target never sent
                return getattr(type(draft), method)(draft, reqs)
            return call
        prefills = []
        draft.jit_draft, draft.observe = out_of_step("jit_draft"), out_of_step("observe")
        draft.prefill = lambda reqs: prefills.extend(reqs) or type(draft).prefill(draft, reqs)
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=LONG)
        for prompt, out, ref in zip(PROMPTS, outs, want):
            assert_greedy_equal(out.token_ids, ref, prompt, pair["model"])
        assert len(calls) > 3 and llm.metrics.fallbacks["fast"] > 0
        again = prefills[len(PROMPTS):]  # the re-prefills carry output: the prompt is marked (penalties)
        assert again and all(0 < r.prompt_len < len(r.prompt_token_ids) for r in again)


@pytest.fixture(scope="module")
def default_ssd_llm(pair) -> dict:
    """An ssd LLM of the defaults (draft_threads unset), built and shut down once for the two tests that read
    its construction: its new draft children, and the build's warnings."""
    import io
    import logging
    logger, text = logging.getLogger("saguaro_dist.engine.build"), io.StringIO()
    handler, level = logging.StreamHandler(text), logger.level
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    before = draft_children()
    try:
        with LLM(model=pair["target"], draft=pair["close"], mode="ssd", k=3):
            children = len(draft_children() - before)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {"children": children, "warnings": text.getvalue()}


def test_unset_draft_threads_are_warned_about(pair, default_ssd_llm, caplog):
    assert "set draft_threads" in default_ssd_llm["warnings"]
    with caplog.at_level("WARNING", logger="saguaro_dist.engine.build"):
        with LLM(model=pair["target"], draft=pair["close"], mode="ssd", k=3, target_threads=1, draft_threads=1):
            pass
        assert "set draft_threads" not in caplog.text


def test_a_draft_asked_of_a_child_since_replaced_fails_at_once(pair):
    """Two cohorts leave a draft in flight across rounds; if the child dies and a prefill starts a new one
    before the draft is taken, the new child never got that call: taking it raises DraftUnavailable at
    once (the engine's fast backup), not after CALL_TIMEOUT_S."""
    from saguaro_dist.config import Config
    from saguaro_dist.distributed.errors import DraftUnavailable
    from saguaro_dist.engine.draft_process import DraftProcess
    from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
    greedy = DraftSampling(0.0, 0, 1.0, None)
    process = DraftProcess(Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, draft_threads=1))
    try:
        process.prefill([PrefillRequest(1, PROMPTS[0], greedy)])
        assert len(process.start_jit_draft([JitDraftRequest(1, 0, 0, 7)]).result()[0].tokens) == 3
        pending = process.start_jit_draft([JitDraftRequest(1, 1, 0, 7)])
        os.kill(process._proc.pid, signal.SIGKILL)
        process._proc.wait()
        with pytest.raises(DraftUnavailable):  # the dead child's pipe: the next prefill starts another
            process.prefill([PrefillRequest(2, PROMPTS[1], greedy)])
        process.prefill([PrefillRequest(2, PROMPTS[1], greedy)])
        start = time.monotonic()
        with pytest.raises(DraftUnavailable, match="restarted"):
            pending.result()
        assert time.monotonic() - start < 1.0
    finally:
        process.close()


def test_shutdown_leaves_no_child(pair):
    before = draft_children()
    llm = LLM(model=pair["target"], draft=pair["close"], mode="sd", k=3, draft_executor="process")
    assert len(draft_children() - before) == 1
    llm.shutdown()
    assert draft_children() == before


def test_auto_runs_the_ssd_draft_in_a_process_and_the_sd_draft_on_a_thread(pair, default_ssd_llm):
    assert default_ssd_llm["children"] == 1, "ssd"
    before = draft_children()
    with LLM(model=pair["target"], draft=pair["close"], mode="sd", k=3):
        assert len(draft_children() - before) == 0, "sd"


def test_a_draft_that_cannot_load_fails_construction_clearly(pair, tmp_path):
    broken = tmp_path / "broken_draft"
    broken.mkdir()
    (broken / "config.json").write_text((open(os.path.join(pair["close"], "config.json")).read()))
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    before = draft_children()
    with pytest.raises(RuntimeError, match="draft process could not start"):
        LLM(model=pair["target"], draft=str(broken), mode="ssd", k=3)
    assert draft_children() == before


def test_a_script_without_a_main_guard_works(pair, tmp_path):
    """The child is `python -m`, not a multiprocessing spawn that re-runs the user's script."""
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""
        from saguaro_dist import LLM, SamplingParams
        llm = LLM(model={pair['target']!r}, draft={pair['close']!r}, mode="ssd", k=3)
        out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(temperature=0, max_tokens=8))
        print("TOKENS", len(out[0].token_ids))
        llm.shutdown()
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TOKENS 8" in done.stdout


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_finished_requests_leave_no_trees_behind(pair, executor):
    """The last round's tree always arrives unasked; a server must not keep one per finished request."""
    params = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=0)
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, draft_executor=executor) as llm:
        for _ in range(4):
            llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)  # a round trip after the releases
        wait_for(lambda: len(llm._thread.engine.loop.draft.inbox) == 0, within_s=10)


def test_spin_until_readable_returns_on_data_and_gives_up_after_its_budget():
    import time
    from multiprocessing import Pipe
    from saguaro_dist.engine.draft_process import spin_until_readable
    rx, tx = Pipe(duplex=False)
    start = time.perf_counter()
    assert spin_until_readable(rx, 0.05) is False          # nothing came: it stops spinning (then blocks)
    assert 0.04 <= time.perf_counter() - start < 2.0
    assert spin_until_readable(rx, 0.0) is False            # 0 turns the spin off
    tx.send_bytes(b"x")
    assert spin_until_readable(rx, 5.0) is True              # data: returns at once, the message unread
    assert rx.recv_bytes() == b"x"


def test_every_message_of_the_child_carries_its_capture_count(monkeypatch):
    """Right after its kind: the parent's tree gate leaves out a round during which the child's count
    moved (a CUDA-graph capture there stalls the round that waits on it)."""
    from multiprocessing import Pipe
    from saguaro_dist.engine import draft_process
    from saguaro_dist.engine.draft_process import Msg, _Child
    from saguaro_dist.engine.pipe_wire import recv
    from test_grpc_toy_worker import ToyWorker
    monkeypatch.setattr(draft_process, "graph_captures", lambda: 7)
    from_child, child_tx = Pipe(duplex=False)
    child = _Child(ToyWorker(), None, child_tx)
    child._answer(3, "reset_prefix_cache", None)
    child._run_posted("jit_draft", [object()])  # fails: not a request
    assert recv(from_child) == (Msg.REPLY, 7, 3, True, None)
    assert recv(from_child)[:3] == (Msg.POST_FAILED, 7, "jit_draft")


def child_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_split_rounds_without_trees_reach_the_child_with_the_next_that_wants_one(pair):
    """A round that asks the child for no tree posts nothing (a woken core slows the target's); the next
    round that wants a tree sends them all first, in order, and its tree is the one a draft that saw every
    round builds. The child blocks when nothing is asked of it and spins once it built a tree."""
    from saguaro_dist.config import Config
    from saguaro_dist.engine.build import build_draft_worker
    from saguaro_dist.engine.draft_backend import LocalDraftBackend
    from saguaro_dist.engine.draft_process import DraftProcess
    from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
    from saguaro_dist.engine.split_draft import SplitDraftBackend
    config = Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6, draft_threads=1,
                    draft_spin_s=1.0)
    # Past Config's 1 s cap: the spin must outlast any stall of this thread on a loaded CI box, or the
    # window that began at the child's tree may be over before it is looked at.
    object.__setattr__(config, "draft_spin_s", 10.0)
    prefill = [PrefillRequest(1, PROMPTS[0], DraftSampling(0.0, 0, 1.0, None))]
    split = SplitDraftBackend(LocalDraftBackend(build_draft_worker(config)), DraftProcess(config))
    seen_all = LocalDraftBackend(build_draft_worker(config))
    posted = []
    post = split.trees._post
    split.trees._post = lambda method, *rest: (posted.append(method), post(method, *rest))
    try:
        for backend in (split, seen_all):
            backend.prefill(prefill)
        posted.clear()
        bonus = 5
        for r in range(6):
            reqs = [JitDraftRequest(1, r, r % 3, bonus, skip_tree=True)]
            assert split.jit_draft(reqs)[0].tokens.tolist() == seen_all.jit_draft(reqs)[0].tokens.tolist()
            bonus = (bonus * 7 + 3) % 64
        assert posted == []
        pid = split.trees._proc.pid
        idle = child_cpu_s(pid)
        time.sleep(0.4)
        assert child_cpu_s(pid) - idle < 0.1  # nothing asked of it since the prefill: it blocks, not spins
        wanted = [JitDraftRequest(1, 6, 1, bonus)]
        assert split.jit_draft(wanted)[0].tokens.tolist() == seen_all.jit_draft(wanted)[0].tokens.tolist()
        split.send_outcomes([])
        seen_all.send_outcomes([])
        assert posted == ["catch_up", "send_outcomes"]
        got, want = split.wait_trees([(1, 6)], 30.0)[1], seen_all.wait_trees([(1, 6)], 30.0)[1]
        assert got.proposals.tokens.tolist() == want.proposals.tokens.tolist()
        assert (got.accepted, got.bonus_tokens) == (want.accepted, want.bonus_tokens)
        # It built a tree: it spins, waiting for the next outcome. Spinning it is runnable (R) however
        # little of a core a loaded box gives it; blocked it sleeps (S).
        states = []
        for _ in range(10):
            states.append(child_state(pid))
            time.sleep(0.02)
        assert states.count("R") >= 5, states
    finally:
        split.close()
        seen_all.close()


def test_a_stalled_child_costs_a_sampled_round_one_timeout_not_two(pair):
    """A child that stops (alive, its pipe open: SIGSTOP) sends neither the round's plans nor its trees. The
    target waits tree_timeout_s for the plans, then takes what trees are there at once; once the child runs
    again its late tree still arrives for a later wait."""
    from saguaro_dist.config import Config
    from saguaro_dist.engine.draft_process import DraftProcess
    from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
    config = Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6, draft_threads=1)
    process = DraftProcess(config)
    try:
        process.prefill([PrefillRequest(1, PROMPTS[0], DraftSampling(0.8, 0, 1.0, 5))])
        process.jit_draft([JitDraftRequest(1, 0, 0, 7)])
        os.kill(process._proc.pid, signal.SIGSTOP)
        process.send_outcomes([])  # the round's trees are asked for: the child cannot answer
        start = time.monotonic()
        assert process.wait_plans([(1, 0)], 1.0) == {}
        assert time.monotonic() - start >= 1.0
        start = time.monotonic()
        assert process.wait_trees([(1, 0)], 5.0) == {}
        assert time.monotonic() - start < 2.5  # unfixed: a second timeout, 5 s; half of it is room for a loaded box
        os.kill(process._proc.pid, signal.SIGCONT)
        assert set(process.wait_trees([(1, 0)], 30.0)) == {1}
    finally:
        os.kill(process._proc.pid, signal.SIGCONT)
        process.close()


def test_the_child_prefills_beside_the_target_and_forgets_what_a_failed_target_prefill_began(pair):
    """The child's prefill is posted before the target's prefill and taken after it. When the target's
    prefill fails, both halves of the split draft release what they began to hold, and the next request
    is exact."""
    from saguaro_dist.engine.loop_thread import EngineError
    short = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, draft_executor="split") as llm:
        loop = llm._thread.engine.loop
        split, target_prefill, order = loop.draft, loop.target.prefill, []
        post = split.trees._post
        split.trees._post = lambda method, *rest: (order.append(method), post(method, *rest))

        def failing(seqs):
            order.append("target")
            raise RuntimeError("injected target prefill failure")
        loop.target.prefill = failing
        with pytest.raises(EngineError):
            llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=short)
        # The caller hears of the failure before the engine's recovery releases the sequences, and the thread half
        # releases on its worker thread: wait for both (a chore runs after the recovery; a call after the release).
        llm._thread._on_loop(lambda: None)
        split.jit.call(lambda _: None, None)
        assert order[:2] == ["prefill", "target"] and "release" in order
        assert split.trees._known == set() and split.jit.worker.seqs == {}
        loop.target.prefill = target_prefill
        out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=short)[0]
    assert_greedy_equal(out.token_ids, hf_greedy(pair["model"], PROMPTS[0], short.max_tokens), PROMPTS[0], pair["model"])
