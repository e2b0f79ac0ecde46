"""vLLM's cache_salt: a request reuses prefix-cache KV (model/prefix_cache.py) only of requests with the same
salt, on the target and on the draft, offline, over HTTP and over the draft's wire; outputs never change."""
from __future__ import annotations

import httpx
import openai
import pytest

from engine_helpers import close_pair, hf_greedy, llama_config, save_model
from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.demo import demo_pair
from saguaro_dist.distributed import codec
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.messages import JitDraftRequest, PrefillRequest, Release
from saguaro_dist.engine.sequence import Sequence, cache_namespace
from saguaro_dist.model import ModelRunner
from saguaro_dist.model.prefix_cache import PrefixCache
from saguaro_dist.serve.api import ServerOptions, create_app

SYSTEM = [(7 * i + 3) % 90 + 2 for i in range(40)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("salt_pair"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("salt_tiny")
    save_model(path, llama_config(96, 64, 2), seed=3)
    return str(path)


# ---- the cache's namespaces --------------------------------------------------------------------
def _kept(cache: PrefixCache, seq_id, tokens, namespace) -> None:
    cache.start(seq_id, tokens, namespace=namespace)
    cache.runner.extend([seq_id], [tokens], [1])
    cache.finish(seq_id, tokens)


def test_kept_entries_are_shared_only_within_a_namespace(tiny):
    cache = PrefixCache(ModelRunner(tiny))
    a, b = cache_namespace("tenant-a"), cache_namespace("tenant-b")
    assert a != b and cache_namespace(None) is None and cache_namespace("tenant-a") == a
    _kept(cache, "x", SYSTEM, a)
    prompt = SYSTEM + [5, 6]
    assert cache.start("other", prompt, namespace=b) == 0
    assert cache.start("plain", prompt) == 0  # None is a namespace of its own
    assert cache.start("same", prompt, namespace=a) == len(SYSTEM)
    for seq_id in ("other", "plain", "same"):
        cache.finish(seq_id, [])  # nothing worth keeping: their rows go back to the pool
    _kept(cache, "y", SYSTEM, None)
    assert cache.start("plain2", prompt) == len(SYSTEM)  # unsalted requests still share among themselves


def test_live_sources_are_shared_only_within_a_namespace(tiny):
    cache = PrefixCache(ModelRunner(tiny))
    a, b = cache_namespace("tenant-a"), cache_namespace("tenant-b")
    cache.start("running", SYSTEM, namespace=a)
    cache.runner.extend(["running"], [SYSTEM], [1])
    live = {"running": SYSTEM}
    assert cache.start("other", SYSTEM + [9], live, namespace=b) == 0
    assert cache.start("plain", SYSTEM + [9], live) == 0
    assert cache.start("same", SYSTEM + [9], live, namespace=a) == len(SYSTEM)


# ---- offline --------------------------------------------------------------------------------------
def test_offline_reuse_needs_the_same_salt_and_outputs_stay_exact(pair):
    prompt = SYSTEM + [5, 6]
    want = hf_greedy(pair["model"], prompt, GREEDY.max_tokens)
    with LLM(model=pair["target"], draft=pair["close"], mode="ssd", k=3) as llm:
        def run(salts):  # (a CPU pool holds 4 rows: few enough requests that no kept entry is evicted)
            return [llm.generate([{"prompt_token_ids": prompt} if s is None else {"prompt_token_ids": prompt, "cache_salt": s}],
                                 GREEDY, use_tqdm=False)[0] for s in salts]
        outs = run(["a", "b", None, "a"])
        llm.reset_prefix_cache()
        outs += run([None, "b", None])
        hits = llm.metrics.prefix_cache_hits
    cached = [o.metrics.num_cached_tokens for o in outs]
    assert cached == [0, 0, 0, len(prompt) - 1, 0, 0, len(prompt) - 1]
    assert hits == sum(cached)
    assert all(o.token_ids == want for o in outs)


def test_offline_salts_are_checked(pair):
    with LLM(model=pair["target"], mode="ar") as llm:
        ok = llm.generate([{"prompt_token_ids": SYSTEM, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)[0]
        assert len(ok.token_ids) == GREEDY.max_tokens
        for bad in ("", 3, "a/b", "x" * 129):
            with pytest.raises(ValueError, match="cache_salt"):
                llm.generate([{"prompt_token_ids": SYSTEM, "cache_salt": bad}], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="prompt 0"):
            llm.generate([{"cache_salt": "a"}], GREEDY, use_tqdm=False)


def test_beam_search_steps_carry_the_prompts_salt(pair):
    from saguaro_dist.beam_search import BeamSearchParams
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    with LLM(model=pair["target"], mode="ar") as llm:
        plain = llm.beam_search([{"prompt_token_ids": SYSTEM}], params)[0]
        llm.reset_prefix_cache()
        salted = llm.beam_search([{"prompt_token_ids": SYSTEM, "cache_salt": "tenant-a"}], params)[0]
        # the search's steps kept their rows in tenant-a's namespace: another tenant finds none of them
        other = llm.generate([{"prompt_token_ids": SYSTEM + [5], "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)[0]
        same = llm.generate([{"prompt_token_ids": SYSTEM + [5], "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)[0]
    assert [b.tokens for b in salted.sequences] == [b.tokens for b in plain.sequences]
    assert other.metrics.num_cached_tokens == 0 and same.metrics.num_cached_tokens >= len(SYSTEM)


# ---- the draft and its wire ------------------------------------------------------------------------
def test_prefill_request_carries_the_salt_over_the_wire():
    sampling = Sequence(0, "r", SYSTEM, GREEDY).draft_sampling()
    salted = PrefillRequest(4, SYSTEM, sampling, cache_salt="tenant-a")
    assert codec.prefill_from_proto(codec.prefill_to_proto(salted)).cache_salt == "tenant-a"
    assert codec.prefill_from_proto(codec.prefill_to_proto(PrefillRequest(4, SYSTEM, sampling))).cache_salt is None
    msg = codec.prefill_to_proto(salted)
    msg.cache_salt = ""
    with pytest.raises(codec.CodecError, match="PrefillRequest.cache_salt"):
        codec.prefill_from_proto(msg)


def test_the_draft_reuses_its_rows_only_with_the_same_salt(pair):
    worker = build_draft_worker(Config(model=pair["target"], draft=pair["close"], mode="sd", k=3))
    sampling = Sequence(0, "r", SYSTEM, GREEDY).draft_sampling()
    worker.prefill([PrefillRequest(0, SYSTEM + [7], sampling, cache_salt="a")])
    worker.jit_draft([JitDraftRequest(0, 0, 0, 9)])
    worker.release([Release(0)])
    prefilled, extend = [], worker.runner.extend
    worker.runner.extend = lambda ids, tokens, n: prefilled.append(len(tokens[0])) or extend(ids, tokens, n)
    for seq_id, salt in ((1, "b"), (2, None), (3, "a")):
        worker.prefill([PrefillRequest(seq_id, SYSTEM + [8], sampling, cache_salt=salt)])
    assert prefilled == [len(SYSTEM) + 1, len(SYSTEM) + 1, 1]


# ---- HTTP -------------------------------------------------------------------------------------------
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n"


@pytest.mark.slow
def test_http_honours_cache_salt_on_completions_and_chat_and_checks_it():
    target, _ = demo_pair()
    chat = [{"role": "user", "content": PROMPT}]
    with LLM(model=target, mode="ar") as llm, serve_on_loopback(create_app(llm, ServerOptions("demo"))) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)

        def completion(salt):
            extra = {} if salt is None else {"cache_salt": salt}
            return client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, extra_body=extra)

        def chat_reply(salt):
            return client.chat.completions.create(model="demo", messages=chat, max_tokens=4, temperature=0,
                                                  extra_body={"cache_salt": salt})
        outs = [completion(s) for s in ("a", "b", None, "a")] + [chat_reply(s) for s in ("c", "d", "c")]
        bad = [httpx.post(f"{base_url}/{route}", json={"model": "demo", **body, "cache_salt": salt}, timeout=60)
               for route, body in (("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": chat}))
               for salt in ("", 5)]
    cached = [o.usage.prompt_tokens_details.cached_tokens for o in outs]
    assert cached[:3] == [0, 0, 0] and cached[3] == outs[3].usage.prompt_tokens - 1
    assert cached[4:6] == [0, 0] and cached[6] == outs[6].usage.prompt_tokens - 1
    assert len({o.choices[0].text for o in outs[:4]}) == 1 and len({o.choices[0].message.content for o in outs[4:]}) == 1
    for r in bad:
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
