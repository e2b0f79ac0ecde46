"""The engine's admission against what vLLM users expect: the end of the context (a prompt with no room is
refused alone, generation is capped there with finish "length", max_tokens=None runs to it), priority
order (lower first, ties by arrival, running requests never preempted) and a burst far larger than the
batch (none lost, first come first served, aborts of waiting requests touch nothing else). Real engines
over tiny transformers checkpoints; greedy outputs compared with transformers'."""
from __future__ import annotations

import pytest

from engine_helpers import close_pair, hf_greedy
from saguaro_dist import SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_local_engine
from saguaro_dist.engine.sequence import FinishReason, Sequence

pytestmark = pytest.mark.timeout(300)
PROMPT = [(i * 7) % 90 + 1 for i in range(40)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("scheduler_review_pair"))


def engine_of(pair, mode: str = "ar", **kwargs):
    draft = {"draft": pair["close"], "draft_executor": "thread"} if mode in ("sd", "ssd") else {}
    engine, _ = build_local_engine(Config(model=pair["target"], mode=mode, k=3, **draft, **kwargs))
    return engine


def run(engine) -> list[int]:
    """Step until idle; the step at which each request's first token came, in order of arrival."""
    firsts, step = {}, 0
    while engine.has_work():
        step += 1
        for u in engine.step():
            if u.token_delta:
                firsts.setdefault(u.seq.request_id, step)
    return firsts


def greedy(max_tokens: int | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# ---- the end of the context --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "ngram"])
@pytest.mark.parametrize("max_tokens", [30, None])
def test_generation_is_capped_at_the_context_end_with_finish_length(pair, mode, max_tokens):
    """prompt + max_tokens past max_model_len (or max_tokens None): vLLM's engine generates up to the
    context's end and finishes "length". The engine ran past it and its forward failed the whole step
    (a None max_tokens failed at its first comparison)."""
    engine = engine_of(pair, mode, max_model_len=48)
    try:
        seq = Sequence(0, "a", PROMPT, greedy(max_tokens))
        engine.add(seq)
        run(engine)
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.num_tokens == engine.context_len == 48  # every mode, as ar (tests/test_context_end.py)
        assert seq.output_token_ids == hf_greedy(pair["model"], PROMPT, len(seq.output_token_ids))
    finally:
        engine.close()


def test_a_prompt_with_no_room_is_refused_alone_with_its_lengths(pair):
    """A prompt as long as the context or longer is refused at add (vLLM's "longer than the maximum model
    length"); the request beside it runs. It was queued, and its prefill failed every request of the step."""
    engine = engine_of(pair, "ar", max_model_len=48)
    try:
        for n in (48, 60):
            with pytest.raises(ValueError, match=f"length {n}.*maximum model length of 48"):
                engine.add(Sequence(n, f"long{n}", [1] * n, greedy(4)))
        for bad in ([], [96]):
            with pytest.raises(ValueError, match="empty prompt|token ids must be in"):
                engine.add(Sequence(1, "bad", bad, greedy(4)))
        prompt = [(i * 7) % 90 + 1 for i in range(47)]
        ok = Sequence(2, "ok", prompt, greedy(4))  # exactly one position left: one token, then "length"
        engine.add(ok)
        run(engine)
        assert ok.finish_reason is FinishReason.LENGTH
        assert ok.output_token_ids == hf_greedy(pair["model"], prompt, 1)
    finally:
        engine.close()


# ---- priority ------------------------------------------------------------------------------------------------
def test_an_urgent_arrival_waits_for_a_slot_but_goes_before_earlier_less_urgent_waiters(pair):
    """Two slots held by running priority-5 requests, two more priority-5 waiting, then a priority -1 and a
    second priority -1: the running ones are not preempted (they finish whole), the urgent ones take the
    next slots in arrival order, and the earlier priority-5 waiters come last, in their arrival order."""
    engine = engine_of(pair, "ar", max_batch_size=2, scheduling_policy="priority")
    try:
        seqs = {name: Sequence(i, name, PROMPT[i:i + 8], greedy(6), priority=p)
                for i, (name, p) in enumerate([("run1", 5), ("run2", 5), ("low1", 5), ("low2", 5)])}
        for s in seqs.values():
            engine.add(s)
        engine.step()
        assert {s.request_id for s in engine.running} == {"run1", "run2"}
        for i, name in enumerate(("urgent1", "urgent2")):
            seqs[name] = Sequence(10 + i, name, PROMPT[20 + i:28 + i], greedy(6), priority=-1)
            engine.add(seqs[name])
        firsts = run(engine)
        order = sorted(firsts, key=lambda name: (firsts[name], list(seqs).index(name)))
        assert order[2:] == ["urgent1", "urgent2", "low1", "low2"]
        assert firsts["urgent1"] < firsts["low1"]
        for s in seqs.values():
            assert s.finish_reason is FinishReason.LENGTH and len(s.output_token_ids) == 6
            assert s.output_token_ids == hf_greedy(pair["model"], s.prompt_token_ids, 6)
    finally:
        engine.close()


# ---- a burst far larger than the batch ---------------------------------------------------------------------
def test_a_burst_of_100_keeps_fcfs_loses_none_and_aborting_waiters_touches_nothing_else(pair):
    """100 requests at once into 4 slots: every one ends, first tokens come in arrival order, and aborting
    ten still waiting (while four run) ends those alone; every survivor's tokens are transformers'."""
    engine = engine_of(pair, "ar", max_batch_size=4, enable_prefix_caching=False)
    try:
        prompts = [PROMPT[i % 30:i % 30 + 3 + i % 5] for i in range(100)]
        seqs = [Sequence(i, f"r{i}", p, greedy(3 + i % 4)) for i, p in enumerate(prompts)]
        for s in seqs:
            engine.add(s)
        engine.step()
        running = {s.request_id for s in engine.running}
        aborted = {f"r{i}" for i in range(50, 100, 5)}
        for request_id in aborted:
            assert [u.seq.request_id for u in engine.abort(request_id)] == [request_id]
        assert {s.request_id for s in engine.running} == running and len(engine.waiting) == 100 - 4 - 10
        firsts = run(engine)
        assert [s.finish_reason for s in seqs if s.request_id in aborted] == [FinishReason.ABORT] * 10
        survivors = [s for s in seqs if s.request_id not in aborted]
        assert all(s.finish_reason is FinishReason.LENGTH for s in survivors)
        steps = [firsts[s.request_id] for s in survivors]
        assert steps == sorted(steps) and set(firsts) == {s.request_id for s in survivors}
        hf = {}
        for s in survivors:
            key = (tuple(s.prompt_token_ids), s.params.max_tokens)
            hf.setdefault(key, hf_greedy(pair["model"], s.prompt_token_ids, s.params.max_tokens))
            assert s.output_token_ids == hf[key], s.request_id
    finally:
        engine.close()
