"""Where a request ends when a stop string meets speculation, max_tokens or min_tokens (vLLM's rules)."""
from __future__ import annotations

import pytest

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import PAIR_DIR

PROMPTS = ["def add(a, b):", "The quick brown fox"]
MAX = 24


@pytest.fixture(scope="module")
def engines():
    target, draft = str(PAIR_DIR / "target"), str(PAIR_DIR / "draft")
    with LLM(model=target, mode="ar") as ar, LLM(model=target, draft=draft, mode="ssd", k=4) as ssd:
        yield ar, ssd


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, **kw)


def run(llm: LLM, prompt: str, params: SamplingParams):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_a_speculative_round_ends_at_the_token_that_completes_a_stop_string(engines):
    """A round of SSD gains several tokens at once: the request ends at the one whose text completes the
    stop string, as AR ends there, so token_ids and logprobs are AR's (once, SSD kept the round's later tokens)."""
    ar, ssd = engines
    checked = 0
    for prompt in PROMPTS:
        text = run(ar, prompt, greedy()).text
        for at in range(2, len(text) - 2, 3):
            params = greedy(stop=[text[at:at + 2]], logprobs=0)
            counted = ssd.metrics.generated_tokens
            want, got = run(ar, prompt, params), run(ssd, prompt, params)
            assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
            assert ssd.metrics.generated_tokens - counted == len(got.token_ids)  # the dropped tokens are not counted
            assert len(got.logprobs) == len(got.token_ids)
            checked += 1
    assert checked > 10


@pytest.mark.parametrize("mode", [0, 1])
def test_a_stop_string_written_by_the_last_allowed_token_is_a_stop(engines, mode):
    """The round that reaches max_tokens also completes a stop string: the text ends at it, so the reason is
    "stop" and stop_reason the string (it was "length", naming the string)."""
    llm, tokenizer = engines[mode], engines[mode].tokenizer
    tokens = run(llm, PROMPTS[0], greedy()).token_ids
    for m in range(4, MAX, 3):
        stop = tokenizer.decode(tokens[:m])[-3:]
        out = run(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, stop=[stop]))
        assert (out.finish_reason, out.stop_reason) == ("stop", stop), m


@pytest.mark.parametrize("mode", [0, 1])
def test_min_tokens_holds_stop_strings_back_too(engines, mode):
    """vLLM's min_tokens: no stop string ends in the text of the first min_tokens tokens (it ended after one)."""
    llm, tokenizer = engines[mode], engines[mode].tokenizer
    tokens = run(llm, PROMPTS[0], greedy()).token_ids
    texts = [tokenizer.decode(tokens[:n]) for n in range(MAX + 1)]
    stop, least = "\n", 10
    assert stop in texts[least]  # else the test tests nothing
    ends = next(n for n in range(least + 1, MAX + 1) if stop in texts[n][len(texts[least]) - len(stop) + 1:])
    out = run(llm, PROMPTS[0], greedy(stop=[stop], min_tokens=least))
    assert (out.token_ids, out.finish_reason) == (tokens[:ends], "stop")
    assert out.text == texts[ends][:texts[ends].rindex(stop)]


def test_a_request_id_already_running_is_refused_and_the_running_one_goes_on(engines):
    """vLLM's "request id already running": the second stream took the first's listener, so the first
    caller waited forever (and the second read the first's deltas)."""
    import asyncio
    _, llm = engines
    want = run(llm, PROMPTS[0], greedy()).text

    async def text(prompt: str) -> str:
        return "".join([d.text async for d in llm.stream(prompt, greedy(), request_id="twice")])

    async def both():
        first = asyncio.ensure_future(text(PROMPTS[0]))
        await asyncio.sleep(0)  # the first is submitted first
        with pytest.raises(ValueError, match="already running"):
            await text(PROMPTS[1])
        return await asyncio.wait_for(first, 60)
    assert asyncio.run(both()) == want
    assert asyncio.run(text(PROMPTS[0])) == want  # once it finished, the id is free again
