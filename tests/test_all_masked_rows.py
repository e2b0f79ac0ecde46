"""A request whose constraints (allowed_token_ids, bad_words, min_tokens) leave no token at an output position it
reaches fails alone there, with a ValueError naming why, in AR, SD and SSD alike; the requests beside it keep
their exact outputs. It used to draw from a row of -inf logits: token 0 greedy, the last id sampled. In SD and
SSD an empty row after a drafted token that verification rejects decides nothing (AR never reaches it).
Real engines on the tiny pair of test_engine_sampling (vocabulary a..e = 0..4, <eos> = 5)."""
from __future__ import annotations

import asyncio

import openai
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.sampling_params import StructuredOutputsParams
from saguaro_dist.serve.api import ServerOptions, create_app
from test_engine_sampling import sampling_pair

PROMPT = [0, 0, 1]  # the target goes "c a a a ..." over {a, c}; the draft, alone, "c a c a ..."
EOS = 5
# At output position 1: only "c" allowed, "b" barred, and "c c" a bad word; or only <eos>, held back by min_tokens.
EMPTY_AT_1 = [dict(allowed_token_ids=[1, 2], bad_words=["b", "cc"]),
              dict(allowed_token_ids=[2, EOS], bad_words=["cc"], min_tokens=3)]
OTHERS = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft, _ = sampling_pair(tmp_path_factory.mktemp("all_masked"))
    return target, draft


def engine(pair, mode: str, k: int = 2, draft: str | None = None) -> LLM:
    target, own_draft = pair
    if mode == "ar":
        return LLM(model=target, mode="ar")
    return LLM(model=target, draft=draft or own_draft, mode=mode, k=k, draft_executor="thread")


def run_together(llm: LLM, params: list[SamplingParams]) -> list:
    """Each request's streamed tokens, or the exception it ended with, all in one batch."""
    async def tokens(p):
        return [t async for delta in llm.stream(prompt_token_ids=PROMPT, sampling_params=p) for t in delta.token_ids]

    async def together():
        return await asyncio.gather(*(tokens(p) for p in params), return_exceptions=True)
    return asyncio.run(together())


def greedy_alone(pair, p: SamplingParams) -> list[int]:
    with engine(pair, "ar") as llm:
        return llm.generate(prompt_token_ids=[PROMPT], sampling_params=p, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_a_request_no_token_can_follow_fails_alone_and_the_others_are_exact(pair, mode):
    """Old: no error; the empty row gave token 0 (greedy) or 5 (sampled), a token its constraints barred."""
    want_greedy = greedy_alone(pair, OTHERS[0])
    with engine(pair, mode) as llm:
        want_seeded = llm.generate(prompt_token_ids=[PROMPT], sampling_params=OTHERS[1],
                                   use_tqdm=False)[0].outputs[0].token_ids
        for constraints in EMPTY_AT_1:
            for temperature in (0.0, 1.0):
                bad = SamplingParams(temperature=temperature, seed=1, max_tokens=4, ignore_eos=True, **constraints)
                failed, greedy, seeded = run_together(llm, [bad, *OTHERS])
                assert isinstance(failed, ValueError), (constraints, temperature, failed)
                assert "no token is allowed at output position 1" in str(failed)
                assert "allowed_token_ids" in str(failed) and "bad_words" in str(failed)
                assert greedy == want_greedy, (constraints, temperature)
                # (SSD: a seeded request's draws depend on its batch-mates' rounds, failing or not; its law does not)
                assert seeded == want_seeded if mode != "ssd" else len(seeded) == 6, (constraints, temperature)
        with pytest.raises(ValueError, match="no token is allowed at output position 1"):  # generate() says so too
            llm.generate(prompt_token_ids=[PROMPT], sampling_params=bad, use_tqdm=False)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_the_failure_is_where_ar_reaches_it_in_the_middle_of_a_round(pair, mode):
    """Output "c a a a", then "a a a" bars both "a" and "c": position 4 is empty. The target drafting for
    itself (K = 3) accepts "a a a" and reaches that row inside its round: the same error, at the same position
    (the round's tokens before it go with no delta: a failed request's last update is its error)."""
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=[0, 2],
                       bad_words=["aaaa", "aaac"])
    results = []
    for m in ("ar", mode):
        with engine(pair, m, k=3, draft=pair[0]) as llm:
            got = []

            async def consume():
                async for delta in llm.stream(prompt_token_ids=PROMPT, sampling_params=p):
                    got.extend(delta.token_ids)
            with pytest.raises(ValueError, match="no token is allowed at output position 4") as err:
                asyncio.run(consume())
            results.append((got, str(err.value)))
    assert results[0][0] == [2, 0, 0, 0]
    assert results[1][1] == results[0][1] and results[0][0][:len(results[1][0])] == results[1][0]


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_an_empty_row_after_a_rejected_draft_token_fails_nothing(pair, mode):
    """After "a c" nothing is allowed ("aca", "acc" barred): AR ("c a a a a a") never writes "a c", but the
    draft proposes "a c" after "c" and the target rejects its "c", so verification scored that empty row."""
    allowed = dict(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[0, 2])
    with LLM(model=pair[1], mode="ar") as draft_alone:  # what the draft proposes after "c"
        assert draft_alone.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(**allowed),
                                    use_tqdm=False)[0].outputs[0].token_ids[:3] == [2, 0, 2]
    p = SamplingParams(**allowed, bad_words=["aca", "acc"])
    want = greedy_alone(pair, p)
    assert want == [2, 0, 0, 0, 0, 0]
    with engine(pair, mode) as llm:
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=p, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
    assert out.metrics.accepted_tokens < out.metrics.drafted_tokens  # (a draft token was rejected)


def test_over_http_it_is_that_requests_400(pair):
    """Mirrors a grammar llguidance cannot follow: a 400 (streamed: an error event); a request after it is served."""
    with engine(pair, "sd") as llm:
        want = llm.generate(prompt_token_ids=[PROMPT], sampling_params=OTHERS[0], use_tqdm=False)[0].outputs[0].text
        with serve_on_loopback(create_app(llm, ServerOptions("tiny"))) as base_url:
            client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
            empty = {"ignore_eos": True, **EMPTY_AT_1[0]}
            with pytest.raises(openai.BadRequestError, match="no token is allowed at output position 1"):
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, extra_body=empty)
            with pytest.raises(openai.APIError, match="no token is allowed at output position 1"):
                for _ in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                                   stream=True, extra_body=empty):
                    pass
            served = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert served.choices[0].text == want and served.choices[0].finish_reason == "length"


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_a_grammar_that_bad_words_leave_no_token_is_named_in_the_error(pair, mode):
    """The regex "cb" allows only "b" after "c", which the bad word "cb" bars: position 1 is empty, and the error
    names the grammar as one of the constraints (old: only allowed_token_ids, bad_words and min_tokens)."""
    grammar = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="cb"))
    with engine(pair, mode) as llm:
        assert llm.generate(prompt_token_ids=[PROMPT], sampling_params=grammar,
                            use_tqdm=False)[0].outputs[0].token_ids == [2, 1, EOS]
        barred = SamplingParams(temperature=0, max_tokens=4, bad_words=["cb"],
                                structured_outputs=StructuredOutputsParams(regex="cb"))
        with pytest.raises(ValueError, match="no token is allowed at output position 1") as err:
            llm.generate(prompt_token_ids=[PROMPT], sampling_params=barred, use_tqdm=False)
    assert "structured outputs grammar" in str(err.value)
