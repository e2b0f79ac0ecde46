"""Prefix caching's lookup and its counters (model/prefix_cache.py, engine/engine.py), as a reviewer found them:
a full pool evicted the least recently used kept row before looking up, losing the hit when that row was the
match (CUDA's preallocated pool of max_batch_size rows then never hit a repeated prompt); prefix_cache_queries
counted prompts that never looked the cache up; a twin of a prompt too short to lend anything waited a step
for it. Outputs with the cache equal outputs without it. Real engines over a tiny transformers checkpoint."""
from __future__ import annotations

import functools

import pytest
import torch

from engine_helpers import close_pair, llama_config, save_model
from saguaro_dist import SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine import build
from saguaro_dist.engine.metrics import EngineLoad
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.engine.stats_log import StatsLogger
from saguaro_dist.model import ModelRunner
from saguaro_dist.model.prefix_cache import MIN_REUSE, PrefixCache, reusable_len

pytestmark = pytest.mark.timeout(300)

SYSTEM = [(7 * i + 3) % 90 + 2 for i in range(40)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("lookup_first_tiny")
    save_model(path, llama_config(96, 64, 2), seed=0)
    return str(path)


def _kept(cache: PrefixCache, seq_id, tokens) -> None:
    cache.start(seq_id, tokens)
    cache.runner.extend([seq_id], [tokens], [1])
    cache.finish(seq_id, tokens)


def _last_logits(runner, seq_id, tokens) -> torch.Tensor:
    return runner.extend([seq_id], [tokens], [1])[0][-1]


def test_a_full_pool_evicts_a_row_other_than_the_match(tiny):
    """Two rows, both kept: the match is the least recently used one, the other goes."""
    runner, fresh = ModelRunner(tiny, max_batch_size=2, preallocate_kv=True), ModelRunner(tiny)
    cache = PrefixCache(runner)
    _kept(cache, "a", SYSTEM)
    _kept(cache, "b", [3] * 30)
    assert runner.spare_rows() == 0
    prompt = SYSTEM + [5, 6]
    assert cache.start("c", prompt) == len(SYSTEM) and runner.length("c") == len(SYSTEM)
    assert len(cache.entries) == 1 and runner.pool.rows == 2  # "b" went; the pool did not grow
    fresh.add("c")
    torch.testing.assert_close(_last_logits(runner, "c", prompt[len(SYSTEM):]), _last_logits(fresh, "c", prompt),
                               rtol=1e-5, atol=1e-5)


def test_the_only_kept_row_is_taken_over_when_it_is_the_match(tiny):
    """One row, kept and matching: the new sequence takes it over, cut to the shared prefix (no copy)."""
    runner, fresh = ModelRunner(tiny, max_batch_size=1, preallocate_kv=True), ModelRunner(tiny)
    cache = PrefixCache(runner)
    _kept(cache, "a", SYSTEM + [9, 9, 9])
    prompt = SYSTEM[:30] + [5, 6]  # shares 30 of the row's 43 positions: the rest must never be read
    assert cache.start("c", prompt) == 30 and runner.length("c") == 30
    assert not cache.entries and runner.pool.rows == 1
    assert not runner._kept  # live again: its length counts when the pool narrows, its slot is in use
    fresh.add("c")
    torch.testing.assert_close(_last_logits(runner, "c", prompt[30:]), _last_logits(fresh, "c", prompt),
                               rtol=1e-5, atol=1e-5)
    cache.finish("c", prompt)
    assert cache.start("d", [4] * 20) == 0 and runner.pool.rows == 1  # no match: the kept row is evicted


def _run(engine, prompts, params=GREEDY) -> list[Sequence]:
    """One after another (each finishes before the next arrives)."""
    done = []
    for i, prompt in enumerate(prompts):
        s = Sequence(100 + len(done), f"r{i}", prompt, params)
        engine.add(s)
        while engine.has_work():
            engine.step()
        done.append(s)
    return done


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_cuda_sized_pool_hits_repeated_prompts_and_outputs_match_caching_off(tiny, tmp_path, monkeypatch, mode):
    """The pool CUDA allocates (max_batch_size rows, preallocated): repeated and extended prompts hit."""
    monkeypatch.setattr(build, "ModelRunner", functools.partial(ModelRunner, preallocate_kv=True))
    draft = {}
    if mode == "sd":
        pair = close_pair(tmp_path)
        draft = {"draft": pair["close"], "draft_executor": "thread", "k": 3}
    model = pair["target"] if mode == "sd" else tiny
    outputs = {}
    for caching in (True, False):
        engine, _ = build.build_local_engine(Config(model=model, mode=mode, max_batch_size=1,
                                                    enable_prefix_caching=caching, **draft))
        try:
            assert engine.target.runner.pool.rows == 1
            seqs = _run(engine, [SYSTEM + [5]] * 3)
            turn = SYSTEM + [5] + seqs[0].output_token_ids[:3] + [95]  # a chat's next turn (95: no output's)
            seqs += _run(engine, [turn, SYSTEM[:20] + [1] * 5, [2] * 30])
        finally:
            engine.close()
        outputs[caching] = [s.output_token_ids for s in seqs]
        if caching:
            assert [s.metrics.num_cached_tokens for s in seqs] == [0, 40, 40, 44, 20, 0]
    assert outputs[True] == outputs[False]


def test_queries_count_only_prompts_that_looked_the_cache_up(tiny):
    """vLLM's record_prefix_cache_stats: not with caching off, nor for prompt_logprobs; prompt throughput
    still counts every prompt."""
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    for caching, queries in ((False, 0), (True, 2 * len(SYSTEM) + 10)):
        engine, _ = build.build_local_engine(Config(model=tiny, mode="ar", enable_prefix_caching=caching))
        try:
            _run(engine, [SYSTEM, [4] * 10])
            _run(engine, [SYSTEM], scored)
            _run(engine, [SYSTEM])
        finally:
            engine.close()
        m = engine.metrics
        assert m.prefix_cache_queries == queries and m.prompt_tokens == 3 * len(SYSTEM) + 10
        assert m.prefix_cache_hits == (len(SYSTEM) - 1 if caching else 0)
        line = StatsLogger(1.0).line(m, EngineLoad(), 1.0)
        assert f"Avg prompt throughput: {m.prompt_tokens:.1f} tokens/s" in line


def test_reusable_len_is_the_one_rule():
    assert reusable_len(40, 41) == 40 and reusable_len(40, 40) == 39
    assert reusable_len(MIN_REUSE, MIN_REUSE) == 0 and reusable_len(MIN_REUSE, MIN_REUSE + 1) == MIN_REUSE
    assert reusable_len(MIN_REUSE - 1, 100) == 0


@pytest.mark.parametrize("length, waits", [(MIN_REUSE, False), (MIN_REUSE + 1, True)])
def test_twins_wait_only_for_a_prefix_they_can_take(tiny, length, waits):
    """Two identical prompts admitted together: the second waits a step for the first's prefill only if it
    can then copy (all but its last token, at least MIN_REUSE); else both prefill in the first step."""
    engine, _ = build.build_local_engine(Config(model=tiny, mode="ar"))
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        a, b = (Sequence(i, f"t{i}", SYSTEM[:length], params) for i in range(2))
        engine.add(a)
        engine.add(b)
        engine.step()
        assert (len(b.output_token_ids) == 0) == waits
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
    assert b.metrics.num_cached_tokens == (length - 1 if waits else 0)
    assert a.output_token_ids == b.output_token_ids
