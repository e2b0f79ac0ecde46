"""The engine's scheduling and bookkeeping against its invariants: admission under a full batch and a small
prefill budget, prompts at the end of the context, aborts wherever a request is, a failed step or abort, the
loop thread's shutdown, and the streamed text of a request with a long stop string. Real engines over tiny
checkpoints; faults are injected into the real runner where a test needs a step to fail."""
from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from engine_helpers import assert_greedy_equal, close_pair, hf_greedy, wait_for
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.demo import PAIR_DIR
from saguaro_dist.engine.build import build_local_engine
from saguaro_dist.engine.detokenizer import stable_prefix
from saguaro_dist.engine.loop_thread import EngineError, EngineThread
from saguaro_dist.engine.sequence import FinishReason, Sequence

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SHARED = [(i * 5) % 90 + 1 for i in range(40)]  # a long common prefix: prefix caching's live sources


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("scheduling_review_pair"))


def engine_kwargs(pair, mode: str) -> dict:
    return dict(model=pair["target"], mode=mode, k=3) | ({"draft": pair["close"]} if mode == "sd" else {})


def pool_rows_free(llm: LLM) -> tuple[int, int]:
    """(free, all) rows of the target's KV pool, read on the engine's own thread between two steps."""
    runner = llm._thread.engine.target.runner
    return llm._thread._on_loop(lambda: (runner.spare_rows(), runner.pool.rows))


# ---- admission: a full batch, a small prefill budget, the end of the context ---------------------------------
@pytest.mark.parametrize("mode", ["ar", "sd", "ngram"])
def test_a_full_batch_and_chunked_prefill_give_the_targets_greedy_tokens(pair, mode):
    """Two slots for five prompts (three queue), 7 prompt tokens a step (the 40-token prompts run in six
    chunks while the others decode), prompts sharing a prefix (one waits to copy another's): AR's tokens."""
    prompts = [SHARED, SHARED, SHARED + [3, 4], SHARED[:20] + [7, 7, 7], [5, 9, 2]]
    with LLM(max_batch_size=2, max_num_batched_tokens=7, **engine_kwargs(pair, mode)) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        for out, prompt in zip(outs, prompts):
            assert_greedy_equal(out.token_ids, hf_greedy(pair["model"], prompt, 10), prompt, pair["model"])
        assert llm.metrics.generated_tokens == sum(len(o.token_ids) for o in outs)
        llm.reset_prefix_cache()  # the kept prefixes go: then no row is held
        free, rows = pool_rows_free(llm)
        assert free == rows
        assert (llm.load.num_running, llm.load.num_waiting, llm.load.kv_cache_tokens) == (0, 0, 0)


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_a_prompt_that_leaves_room_for_one_token_or_two_ends_at_length(pair, mode):
    """Prompt + max_tokens exactly the usable context (SD keeps K + 1 positions for a verify): the last
    token comes and the request ends at "length"; one position more is refused before any work."""
    with LLM(max_model_len=48, max_num_batched_tokens=16, **engine_kwargs(pair, mode)) as llm:
        end = llm.max_model_len
        for room in (1, 2):
            prompt = [(i * 7) % 90 + 1 for i in range(end - room)]
            out = llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                               sampling_params=SamplingParams(temperature=0, max_tokens=room, ignore_eos=True))[0]
            assert out.finish_reason == "length"
            assert_greedy_equal(out.token_ids, hf_greedy(pair["model"], prompt, room), prompt, pair["model"])
        with pytest.raises(ValueError, match="max length"):
            llm.generate(prompt_token_ids=[[1] * end], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)


def test_a_request_waiting_to_copy_a_prefix_keeps_its_turn(pair):
    """Two slots; B shares A's long prompt, so it waits for A's prefill to copy it; C came after B. C took
    the slot B left while it waited, and B then waited for C's whole generation (first come, first served
    broken; with scheduling_policy "priority", a less urgent request served before a more urgent one)."""
    engine, _ = build_local_engine(Config(model=pair["target"], mode="ar", max_batch_size=2, max_num_batched_tokens=8))
    try:
        long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        a, b, c = (Sequence(0, "a", SHARED, GREEDY), Sequence(1, "b", SHARED + [3, 4], GREEDY),
                   Sequence(2, "c", [5, 9, 2], long))
        for s in (a, b, c):
            engine.add(s)
        first_step, step = {}, 0
        while engine.has_work():
            engine.step()
            step += 1
            for s in (a, b, c):
                if s.output_token_ids:
                    first_step.setdefault(s.request_id, step)
        assert first_step["a"] <= first_step["b"] < first_step["c"], first_step
        assert b.metrics.num_cached_tokens >= 16  # it did copy A's prefix
        for s in (a, b, c):
            assert_greedy_equal(s.output_token_ids, hf_greedy(pair["model"], s.prompt_token_ids, s.params.max_tokens),
                                s.prompt_token_ids, pair["model"])
    finally:
        engine.close()


