"""Log-probabilities: the target's raw log_softmax at each generated token, whichever mode and
speculation decided it, checked against transformers' own forward over the same tokens."""
from __future__ import annotations

import asyncio

import pytest

from engine_helpers import DEVICE, PROMPTS, check_logprobs, close_pair
import saguaro_dist.engine.target as target_module
from saguaro_dist import LLM, SamplingParams

TOP = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("logprobs_pair"))


def generate(pair, mode: str, params: SamplingParams, prompts=PROMPTS, **engine):
    draft = None if mode in ("ar", "ngram") else pair["close"]
    executor = "auto" if mode == "ngram" else "thread"
    with LLM(device=DEVICE, model=pair["target"], draft=draft, mode=mode, k=3, fan_out=8,
             draft_executor=executor, max_batch_size=4, **engine) as llm:
        return llm.generate(prompt_token_ids=prompts, sampling_params=params)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "ngram"])
def test_greedy_logprobs_are_the_targets_whatever_proposed_the_tokens(pair, mode):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP)
    for prompt, out in zip(PROMPTS, generate(pair, mode, params)):
        check_logprobs(pair["model"], prompt, out, TOP)


def test_sampled_logprobs_are_raw_not_tempered(pair):
    """At T = 0.7 the figures are still log_softmax of the logits (vLLM's default), and logprobs=0
    gives only the chosen token's."""
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, ignore_eos=True, seed=3, logprobs=0)
    outs = generate(pair, "ssd", params)
    for prompt, out in zip(PROMPTS, outs):
        check_logprobs(pair["model"], prompt, out, 0)
        assert all(len(entry) == 1 for entry in out.logprobs)


@pytest.mark.parametrize("mode, rows, budget", [("ar", 512, 2048), ("ssd", 512, 2048), ("ssd", 2, 2048), ("ssd", 2, 5)])
def test_prompt_logprobs_score_every_prompt_token_after_the_first(pair, mode, rows, budget, monkeypatch):
    """vLLM's prompt_logprobs (what lm-eval's loglikelihood needs): row i of the prefill scored token i + 1.
    rows = 2: the prompt is scored in pieces of two logit rows (bounded memory for long prompts); pieces
    meet at the right tokens, and prompts without prompt_logprobs in the batch prefill as usual. budget = 5
    (max_num_batched_tokens): the 11-token prompt prefills over three engine steps."""
    monkeypatch.setattr(target_module, "PROMPT_LOGPROBS_ROWS", rows)
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2 if i % 3 else None) for i in range(len(PROMPTS))]
    outs = generate(pair, mode, params, max_num_batched_tokens=budget)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        if not i % 3:
            assert out.prompt_logprobs is None
            continue
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        scored = type(out)(**{**vars(out), "token_ids": prompt[1:], "logprobs": out.prompt_logprobs[1:]})
        check_logprobs(pair["model"], prompt[:1], scored, 2)
        assert out.logprobs is None


def test_no_logprobs_unless_asked(pair):
    out = generate(pair, "ssd", SamplingParams(temperature=0, max_tokens=4), prompts=PROMPTS[:1])[0]
    assert out.logprobs is None


def test_streamed_deltas_carry_the_logprobs_of_their_tokens(pair):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)

    async def collect(llm):
        return [d async for d in llm.stream(prompt_token_ids=PROMPTS[0], sampling_params=params)]
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3,
             draft_executor="thread") as llm:
        deltas = asyncio.run(collect(llm))
        final = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params)[0]
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)  # (n = 1: the engine's plain entries)
    streamed = [e for d in deltas for e in d.logprobs]
    assert streamed == [{t: lp.logprob for t, lp in entry.items()} for entry in final.logprobs]


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_out_of_range_is_refused(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: bad})
