"""Prefix caching under pressure, against what vLLM users expect: usage's cached_tokens is exactly what was
reused (the positions the new row holds before its prefill, which then computes only the rest); kept rows
evicted and their pool rows taken by other requests are never read again (stale KV would change tokens);
a reset_prefix_cache while requests run, and a prompt identical to a kept one (all but its last token
copied), stay greedy-identical to transformers. Real engines over tiny transformers checkpoints."""
from __future__ import annotations

import random

import pytest

from engine_helpers import close_pair, hf_greedy
from saguaro_dist import SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_local_engine
from saguaro_dist.engine.sequence import Sequence

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("prefix_review_pair"))


def watch_starts(engine) -> list[tuple[int, int, int]]:
    """(seq_id, KV positions its row holds, cached tokens reported) right after each target start."""
    seen, start = [], engine.target.start

    def recorded(s, live):
        start(s, live)
        seen.append((s.seq_id, engine.target.runner.length(s.seq_id), s.metrics.num_cached_tokens))
    engine.target.start = recorded
    return seen


def workload(rng: random.Random) -> list[list[int]]:
    """Three system prompts, turns that extend an earlier prompt, exact repeats (full hits) and strangers."""
    systems = [[rng.randrange(1, 95) for _ in range(24)] for _ in range(3)]
    prompts: list[list[int]] = []
    for i in range(16):
        kind = i % 4
        if kind == 3 and prompts:
            prompts.append(list(prompts[-2]))  # an exact repeat of a finished (or running) prompt
        elif kind == 2 and prompts:
            prompts.append(prompts[-1] + [rng.randrange(1, 95) for _ in range(3)])  # the next turn
        else:
            prompts.append(systems[i % 3] + [rng.randrange(1, 95) for _ in range(rng.randrange(0, 4))])
    return prompts


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_cached_tokens_are_what_was_reused_and_evicted_or_reset_rows_never_leak(pair, mode):
    """Two slots, rows for four: kept prefixes are evicted and their rows reused by new requests; prompts
    arrive while others run (live sources, chunked prefills of 16 tokens); the cache is reset mid-run."""
    draft = {"draft": pair["close"], "draft_executor": "thread"} if mode == "sd" else {}
    engine, _ = build_local_engine(Config(model=pair["target"], mode=mode, k=3, max_batch_size=2,
                                          max_num_batched_tokens=16, **draft))
    try:
        starts, rng = watch_starts(engine), random.Random(0)
        seqs = []
        for i, prompt in enumerate(workload(rng)):
            seqs.append(Sequence(i, f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(3, 12),
                                                                     ignore_eos=True)))
            engine.add(seqs[-1])
            for _ in range(rng.randrange(0, 4)):
                if engine.has_work():
                    engine.step()
            if i == 9:
                engine.reset_prefix_cache()  # requests still running and waiting
        while engine.has_work():
            engine.step()
        for s in seqs:
            assert s.output_token_ids == hf_greedy(pair["model"], s.prompt_token_ids, s.params.max_tokens), s.request_id
        assert all(held == cached for _, held, cached in starts)  # reported = held before the prefill
        cached = [s.metrics.num_cached_tokens for s in seqs]
        assert all(c < len(s.prompt_token_ids) for c, s in zip(cached, seqs))  # the last token is always run
        assert sum(c > 0 for c in cached) >= 6 and engine.metrics.prefix_cache_hits == sum(cached)
        assert engine.target.runner.pool.rows == 4  # kept rows were evicted, never grew the pool
    finally:
        engine.close()


def test_a_prompt_identical_to_a_kept_one_copies_all_but_its_last_token(pair):
    """A full hit: the last prompt token still runs (its logits give the first token), and only it."""
    engine, _ = build_local_engine(Config(model=pair["target"], mode="ar"))
    try:
        prompt = [(5 * i + 2) % 90 + 1 for i in range(30)]
        computed, extend = [], engine.target.runner.extend
        engine.target.runner.extend = lambda ids, toks, n: computed.append(len(toks[0])) or extend(ids, toks, n)
        outs = []
        for i in range(2):
            s = Sequence(i, f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=1))
            engine.add(s)
            while engine.has_work():
                engine.step()
            outs.append(s)
        assert computed == [30, 1]
        assert [s.metrics.num_cached_tokens for s in outs] == [0, 29]
        assert outs[0].output_token_ids == outs[1].output_token_ids == hf_greedy(pair["model"], prompt, 1)
    finally:
        engine.close()
