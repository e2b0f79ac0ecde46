"""Two of vLLM's rules the engine follows, in every mode (ar, sd, ssd: one token a round, or several):
- under structured outputs, log-probabilities are read from the grammar-masked logits (vLLM applies the
  grammar's bitmask before its sampler takes the raw log-softmax): over the allowed tokens only;
- a token that brings two stop strings at once ends at the first of them in the `stop` list (vLLM's
  check_stop_strings), not at the one starting earliest in the text."""
from __future__ import annotations

import math
from contextlib import ExitStack

import llguidance
import llguidance.hf
import pytest
import torch
from offline_tokenizers import byte_level_bpe
from test_text_path_tokenizers import params, run_rounds, text_engine
from transformers import AutoTokenizer, LlamaForCausalLM

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import demo_pair
from saguaro_dist.engine.structured import bitmask_to_bool, grammar_of
from saguaro_dist.sampling_params import StructuredOutputsParams as SO

PROMPTS = ["def add(a, b):", "import os\nimport sys\n\ndef main("]
MODES = ("ar", "sd", "ssd")


def vllm_stop(pieces: list[str], stop: list[str]) -> tuple[str, str | None]:
    """vLLM's check_stop_strings after each token's text (one token a step), transcribed: the first stop
    string of the list found in the text the token added (with len(stop) - 1 characters before it)."""
    text = ""
    for piece in pieces:
        text += piece
        for s in stop:
            i = text.find(s, max(0, len(text) - len(piece) - len(s) + 1))
            if i >= 0:
                return text[:i], s
    return text, None


@pytest.fixture(scope="module")
def demo():
    target, draft = demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with ExitStack() as stack:
        llms = {"ar": stack.enter_context(LLM(model=target, mode="ar"))}
        for mode in ("sd", "ssd"):
            llms[mode] = stack.enter_context(LLM(model=target, draft=draft, mode=mode, k=4, draft_executor="thread"))
        yield tokenizer, model, llms


def masked_logprobs(model, tokenizer, prompt: list[int], output: list[int], spec: SO) -> torch.Tensor:
    """The reference: transformers' logits at each output position, masked by llguidance's matcher
    (used directly) after the output so far, as log-probabilities [len(output), V]."""
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=model.config.vocab_size)
    matcher = llguidance.LLMatcher(ll, grammar_of(spec), log_level=0)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    rows = []
    for row, token in zip(logits, output):
        allowed = bitmask_to_bool(matcher.compute_bitmask(), row.shape[-1])
        rows.append(torch.log_softmax(row.masked_fill(~allowed, float("-inf")), dim=-1))
        assert token == tokenizer.eos_token_id or matcher.consume_tokens([token])  # (EOS: the end, nothing after)
    return torch.stack(rows)


@pytest.mark.parametrize("spec", [SO(choice=("yes", "no")), SO(regex=r"(yes|no)( (yes|no)){3}")], ids=["choice", "regex"])
def test_logprobs_under_a_grammar_are_over_its_allowed_tokens(demo, spec):
    """The chosen token's log-probability and the top ones are the masked distribution's (transformers +
    llguidance as the reference): every top entry the grammar forbids is -inf, a lone allowed token (the EOS
    ending the choice) has 0.0 and rank 1; ar, sd and ssd (several positions a round, each its own grammar
    state) give the same figures."""
    tokenizer, model, llms = demo
    sampling = SamplingParams(temperature=0, max_tokens=16, logprobs=3, structured_outputs=spec)
    outs = {mode: llm.generate(PROMPTS, sampling, use_tqdm=False) for mode, llm in llms.items()}
    for i, prompt in enumerate(PROMPTS):
        ar = outs["ar"][i]
        want = masked_logprobs(model, tokenizer, tokenizer.encode(prompt), ar.token_ids, spec)
        for row, token, entry in zip(want, ar.token_ids, ar.logprobs):
            assert math.isclose(entry[token].logprob, row[token].item(), abs_tol=1e-4)
            assert entry[token].rank == int((row >= row[token]).sum())
            for t, lp in entry.items():
                assert (lp.logprob == float("-inf")) == (row[t].item() == float("-inf"))
                assert math.isclose(lp.logprob, row[t].item(), abs_tol=1e-4) or lp.logprob == float("-inf")
        assert ar.token_ids[-1] == tokenizer.eos_token_id and ar.finish_reason == "stop"
        assert ar.logprobs[-1][ar.token_ids[-1]].logprob == 0.0 and ar.logprobs[-1][ar.token_ids[-1]].rank == 1
        for mode in ("sd", "ssd"):
            other = outs[mode][i]
            assert other.token_ids == ar.token_ids and other.text == ar.text
            for a, b, token in zip(ar.logprobs, other.logprobs, ar.token_ids):
                assert a[token].rank == b[token].rank and list(a) == list(b), mode
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 or a[t].logprob == b[t].logprob for t in a), mode


@pytest.mark.parametrize("per_round", [1, 2, 4])
def test_a_token_bringing_two_stop_strings_ends_at_the_first_listed(per_round):
    """" return" brings "ret" (starting first) and "urn": stop=["urn", "ret"] ends at "urn" (the text keeps
    "ret"), as vLLM's; listed the other way round, at "ret". One token a round or several (a speculative
    round), alike."""
    tok = byte_level_bpe()
    prompt, output = tok.encode("Hello world"), tok.encode(" return a + b", add_special_tokens=False)
    assert tok.decode(output[:1]) == " return"  # one token brings both
    for stop, text in ((["urn", "ret"], " ret"), (["ret", "urn"], " ")):
        s, deltas = run_rounds(text_engine(tok, set()), prompt, output, params(stop=stop), per_round)
        assert (s.text, s.stop_reason, "".join(deltas)) == (text, stop[0], text)
        assert (s.text, s.stop_reason) == vllm_stop([tok.decode([t]) for t in output], stop)
        assert s.output_token_ids == output[:1]


def test_two_stop_strings_in_one_token_through_every_mode(demo):
    """Through the engine: a stop list naming, first, a string that starts later in the same token than the
    second: ar, sd and ssd end where vLLM's check_stop_strings does, with its stop_reason."""
    tokenizer, _, llms = demo
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    checked = 0
    for prompt, out in zip(PROMPTS, llms["ar"].generate(PROMPTS, plain, use_tqdm=False)):
        ids = out.token_ids
        pieces = [tokenizer.decode(ids[:n]) for n in range(len(ids) + 1)]
        pieces = [b[len(a):] for a, b in zip(pieces, pieces[1:])]
        assert "".join(pieces) == out.text
        at, stop = next((n, [p[-2:], p[:2]]) for n, p in enumerate(pieces)  # the first listed starts later
                        if len(p) >= 4 and p.find(p[-2:]) == len(p) - 2 and vllm_stop(pieces[:n], [p[-2:], p[:2]])[1] is None)
        want = vllm_stop(pieces, stop)
        assert want == ("".join(pieces[:at]) + pieces[at][:-2], stop[0])
        for mode, llm in llms.items():
            got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop),
                               use_tqdm=False)[0]
            assert (got.text, got.stop_reason, got.finish_reason, got.token_ids) == (*want, "stop", ids[:at + 1]), mode
            checked += 1
    assert checked == 2 * len(MODES)
