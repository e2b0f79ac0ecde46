"""The engine's load (vLLM's scheduler gauges): requests running and waiting, and the target KV they hold."""
from __future__ import annotations

import pytest

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_local_engine
from saguaro_dist.engine.metrics import EngineLoad
from saguaro_dist.engine.sequence import Sequence

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]]


def test_usage_is_the_share_of_the_budget():
    assert EngineLoad(2, 1, 250, 1000).kv_cache_usage == 0.25
    assert EngineLoad().kv_cache_usage == 0.0  # no budget known yet (a remote engine before its first poll)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "ngram"])
def test_load_counts_what_the_target_pool_really_holds(tiny_llama_pair, mode):
    """Step by step: a slot per running request, the rest waiting, and KV tokens equal to the lengths the
    target's runner holds for those requests (so a rejected speculation's positions are not counted)."""
    target, draft = tiny_llama_pair
    config = Config(model=target, draft=None if mode in ("ar", "ngram") else draft, mode=mode, k=2, fan_out=4,
                    max_batch_size=2, draft_executor="auto" if mode == "ngram" else "thread", enable_prefix_caching=False)
    engine, _ = build_local_engine(config)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add(Sequence(i, f"r{i}", prompt, params))
        drafts = (0, 0) if mode in ("ar", "ngram") else (1, 1)  # a draft thread: one worker, live
        assert engine.load() == EngineLoad(0, 3, 0, 2 * engine.max_model_len, *drafts)
        engine.step()
        first = engine.load()
        assert (first.num_running, first.num_waiting) == (2, 1) and first.kv_cache_tokens >= 3 + 4  # the prompts' KV
        while engine.has_work():
            load = engine.load()
            held = sum(engine.target.runner.length(s.seq_id) for s in engine.running)
            assert load.kv_cache_tokens == held and load.num_running + load.num_waiting <= 3
            engine.step()
        assert engine.load() == EngineLoad(0, 0, 0, 2 * engine.max_model_len, *drafts)
    finally:
        engine.close()


def test_llm_load_is_a_snapshot_that_returns_to_idle(tiny_llama_pair):
    target, draft = tiny_llama_pair
    with LLM(model=target, draft=draft, mode="sd", k=2, max_batch_size=2) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(temperature=0, max_tokens=5))
        assert all(o.metrics.num_generated_tokens for o in outs)
        load = llm.load
        assert (load.num_running, load.num_waiting, load.kv_cache_tokens) == (0, 0, 0)
        assert load.kv_cache_capacity_tokens >= 2 * llm.max_model_len  # the pool also holds the speculation's tail
