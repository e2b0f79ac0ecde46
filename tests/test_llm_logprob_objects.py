"""vLLM's Logprob objects offline: RequestOutput / CompletionOutput logprobs and prompt_logprobs hold
{token id: Logprob(logprob, rank, decoded_token)} as vLLM's do, so ported code
(`out.outputs[0].logprobs[i][tid].logprob`, `.rank`, `.decoded_token`) runs. Values are transformers'
log_softmax of a tiny real checkpoint; rank 1 is the likeliest and the sampled token has its rank outside the
top N too; decoded_token is the tokenizer's decode of the one token (None without a tokenizer, or with
detokenize=False). Under SD speculation, for n > 1, through stream(); n = 1's stream keeps the engine's
plain entries (the HTTP server's StreamDelta)."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

import saguaro_dist
from saguaro_dist import LLM, Logprob, RequestOutput, SamplingParams
from saguaro_dist.engine.metrics import RequestMetrics
from engine_helpers import reference_logprobs
from test_serve_fixtures import make_tokenizer, write_llama

PROMPT = "the cat sat on the mat"
TOP = 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    """(target, draft) tiny Llamas with a word-level tokenizer (decoded tokens are words)."""
    tokenizer = make_tokenizer()
    target = write_llama(tmp_path_factory.mktemp("lpo_target"), tokenizer, hidden=32, layers=1, seed=5)
    draft = write_llama(tmp_path_factory.mktemp("lpo_draft"), tokenizer, hidden=32, layers=1, seed=6)
    return target, draft


@pytest.fixture(scope="module")
def sd(pair):
    target, draft = pair
    with LLM(model=target, draft=draft, mode="sd", k=2, max_model_len=128) as llm:
        yield llm


@pytest.fixture(scope="module")
def model(pair):
    torch.manual_seed(0)
    return LlamaForCausalLM.from_pretrained(pair[0]).eval()


def sampled(**kw) -> SamplingParams:
    """T = 1 over a tiny vocabulary: the sampled token is often outside the top TOP (a rank of its own)."""
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 12, "ignore_eos": True, "seed": 7,
                             "logprobs": TOP, **kw})


def vllm_rank(row: torch.Tensor, token: int) -> int:
    """vLLM's rank: how many tokens are at least as likely, the token itself included."""
    return int((row >= row[token]).sum())


def check_entries(entries, tokens: list[int], want: torch.Tensor, top: int, decode) -> int:
    """Each entry: the token first, Logprob objects equal to transformers', vLLM's ranks and decoded tokens;
    the number of tokens that were sampled from outside the top `top`."""
    outside = 0
    assert len(entries) == len(tokens)
    for token, entry, row in zip(tokens, entries, want):
        assert next(iter(entry)) == token and all(isinstance(lp, Logprob) for lp in entry.values())
        assert set(row.topk(top).indices.tolist()) <= set(entry)
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[tid]), abs=1e-4)
            assert lp.rank == vllm_rank(row, tid)
            assert lp.decoded_token == decode(tid)
        outside += entry[token].rank > top
    return outside


def test_logprobs_are_vllms_logprob_objects(sd, model):
    out = sd.generate([PROMPT], sampled(), use_tqdm=False)[0]
    sample, decode = out.outputs[0], lambda t: sd.get_tokenizer().decode([t])
    want = reference_logprobs(model, out.prompt_token_ids, sample.token_ids)
    outside = check_entries(sample.logprobs, sample.token_ids, want, TOP, decode)
    assert outside > 0, "no sampled token outside the top N: its rank went untested"
    assert sample.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs)))
    assert out.logprobs is sample.logprobs  # the flat field: sample 0's
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.logprobs[0][sample.token_ids[0]].logprob = 0.0


def test_prompt_logprobs_are_logprob_objects(sd, model):
    out = sd.generate([PROMPT], sampled(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    prompt = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    want = reference_logprobs(model, prompt[:1], prompt[1:])
    check_entries(out.prompt_logprobs[1:], prompt[1:], want, 1, lambda t: sd.get_tokenizer().decode([t]))


def test_n_samples_each_carry_their_own_logprob_objects(sd, model):
    out = sd.generate([PROMPT], sampled(n=3), use_tqdm=False)[0]
    decode = lambda t: sd.get_tokenizer().decode([t])  # noqa: E731
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # (seed + i: different samples)
    for c in out.outputs:
        check_entries(c.logprobs, c.token_ids, reference_logprobs(model, out.prompt_token_ids, c.token_ids), TOP, decode)


def collect(llm: LLM, params: SamplingParams, **kw) -> list:
    async def run():
        return [item async for item in llm.stream(PROMPT, params, **kw)]
    return asyncio.run(run())


def test_stream_with_n_carries_logprob_objects_adding_up_to_generate(sd):
    params = sampled(n=2, prompt_logprobs=1)
    final = sd.generate([PROMPT], params, use_tqdm=False)[0]
    joined = {0: [], 1: []}
    for item in collect(sd, params):
        c = item.outputs[0]
        joined[c.index] += c.logprobs
        if item.prompt_logprobs is not None:
            assert item.prompt_logprobs == final.prompt_logprobs
    assert all(isinstance(lp, Logprob) for i in joined for entry in joined[i] for lp in entry.values())
    assert [joined[i] for i in range(2)] == [c.logprobs for c in final.outputs]
    (at_end,) = collect(sd, params, output_kind="final_only")
    assert [c.logprobs for c in at_end.outputs] == [c.logprobs for c in final.outputs]
    assert at_end.prompt_logprobs == final.prompt_logprobs


def test_stream_of_one_sample_keeps_the_engines_plain_entries(sd):
    """n = 1 streams StreamDeltas, the HTTP server's input: {token id: log p}, the same figures."""
    params = sampled()
    final = sd.generate([PROMPT], params, use_tqdm=False)[0]
    streamed = [entry for delta in collect(sd, params) for entry in delta.logprobs]
    assert all(isinstance(lp, float) for entry in streamed for lp in entry.values())
    assert streamed == [{t: lp.logprob for t, lp in entry.items()} for entry in final.logprobs]


def test_detokenize_false_leaves_decoded_token_none(sd):
    out = sd.generate([PROMPT], sampled(detokenize=False, prompt_logprobs=0), use_tqdm=False)[0]
    entries = out.logprobs + out.prompt_logprobs[1:]
    assert all(lp.decoded_token is None and lp.rank >= 1 for entry in entries for lp in entry.values())


def test_no_tokenizer_leaves_decoded_token_none(tiny_checkpoint):
    with LLM(model=tiny_checkpoint("llama"), mode="ar", max_model_len=64) as llm:
        assert llm.tokenizer is None
        out = llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=sampled(max_tokens=4), use_tqdm=False)[0]
    assert all(lp.decoded_token is None and lp.rank >= 1 for entry in out.logprobs for lp in entry.values())


def test_logprob_is_exported_and_the_old_constructor_still_sums_floats():
    assert "Logprob" in saguaro_dist.__all__ and saguaro_dist.Logprob is Logprob
    assert Logprob(-0.5) == Logprob(logprob=-0.5, rank=None, decoded_token=None)
    out = RequestOutput("r", None, [1], "", [4, 5], "length", RequestMetrics(), logprobs=[{4: -0.5}, {5: -1.0}])
    assert out.outputs[0].cumulative_logprob == pytest.approx(-1.5)
    objects = RequestOutput("r", None, [1], "", [4], "length", RequestMetrics(), logprobs=[{4: Logprob(-0.25, 1)}])
    assert objects.outputs[0].cumulative_logprob == pytest.approx(-0.25)