# ---- aborts wherever a request is ----------------------------------------------------------------------------
def test_aborts_of_a_queued_a_prefilling_and_a_running_request_free_their_state(pair):
    """Drive an SD engine step by step: a request aborted while it prefills (half its prompt run), while it
    decodes, and while it still queues leaves no KV row held; the survivor gives AR's tokens; the token
    counters agree with the outputs."""
    engine, _ = build_local_engine(Config(model=pair["target"], draft=pair["close"], mode="sd", k=3,
                                          max_batch_size=2, max_num_batched_tokens=8, enable_prefix_caching=False))
    try:
        runner = engine.target.runner
        seqs = [Sequence(i, f"r{i}", [(i * 11 + j * 3) % 90 + 1 for j in range(20)], GREEDY) for i in range(4)]
        for s in seqs:
            engine.add(s)
        engine.step()
        assert 0 < seqs[0].prefilled < 20
        engine.abort("r0")  # prefilling: its half-run prompt's row goes
        while not seqs[1].output_token_ids:
            engine.step()
        engine.abort("r1")  # running
        engine.abort("r3")  # queued (or prefilling by now)
        while engine.has_work():
            engine.step()
        assert [s.finish_reason for s in seqs] == [FinishReason.ABORT, FinishReason.ABORT, FinishReason.LENGTH,
                                                   FinishReason.ABORT]
        assert_greedy_equal(seqs[2].output_token_ids, hf_greedy(pair["model"], seqs[2].prompt_token_ids, 10),
                            seqs[2].prompt_token_ids, pair["model"])
        assert runner.spare_rows() == runner.pool.rows
        assert engine.metrics.generated_tokens == sum(len(s.output_token_ids) for s in seqs)
        assert all(s.metrics.num_generated_tokens == len(s.output_token_ids) for s in seqs)
        assert engine.abort("r2") == []  # finished: nothing to abort
    finally:
        engine.close()


# ---- a failed prefill frees its rows --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_a_failed_prefill_frees_the_kv_rows_of_the_requests_it_admitted(pair, mode):
    """A forward that fails while new requests are admitted (their whole prompts within the step's budget)
    fails their callers; the engine then holds nothing. The admitted ones had left the prefill queue and
    were not yet running, so reset() missed them: their KV rows stayed taken for good."""
    with LLM(max_batch_size=2, **engine_kwargs(pair, mode)) as llm:
        runner = llm._thread.engine.target.runner
        extend, failed = runner.extend, []

        def fail_once(*args, **kwargs):
            if not failed:
                failed.append(1)
                raise RuntimeError("injected: the forward failed")
            return extend(*args, **kwargs)
        runner.extend = fail_once
        with pytest.raises(EngineError, match="injected"):
            llm.generate(prompt_token_ids=[[5, 9, 2], [1, 2, 3, 4]], sampling_params=GREEDY, use_tqdm=False)
        free, rows = pool_rows_free(llm)
        assert free == rows, f"{rows - free} KV rows still held after every request failed"
        out = llm.generate(prompt_token_ids=[[5, 9, 2]], sampling_params=GREEDY, use_tqdm=False)[0]
        assert_greedy_equal(out.token_ids, hf_greedy(pair["model"], [5, 9, 2], 10), [5, 9, 2], pair["model"])


# ---- the loop thread: a failed abort, a stop with requests not yet taken --------------------------------------
class Listener:
    """A request's listener: what the loop thread delivers, in a queue."""

    def __init__(self):
        self.items: queue.Queue = queue.Queue()

    def __call__(self, item) -> None:
        self.items.put(item)

    def last(self, within_s: float = 30.0):
        """The item that ended the request (a finished update or an error); fails if none comes in time."""
        while True:
            item = self.items.get(timeout=within_s)
            if isinstance(item, BaseException) or item.finished:
                return item


def hold_the_loop(thread: EngineThread) -> threading.Event:
    """Park the loop thread in a chore between two steps until the returned event is set."""
    release, entered = threading.Event(), threading.Event()

    def chore():
        entered.set()
        release.wait(30)
    threading.Thread(target=thread._on_loop, args=(chore,), daemon=True).start()
    assert entered.wait(30)
    return release


