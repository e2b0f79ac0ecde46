"""Automatic prefix caching (model/prefix_cache.py): a kept row's KV copied into a new sequence gives the
logits a prefill would, outputs stay greedy-identical to transformers in every mode, the cache only
uses spare pool rows, and the draft reuses its own rows too."""
from __future__ import annotations

from dataclasses import replace

import httpx
import openai
import pytest
import torch

from engine_helpers import assert_greedy_equal, close_pair, hf_greedy, llama_config, save_model
from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.demo import demo_pair
from saguaro_dist.engine.build import build_draft_worker, build_local_engine
from saguaro_dist.engine.messages import JitDraftRequest, PrefillRequest, Release
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.model import ModelRunner
from saguaro_dist.model.prefix_cache import MIN_REUSE, PrefixCache
from saguaro_dist.serve.api import ServerOptions, create_app

SYSTEM = [(7 * i + 3) % 90 + 2 for i in range(40)]  # a 40-token "system prompt" shared by the requests below
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("prefix_pair"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix_tiny")
    save_model(path, llama_config(96, 64, 2), seed=3)
    return str(path)


# ---- the cache over one runner ------------------------------------------------------------------
def _last_logits(runner, seq_id, tokens) -> torch.Tensor:
    return runner.extend([seq_id], [tokens], [1])[0][-1]


def test_copied_kv_gives_the_logits_a_prefill_computes(tiny):
    runner, fresh = ModelRunner(tiny), ModelRunner(tiny)
    cache = PrefixCache(runner)
    assert cache.start("a", SYSTEM) == 0  # nothing kept yet
    _last_logits(runner, "a", SYSTEM)
    cache.finish("a", SYSTEM)
    tail = [5, 6, 7]
    for seq_id, tokens, reused in (("b", SYSTEM + tail, len(SYSTEM)), ("c", SYSTEM, len(SYSTEM) - 1),
                                   ("d", SYSTEM[:30] + tail, 30)):
        assert cache.start(seq_id, tokens) == reused and runner.length(seq_id) == reused
        got = _last_logits(runner, seq_id, tokens[reused:])  # the last token always runs: its logits
        fresh.add(seq_id)
        torch.testing.assert_close(got, _last_logits(fresh, seq_id, tokens), rtol=1e-5, atol=1e-5)


def test_short_matches_are_not_copied_and_disabled_is_plain(tiny):
    runner = ModelRunner(tiny)
    cache = PrefixCache(runner)
    cache.start("a", SYSTEM)
    _last_logits(runner, "a", SYSTEM)
    cache.finish("a", SYSTEM)
    assert cache.start("b", SYSTEM[:MIN_REUSE - 1] + [1, 2]) == 0
    off = PrefixCache(ModelRunner(tiny), enabled=False)
    off.start("a", SYSTEM)
    off.runner.extend(["a"], [SYSTEM], [1])
    off.finish("a", SYSTEM)
    assert not off.entries and off.start("b", SYSTEM) == 0


def test_kept_rows_never_grow_the_pool(tiny):
    """With every row taken, a new sequence evicts the least recently used entry instead."""
    runner = ModelRunner(tiny)
    cache = PrefixCache(runner)
    rows = runner.pool.rows
    for i in range(3 * rows):
        tokens = [i + 2] * 20
        cache.start(i, tokens)
        _last_logits(runner, i, tokens)
        cache.finish(i, tokens)
        assert len(cache.entries) <= rows
    assert runner.pool.rows == rows
    recent = [int(stored[0]) - 2 for stored in cache.entries.values()]
    assert recent == list(range(3 * rows - len(recent), 3 * rows))  # the most recent ones are kept
    cache.clear()
    assert runner.spare_rows() == rows


def test_runner_checks_renames_and_copies(tiny):
    runner = ModelRunner(tiny)
    runner.add("a")
    runner.add("b")
    runner.extend(["a"], [[1, 2, 3]], [1])
    with pytest.raises(ValueError, match="already exists"):
        runner.rename("a", "b")
    with pytest.raises(ValueError, match="holds 3 positions"):
        runner.copy_prefix("a", "b", 4)
    runner.copy_prefix("a", "b", 2)
    with pytest.raises(ValueError, match="must be 0"):
        runner.copy_prefix("a", "b", 1)
    runner.rename("a", "c")
    assert runner.length("c") == 3
    with pytest.raises(ValueError, match="unknown sequence"):
        runner.length("a")


# ---- through the engine -------------------------------------------------------------------------
@pytest.mark.parametrize("mode, extra", [("ar", {}), ("sd", {}), ("ssd", {"draft_executor": "thread"}),
                                         ("ssd", {"draft_executor": "process"}),
                                         ("ssd", {"draft_executor": "thread", "max_num_batched_tokens": 8})])
def test_outputs_stay_greedy_identical_and_the_prompts_reuse_kv(pair, mode, extra):
    """A repeated prompt, a chat's next turn (the last prompt and its reply, then more) and another
    question after the same system prompt: each equals transformers' greedy decoding, and each reuses
    what the cache holds (the target's stored KV: the prompt and the reply but its last token, which
    only a round that ran past max_tokens had put in)."""
    llm = LLM(model=pair["target"], draft=None if mode == "ar" else pair["close"], mode=mode, k=3, **extra)
    first = llm.generate(prompt_token_ids=[SYSTEM + [11, 12]], sampling_params=GREEDY)[0]
    turn = SYSTEM + [11, 12] + first.token_ids + [13, 14]
    held = len(SYSTEM) + 2 + len(first.token_ids)
    requests = [(SYSTEM + [11, 12], {len(SYSTEM) + 1}), (turn, {held - 1, held}), (SYSTEM + [20, 21, 22], {len(SYSTEM)})]
    hits = 0
    for prompt, reused in requests:
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
        assert_greedy_equal(out.token_ids, hf_greedy(pair["model"], prompt, GREEDY.max_tokens), prompt, pair["model"])
        assert out.metrics.num_cached_tokens in reused
        hits += out.metrics.num_cached_tokens
    assert first.metrics.num_cached_tokens == 0 and llm.metrics.prefix_cache_hits == hits
    assert llm.metrics.prefix_cache_queries == len(SYSTEM) + 2 + sum(len(p) for p, _ in requests)
    llm.shutdown()


def test_prompt_logprobs_score_every_prompt_token(pair):
    llm = LLM(model=pair["target"], mode="ar")
    llm.generate(prompt_token_ids=[SYSTEM], sampling_params=GREEDY)
    scored = llm.generate(prompt_token_ids=[SYSTEM], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert scored.metrics.num_cached_tokens == 0 and len(scored.prompt_logprobs) == len(SYSTEM)
    llm.shutdown()


def test_off_switch_and_a_failed_step_clear_it(pair):
    engine, _ = build_local_engine(Config(model=pair["target"], mode="ar", enable_prefix_caching=False))
    engine.add(Sequence(0, "r0", SYSTEM, GREEDY))
    while engine.has_work():
        engine.step()
    assert not engine.target.prefixes.entries
    engine, _ = build_local_engine(Config(model=pair["target"], mode="ar"))
    engine.add(Sequence(0, "r0", SYSTEM, GREEDY))
    while engine.has_work():
        engine.step()
    assert len(engine.target.prefixes.entries) == 1
    engine.reset()
    assert not engine.target.prefixes.entries


def test_a_prompt_aborted_half_prefilled_leaves_its_prefix(pair):
    engine, _ = build_local_engine(Config(model=pair["target"], mode="ar", max_num_batched_tokens=24))
    engine.add(Sequence(0, "r0", SYSTEM + [5], GREEDY))
    engine.step()  # 24 of its 41 tokens
    engine.abort("r0")
    seq = Sequence(1, "r1", SYSTEM + [6], GREEDY)
    engine.add(seq)
    engine.step()
    assert seq.metrics.num_cached_tokens == 24


def test_the_draft_reuses_its_rows_and_proposes_the_same(pair):
    config = Config(model=pair["target"], draft=pair["close"], mode="sd", k=3)
    cached, plain = build_draft_worker(config), build_draft_worker(replace(config, enable_prefix_caching=False))
    sampling = Sequence(0, "r", SYSTEM, GREEDY).draft_sampling()
    proposals, prefilled = [], []
    for worker in (cached, plain):
        worker.prefill([PrefillRequest(0, SYSTEM + [7], sampling)])
        worker.jit_draft([JitDraftRequest(0, 0, 0, 9)])
        worker.release([Release(0)])
        extend = worker.runner.extend
        worker.runner.extend = lambda ids, tokens, n, extend=extend: prefilled.append(len(tokens[0])) or extend(ids, tokens, n)
        worker.prefill([PrefillRequest(1, SYSTEM + [8], sampling)])
        worker.runner.extend = extend
        proposals.append(worker.jit_draft([JitDraftRequest(1, 0, 0, 9)])[0].tokens.tolist())
    assert prefilled == [1, len(SYSTEM) + 1]  # the second prompt's first 40 tokens came from the kept row
    assert len(cached.prefixes.entries) == 1 and not plain.prefixes.entries
    assert cached.runner.length(1) == plain.runner.length(1) and proposals[0] == proposals[1]


def test_usage_reports_cached_prompt_tokens_over_http():
    """OpenAI's usage.prompt_tokens_details.cached_tokens, through the serving app under uvicorn."""
    target, _ = demo_pair()
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n"
    with LLM(model=target, mode="ar") as llm, serve_on_loopback(create_app(llm, ServerOptions("demo"))) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        first, again = (client.completions.create(model="demo", prompt=prompt, max_tokens=4, temperature=0) for _ in range(2))
        streamed = list(client.completions.create(model="demo", prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                                  stream_options={"include_usage": True}))
        assert httpx.post(base_url.removesuffix("/v1") + "/reset_prefix_cache", timeout=30).status_code == 200
        cold = client.completions.create(model="demo", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert first.choices[0].text == again.choices[0].text == cold.choices[0].text
    assert cold.usage.prompt_tokens_details.cached_tokens == 0  # vLLM's /reset_prefix_cache


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_running_sequences_lend_their_prefix(pair, mode):
    """A request arriving while another with the same system prompt is still generating copies the
    prompt from the running one (the target's row and, for ssd, the draft's), and stays exact."""
    config = Config(model=pair["target"], draft=None if mode == "ar" else pair["close"], mode=mode, k=3,
                    draft_executor="thread")  # the draft's runner in reach
    engine, _ = build_local_engine(config)
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first, second = Sequence(0, "r0", SYSTEM + [11], long), Sequence(1, "r1", SYSTEM + [12, 13], long)
    engine.add(first)
    engine.step()
    engine.step()
    assert first.output_token_ids and not first.finished
    engine.add(second)
    if mode == "ssd":
        draft = engine.loop.draft.worker
        extend = draft.runner.extend
        prefilled = []
        draft.runner.extend = lambda ids, tokens, n: prefilled.append(dict(zip(ids, map(len, tokens)))) or extend(ids, tokens, n)
    engine.step()
    assert second.metrics.num_cached_tokens == len(SYSTEM)
    if mode == "ssd":
        draft.runner.extend = extend
        # the draft copied the shared 40 tokens from its own running row too (its first forward of r1 runs 2)
        assert next(lens[1] for lens in prefilled if 1 in lens) == 2
    while engine.has_work():
        engine.step()
    for seq in (first, second):
        want = hf_greedy(pair["model"], seq.prompt_token_ids, long.max_tokens)
        assert_greedy_equal(seq.output_token_ids, want, seq.prompt_token_ids, pair["model"])


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_prompts_arriving_together_compute_a_shared_prefix_once(pair, mode):
    """Prompts that share a system prompt, and n copies of one prompt, admitted in one step: the first
    computes the prefix, the others wait a step and copy it; outputs stay exact."""
    llm = LLM(model=pair["target"], draft=None if mode == "ar" else pair["close"], mode=mode, k=3)
    prompts = [SYSTEM + [11], SYSTEM + [12, 13], SYSTEM[:30] + [14], SYSTEM + [11], SYSTEM[:10] + [15]]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.metrics.num_cached_tokens for o in outs] == [0, len(SYSTEM), 30, len(SYSTEM), 0]
    for prompt, out in zip(prompts, outs):
        assert_greedy_equal(out.token_ids, hf_greedy(pair["model"], prompt, GREEDY.max_tokens), prompt, pair["model"])
    llm.shutdown()


@pytest.mark.parametrize("executor", ["thread", "process", "split"])
def test_reset_prefix_cache_forgets_every_kept_prefix(pair, executor, caplog):
    """vLLM's LLM.reset_prefix_cache(): the target's and the draft's kept rows go, the next identical prompt
    computes its prefix afresh, and the output stays greedy-identical."""
    caplog.set_level("WARNING")
    with LLM(model=pair["target"], draft=pair["close"], mode="ssd", k=3, draft_executor=executor) as llm:
        prompt = SYSTEM + [11, 12]
        first = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
        assert llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].metrics.num_cached_tokens > 0
        assert llm.reset_prefix_cache() is True
        engine = llm._thread.engine
        assert not engine.target.prefixes.entries
        thread = {"thread": engine.loop.draft, "split": getattr(engine.loop.draft, "jit", None)}.get(executor)
        if thread is not None:
            thread.submit(lambda _: None, None).result()  # the draft thread is past the reset
            assert not thread.worker.prefixes.entries
        again = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
    assert again.metrics.num_cached_tokens == 0 and again.token_ids == first.token_ids
    assert not [r for r in caplog.records if "reset_prefix_cache" in r.getMessage()]  # the child knew the message
