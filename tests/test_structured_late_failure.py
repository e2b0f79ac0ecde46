"""A grammar llguidance cannot follow past some token (a limit of its lexer) fails a request only where the
request reaches that token: a finish earlier in the round (max_tokens, a stop token) ends it normally, as
in AR; a failure on drafted tokens spoils neither the request's matcher nor another request's. Real engines
on the demo pair (its tokenizer); the target drafts for itself, so greedy rounds accept every token."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import demo_pair
from saguaro_dist.engine.structured import GrammarCompiler, GrammarError
from saguaro_dist.sampling_params import StructuredOutputsParams as SO

# "pqrs", then EOS or "a"s; llguidance's lexer gives up at the second "a" ("too many expressions").
LATE_FAILURE = SO(regex="pqrs(a{3000000})?")
K = 5  # one round after the prefill's "p" drafts q r s a a: the second "a" is where llguidance fails


@pytest.fixture(scope="module")
def demo():
    target, _ = demo_pair()
    return target, AutoTokenizer.from_pretrained(target)


def ids(tokenizer, chars: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(c) for c in chars]


def test_a_failure_on_drafted_tokens_fails_only_the_commit_of_a_token_past_it(demo):
    """Old: row_masks raised for the whole round (the request failed at its first token), and the matcher
    the failure spoiled could no longer take even the tokens before it."""
    _, tokenizer = demo
    compiler = GrammarCompiler(tokenizer, 2048, {tokenizer.eos_token_id})
    p, q, r, s, a = ids(tokenizer, "pqrsa")
    state = compiler.state(SamplingParams(structured_outputs=LATE_FAILURE))
    state.row_masks([], 1)
    state.commit(p)
    masks = state.row_masks([q, r, s, a, a], K + 1)
    assert masks.shape[0] == K + 1 and all(bool(masks[row, t]) for row, t in enumerate([q, r, s, a, a]))
    assert masks[:, tokenizer.eos_token_id].tolist() == [False, False, False, True, False, False]
    for t in (q, r, s, a):  # decided by rows whose masks llguidance computed
        state.commit(t)
    with pytest.raises(GrammarError, match="cannot follow this grammar"):  # at the 2nd "a", or the bonus row's token
        state.commit(a)
        state.commit(a)


def test_another_requests_failure_on_the_same_grammar_leaves_this_one_going(demo):
    """Copies of a compiled matcher share its lexer: one request's failure used to fail the other's next
    mask or commit although its own output was fine."""
    _, tokenizer = demo
    compiler = GrammarCompiler(tokenizer, 2048, {tokenizer.eos_token_id})
    p, q, r, s, a = ids(tokenizer, "pqrsa")
    params = SamplingParams(structured_outputs=LATE_FAILURE)
    failing, other = compiler.state(params), compiler.state(params)
    for state in (failing, other):
        state.row_masks([], 1)
        state.commit(p)
    try:  # the round verifying "q r s a a" for `failing`
        failing.row_masks([q, r, s, a, a], K + 1)
    except GrammarError:
        pass  # (old: raised here)
    assert bool(other.row_masks([q, r], 3)[2, s])
    for t in (q, r, s):
        other.commit(t)


def generate(target: str, mode: str, params: SamplingParams):
    with LLM(model=target, draft=None if mode == "ar" else target, mode=mode, k=K, draft_executor="thread") as llm:
        out = llm.generate(["x = "], params, use_tqdm=False)[0]
        return out.token_ids, out.text, out.finish_reason


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_a_finish_earlier_in_the_round_wins_over_a_later_grammar_failure(demo, mode):
    """max_tokens, or a stop token, reached at "s": AR ends there normally; SD and SSD verified the drafted
    "a a" past it in the same round, and the failure there used to fail the request."""
    target, tokenizer = demo
    s = tokenizer.convert_tokens_to_ids("s")
    favour_a = {tokenizer.convert_tokens_to_ids("a"): 20.0}  # the draft drafts past "s" (not EOS)
    for extra in ({"max_tokens": 4}, {"max_tokens": 12, "stop_token_ids": [s]}, {"max_tokens": 12, "stop": ["rs"]}):
        params = SamplingParams(temperature=0, structured_outputs=LATE_FAILURE, logit_bias=favour_a, **extra)
        want = generate(target, "ar", params)
        assert want[0] == ids(tokenizer, "pqrs"), want
        assert generate(target, mode, params) == want, extra