def test_an_abort_that_fails_fails_the_requests_in_flight_and_the_loop_goes_on(pair):
    """Freeing an aborted request's state raised (say a draft or a tensor-parallel rank gone): it ended the
    loop thread, and every caller, the other request's too, waited forever. Now it is a failed step's case."""
    engine, _ = build_local_engine(Config(model=pair["target"], mode="ar", max_batch_size=2))
    thread = EngineThread(engine)
    try:
        long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
        listeners = [Listener(), Listener()]
        thread.submit_many([(Sequence(0, "a", [5, 9, 2], long), listeners[0]),
                            (Sequence(1, "b", [1, 2, 3], long), listeners[1])])
        for listener in listeners:  # both run (their first updates came)
            listener.items.get(timeout=30)
        release = hold_the_loop(thread)
        free = engine.loop.release

        def failing_release(seqs):
            engine.loop.release = free
            raise RuntimeError("injected: release failed")
        engine.loop.release = failing_release
        thread.abort("a")
        release.set()
        for listener in listeners:
            assert isinstance(listener.last(), EngineError)
        assert thread._thread.is_alive()
        after = Listener()
        thread.submit(Sequence(2, "c", [5, 9, 2], GREEDY), after)
        done = after.last()
        assert not isinstance(done, BaseException)
        assert_greedy_equal(done.seq.output_token_ids, hf_greedy(pair["model"], [5, 9, 2], 10), [5, 9, 2],
                            pair["model"])
    finally:
        thread.stop()


def test_a_request_submitted_just_before_a_stop_is_told_the_engine_shut_down(pair):
    """submit() took the request (the engine was not stopped yet), then stop() came before the loop took its
    inbox: the loop ended without telling that caller, whose generate() waited forever."""
    with LLM(model=pair["target"], mode="ar") as llm:
        thread = llm._thread
        release = hold_the_loop(thread)
        outcome: list = []

        def generate():
            try:
                outcome.append(llm.generate(prompt_token_ids=[[5, 9, 2]], sampling_params=GREEDY, use_tqdm=False))
            except EngineError as err:
                outcome.append(err)
        caller = threading.Thread(target=generate, daemon=True)
        caller.start()
        wait_for(lambda: thread._inbox)
        stopper = threading.Thread(target=thread.stop, daemon=True)
        stopper.start()
        wait_for(lambda: thread._stopped)
        release.set()
        stopper.join(30)
        caller.join(30)
        assert not caller.is_alive(), "the caller still waits for a request the stopped engine never took"
        assert isinstance(outcome[0], EngineError)
        assert not thread._thread.is_alive()


# ---- streamed text with a stop string longer than the text so far -------------------------------------------
def test_stable_prefix_holds_back_all_of_a_text_shorter_than_a_stop_string():
    """text[:len(text) - holdback] with a negative end counted from the end: a 6-character text with a
    9-character stop string showed its first 4 characters, which the stop string may begin."""
    text, stop = "ab日本🙂cd✓xy語z", "日本🙂cd✓xy語"
    for end in range(len(text) + 1):
        assert stable_prefix(text[:end], (stop,)) == text[:max(0, end - len(stop) + 1)]


@pytest.fixture(scope="module")
def demo_ar():
    with LLM(model=str(PAIR_DIR / "target"), mode="ar") as llm:
        yield llm


def test_a_stream_never_sends_text_that_a_long_stop_string_then_cuts(demo_ar):
    """A stop string of 16 characters that begins 1 character into the output: the deltas joined are the
    final text (they ran ahead of it, into the stop string: what stable_prefix passed of a text shorter than
    the holdback)."""
    prompt, params = "def add(a, b):", SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    text = demo_ar.generate([prompt], params, use_tqdm=False)[0].text
    at = next(i for i in range(1, len(text) - 16) if text.find(text[i:i + 16]) == i)
    stop = text[at:at + 16]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop])

    async def deltas():
        return [d async for d in demo_ar.stream(prompt, params)]
    streamed = asyncio.run(deltas())
    final = demo_ar.generate([prompt], params, use_tqdm=False)[0]
    assert (final.text, final.finish_reason, final.stop_reason) == (text[:at], "stop", stop)
    assert "".join(d.text for d in streamed) == final.text


def test_a_request_the_engine_fails_to_take_fails_alone_and_the_loop_goes_on(pair):
    """engine.add raising anything but a ValueError (a grammar compiler's own error, say) ended the loop
    thread: every caller waited forever. Now that caller gets an EngineError and the loop serves on."""
    engine, _ = build_local_engine(Config(model=pair["target"], mode="ar", max_batch_size=2))
    thread = EngineThread(engine)
    try:
        add = engine.add

        def failing_add(seq):
            engine.add = add
            raise RuntimeError("injected: add failed")
        engine.add = failing_add
        refused = Listener()
        thread.submit(Sequence(0, "a", [5, 9, 2], GREEDY), refused)
        error = refused.last()
        assert isinstance(error, EngineError) and "add failed" in str(error)
        after = Listener()
        thread.submit(Sequence(1, "b", [5, 9, 2], GREEDY), after)
        done = after.last()
        assert not isinstance(done, BaseException) and thread._thread.is_alive()
    finally:
        thread.stop()
