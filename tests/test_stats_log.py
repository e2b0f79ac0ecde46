"""The periodic engine stats line (vLLM's): figures of the last interval, from the engine's counters."""
from __future__ import annotations

import logging
from collections import Counter

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.engine.metrics import EngineLoad, EngineMetrics
from saguaro_dist.engine.stats_log import StatsLogger


def test_the_line_reports_the_interval_not_the_totals():
    stats = StatsLogger(10.0)
    stats._last = EngineMetrics(prompt_tokens=100, prefix_cache_queries=100, generated_tokens=50, rounds=10,
                                fallbacks=Counter(fast=1))
    now = EngineMetrics(prompt_tokens=300, prefix_cache_queries=300, prefix_cache_hits=150, generated_tokens=250, drafted_tokens=160,
                        accepted_tokens=120, rounds=50, cache_hits=30, cache_misses=10, fallbacks=Counter(fast=3, neural=1))
    load = EngineLoad(num_running=3, num_waiting=2, kv_cache_tokens=123, kv_cache_capacity_tokens=1000)
    line = stats.line(now, load, seconds=2.0)
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 100.0 tokens/s, Running: 3 reqs, "
                    "Waiting: 2 reqs, KV cache usage: 12.3%, Prefix cache hit rate: 75.0%, Speculation: acceptance 75.0%, tokens per step 5.00, "
                    "tree hit rate 75.0%, fallbacks {'fast': 2, 'neural': 1}")
    all_up = EngineLoad(3, 2, 123, 1000, draft_workers_live=2, draft_workers=2)
    assert stats.line(now, all_up, seconds=2.0) == line
    one_down = EngineLoad(3, 2, 123, 1000, draft_workers_live=1, draft_workers=2)
    assert stats.line(now, one_down, seconds=2.0) == line + ", draft workers live: 1 of 2"


def test_the_engine_logs_while_it_works_and_not_when_told_not_to(tiny_llama_pair, caplog):
    target, draft = tiny_llama_pair
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    caplog.set_level(logging.INFO, logger="saguaro_dist.engine.stats")
    for interval, want in ((1e-6, True), (0.0, False)):
        caplog.clear()
        with LLM(model=target, draft=draft, mode="ssd", k=2, fan_out=6, draft_executor="thread",
                 log_stats_interval_s=interval) as llm:
            llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=params)
        lines = [r.getMessage() for r in caplog.records if r.name == "saguaro_dist.engine.stats"]
        assert bool(lines) is want
        assert all("Avg generation throughput" in line and "acceptance" in line for line in lines)
