"""A step whose admission raises (can_start, or the prefix-coming check) loses no request: every sequence it popped
from the waiting queue goes back, in its place, and completes on a later step with the tokens mode ar gives it.
The fault is one real method failing once (a fault injection, not a stand-in for a part)."""
from __future__ import annotations

import pytest

from saguaro_dist import SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_local_engine
from saguaro_dist.engine.sequence import FinishReason, Sequence
from test_engine_recovery_leaks import run_all

PROMPTS = [[5, 9, 2, 7, 11, 3], [1, 2, 3, 4], [40, 41, 42, 43, 44]]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def fail_on_call(obj, name: str, call: int) -> None:
    """obj.name raises on its call-th call from now (1-based), then is itself again."""
    real, calls = getattr(obj, name), [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            setattr(obj, name, real)
            raise RuntimeError(f"injected: {name} failed")
        return real(*args, **kwargs)
    setattr(obj, name, flaky)


def sequences() -> list[Sequence]:
    return [Sequence(i, f"r{i}", p, greedy(10)) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def ar_reference(tiny_checkpoint):
    engine, _ = build_local_engine(Config(model=tiny_checkpoint("llama"), mode="ar"))
    try:
        return run_all(engine, sequences())
    finally:
        engine.close()


@pytest.mark.parametrize("target_side, name", [(True, "can_start"), (False, "_prefix_coming")])
@pytest.mark.parametrize("call", [1, 2])
def test_a_raising_admission_check_loses_no_request(tiny_checkpoint, ar_reference, target_side, name, call):
    engine, _ = build_local_engine(Config(model=tiny_checkpoint("llama"), mode="ar", max_batch_size=2))
    try:
        seqs = sequences()
        for s in seqs:
            engine.add(s)
        fail_on_call(engine.target if target_side else engine, name, call)
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
        # the one it failed on, and every one behind it, wait again in their places (first come, first served)
        assert [s.request_id for s in engine.waiting] == [s.request_id for s in seqs[call - 1:]]
        while engine.has_work():
            engine.step()
        assert all(s.finish_reason is FinishReason.LENGTH for s in seqs), [s.finish_reason for s in seqs]
        assert [s.output_token_ids for s in seqs] == ar_reference
    finally:
        engine.close()
