"""Beam search edges a review found, over real parts (tiny real checkpoints, the served app on loopback HTTP):
max_tokens 0 with echo answers the prompt alone (vLLM's search of 0 steps), a model without a tokenizer serves
beams with empty text (as its search-free replies), any finite length_penalty ranks the beams as the formula does
(exact rationals here: no overflow, no division by zero), and LLM.beam_search / BeamSearchParams take vLLM's
use_tqdm, concurrency_limit and structured_outputs."""
from __future__ import annotations

import math
from fractions import Fraction

import httpx
import pytest
import torch

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.beam_search import BeamSearchParams, get_beam_search_score
from saguaro_dist.serve.api import ServerOptions, create_app
from test_beam_search import PROMPTS, STEPS, checkpoint, ranked_after, reference, with_tokenizer  # noqa: F401

PROMPT = " ".join(f"t{t}" for t in PROMPTS[0])


@pytest.fixture(scope="module")
def bare(checkpoint):  # noqa: F811
    """(url, llm): the tiny checkpoint as written (no tokenizer: token-id prompts only), served."""
    with LLM(model=str(checkpoint[0]), mode="ar") as llm, serve_on_loopback(create_app(llm, ServerOptions("m"))) as url:
        yield url, llm


@pytest.fixture(scope="module")
def worded(checkpoint, tmp_path_factory):  # noqa: F811
    """(url, llm, eos): a word-level tokenizer ("t<id>") whose EOS ranks second after PROMPTS[0], served."""
    path, model = checkpoint
    eos = ranked_after(model, PROMPTS[0], 1)
    copy = with_tokenizer(path, tmp_path_factory.mktemp("review_beams"), eos, [eos])
    with LLM(model=str(copy), mode="ar") as llm, serve_on_loopback(create_app(llm, ServerOptions("m"))) as url:
        yield url, llm, eos


def post(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/completions", json={"model": "m", "temperature": 0, **body}, timeout=120)


def exact_reference(model, prompt: list[int], width: int, steps: int, eos: int, length_penalty: int) -> list[list[int]]:
    """The brute force of test_beam_search.reference with the score as an exact rational (an integer
    length_penalty): cum / len ** length_penalty ranked without floats, whatever its size."""
    def score(beam):
        tokens, cum = beam
        return Fraction(cum) / Fraction(len(tokens) - (tokens[-1] == eos)) ** length_penalty
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
            top = logp.topk(2 * width)
            candidates += [(tokens + [t], cum + lp) for t, lp in zip(top.indices.tolist(), top.values.tolist())]
        done += [c for c in candidates if c[0][-1] == eos]
        beams = sorted([c for c in candidates if c[0][-1] != eos], key=score, reverse=True)[:width]
    return [tokens for tokens, _ in sorted(done + beams, key=score, reverse=True)[:width]]


def test_max_tokens_zero_with_echo_answers_the_prompt_alone(worded):
    """vLLM's search of 0 steps: the prompt's one beam, nothing generated (the plain reply's text and usage)."""
    url = worded[0]
    plain = post(url, prompt=PROMPT, max_tokens=0, echo=True).json()
    reply = post(url, prompt=PROMPT, max_tokens=0, echo=True, n=2, use_beam_search=True)
    assert reply.status_code == 200, reply.text
    assert [(c["text"], c["finish_reason"]) for c in reply.json()["choices"]] == [(PROMPT, "length")]
    assert plain["choices"][0]["text"] == PROMPT
    assert reply.json()["usage"] == {**plain["usage"], "completion_tokens": 0}


def test_a_model_without_a_tokenizer_serves_beams_with_empty_text(bare):
    url, llm = bare
    prompt = PROMPTS[1]
    reply = post(url, prompt=prompt, n=2, max_tokens=3, use_beam_search=True, return_token_ids=True)
    assert reply.status_code == 200, reply.text
    offline = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=3))[0]
    assert [(c["text"], c["token_ids"]) for c in reply.json()["choices"]] == [
        ("", s.tokens[len(prompt):]) for s in offline.sequences]
    assert post(url, prompt=prompt, max_tokens=3).json()["choices"][0]["text"] == ""  # the search-free reply's


@pytest.mark.parametrize("length_penalty", [400, -400])
def test_any_finite_length_penalty_ranks_as_the_exact_formula(worded, checkpoint, length_penalty):  # noqa: F811
    """Beams of different lengths (one ended by EOS at step one): 400 prefers the longest, -400 the shortest."""
    url, llm, eos = worded
    want = exact_reference(checkpoint[1], PROMPTS[0], 3, STEPS, eos, length_penalty)
    params = BeamSearchParams(beam_width=3, max_tokens=STEPS, length_penalty=length_penalty)
    offline = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)[0]
    assert [s.tokens for s in offline.sequences] == want
    reply = post(url, prompt=PROMPT, n=3, max_tokens=STEPS, length_penalty=length_penalty, use_beam_search=True,
                 return_token_ids=True, include_stop_str_in_output=True)
    assert reply.status_code == 200, reply.text
    assert [PROMPTS[0] + c["token_ids"] for c in reply.json()["choices"]] == want


def test_the_score_is_vllms_formula_where_it_is_a_float():
    tokens = [3, 4, 5, 6, 7, 8]
    for length_penalty in (0.0, 1.0, 1.3, -2.5, 200.0):  # vLLM's quotient, bit for bit
        assert get_beam_search_score(tokens, -3.5, None, length_penalty) == -3.5 / len(tokens) ** length_penalty
    assert get_beam_search_score(tokens, -3.5, None, 600) == -0.0  # its true value, past float's range
    assert get_beam_search_score(tokens, -3.5, None, -600) == -math.inf
    assert get_beam_search_score(tokens, -3.5, None, 390) == pytest.approx(-math.exp(math.log(3.5) - 390 * math.log(6)),
                                                                          rel=1e-9)


def test_beam_search_takes_vllms_use_tqdm_and_concurrency_limit(bare):
    llm = bare[1]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    beams = [[(s.tokens, s.cum_logprob) for s in out.sequences] for out in llm.beam_search(prompts, params)]
    for kwargs in (dict(use_tqdm=True), dict(concurrency_limit=1), dict(use_tqdm=True, concurrency_limit=5)):
        outs = llm.beam_search(prompts, params, **kwargs)
        assert [[(s.tokens, s.cum_logprob) for s in out.sequences] for out in outs] == beams, kwargs
    assert len(llm.beam_search(prompts, params, None, False, 1)) == 2  # vLLM's positional order
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="concurrency_limit"):
            llm.beam_search(prompts, params, concurrency_limit=bad)


def test_beam_search_params_take_structured_outputs_none_only():
    assert BeamSearchParams(beam_width=2, max_tokens=2, structured_outputs=None).structured_outputs is None
    with pytest.raises(ValueError, match="structured_outputs is not supported"):
        BeamSearchParams(beam_width=2, max_tokens=2, structured_outputs={"regex": "t1"})
