"""Inputs that overflowed the sampler to inf / NaN (NaN probabilities draw the last token id), or raised
inside the engine step (failing every request in flight): each is now refused with a ValueError naming
its field at the edge, or handled exactly. Every test here failed on the code before its fix."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import DEVICE, llama_config, save_model
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.engine.logprobs import token_logprobs
from saguaro_dist.engine.messages import DraftSampling
from saguaro_dist.engine.target import RowSampling, sampling_probs
from saguaro_dist.sampling_params import (
    FLOAT32_MAX, GREEDY_BELOW, REPETITION_PENALTY_MAX, REPETITION_PENALTY_MIN, check_against_model,
)
from saguaro_dist.spec import penalize_batch, sample, target_probs

LOGITS = torch.tensor([[5.0, 6.0, 0.0, -3.0, 1.0, 2.0, -1.0, 0.5]])  # likeliest: token 1, not the last
V = LOGITS.shape[1]


@pytest.mark.parametrize("r", [1e-30, 1e-46, 1e-11, 1e11, 1e39, 1e300, 10 ** 400])
def test_repetition_penalty_past_the_finite_range_is_refused(r):
    """1e-40 took logit 5 to inf (NaN: the last token id); 1e39 is inf in float32 (0 * inf = NaN); 10**400
    raised OverflowError in the step. The draft's edge (DraftSampling) shares the check."""
    with pytest.raises(ValueError, match="^repetition_penalty must be a number in"):
        SamplingParams(repetition_penalty=r)
    with pytest.raises(ValueError, match="^repetition_penalty"):
        DraftSampling(temperature=1.0, top_k=0, top_p=1.0, seed=None, repetition_penalty=r)


@pytest.mark.parametrize("r", [REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX])
def test_repetition_penalty_at_its_bounds_keeps_logits_finite(r):
    """At either bound, logits of +-1e3 (with a +-100 bias) penalized, then tempered by the smallest
    sampled temperature, stay finite: probabilities, and the penalized target's own likeliest token."""
    params = SamplingParams(repetition_penalty=r, temperature=GREEDY_BELOW)
    logits = torch.tensor([[[1100.0, 900.0, -1100.0, -900.0]]])
    seen = torch.ones(1, 4, dtype=torch.bool)
    penalized = penalize_batch(logits, seen, [[]], [[]], [(0.0, 0.0, params.repetition_penalty)])[0]
    assert penalized.isfinite().all()
    probs = target_probs(penalized, params.temperature, 0, 1.0)
    assert probs.isfinite().all() and torch.allclose(probs.sum(-1), torch.ones(1))
    assert int(probs.argmax()) == int(penalized.argmax())


@pytest.mark.parametrize("t", [1e39, 3.5e38, 10 ** 400])
def test_temperature_float32_cannot_hold_is_refused(t):
    """1e39 is inf in float32: a masked token's -inf / inf was NaN; 10**400 raised OverflowError in the step."""
    with pytest.raises(ValueError, match="^temperature must be a number in"):
        SamplingParams(temperature=t)


def test_temperature_at_float32_max_samples_a_distribution():
    params = SamplingParams(temperature=FLOAT32_MAX)
    logits = LOGITS.clone()
    logits[0, 3] = float("-inf")  # masked (allowed tokens, a grammar, min_tokens)
    probs = sampling_probs(logits, RowSampling.of([params]))
    assert probs.isfinite().all() and probs[0, 3] == 0 and torch.allclose(probs.sum(-1), torch.ones(1))


@pytest.mark.parametrize("top_p", [1e-46, 1e-300])
def test_top_p_below_float32s_smallest_keeps_the_likeliest_token(top_p):
    """In (0, 1] as asked, but 0 in float32: `mass before < 0` dropped every token, NaN probabilities, and
    the draw was the last token id. The smallest prefix reaching any top_p > 0 is the likeliest token."""
    params = SamplingParams(top_p=top_p)
    probs = sampling_probs(LOGITS, RowSampling.of([params]))
    assert probs.tolist() == [[0.0, 1.0] + [0.0] * (V - 2)]
    assert sample(probs).tolist() == [1]


def test_logprobs_past_the_vocabulary_give_every_token():
    """logprobs = 20 (the edge's largest) over 6 tokens: topk raised past V."""
    logits = torch.log_softmax(torch.randn(2, 6, generator=torch.Generator().manual_seed(0)), dim=-1)
    rows = token_logprobs(logits, [1, 2], 20)
    assert [sorted(r) for r in rows] == [list(range(6))] * 2
    assert rows[0][1] == pytest.approx(float(logits[0, 1]))


def test_min_tokens_with_every_token_an_end_is_refused():
    """stop_token_ids (and EOS) naming the whole vocabulary, held back by min_tokens: every logit -inf,
    NaN probabilities. Under ignore_eos too: min_tokens holds the eos ids back all the same (vLLM's
    all_stop_token_ids). Without min_tokens, or with a token left over, the request stands."""
    for ignore_eos in (False, True):
        params = SamplingParams(min_tokens=1, stop_token_ids=range(V - 1), ignore_eos=ignore_eos)
        with pytest.raises(ValueError, match="^stop_token_ids .* every token of the vocabulary"):
            check_against_model(params, V, frozenset({V - 1}))
        with pytest.raises(ValueError, match="^allowed_token_ids holds only end tokens"):
            check_against_model(SamplingParams(min_tokens=1, allowed_token_ids=[V - 1], ignore_eos=ignore_eos), V,
                                frozenset({V - 1}))
    check_against_model(SamplingParams(min_tokens=1, stop_token_ids=range(V - 2), ignore_eos=True), V, frozenset({V - 1}))
    check_against_model(SamplingParams(stop_token_ids=range(V)), V, frozenset())


@pytest.fixture(scope="module")
def six_token_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("six_tokens")
    save_model(path, llama_config(6, 32, 1), seed=3)
    return str(path)


def test_engine_serves_logprobs_past_a_small_vocabulary_beside_others(six_token_model):
    """The step's topk failure took its batch-mate down with it; now both finish, the first with all 6."""
    wanted = SamplingParams(temperature=1.0, seed=1, max_tokens=3, ignore_eos=True, logprobs=20)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(device=DEVICE, model=six_token_model, mode="ar", max_batch_size=2) as llm:
        outs = llm.generate(prompt_token_ids=[[1, 2, 3], [1, 2, 3]], sampling_params=[wanted, plain], use_tqdm=False)
        with pytest.raises(ValueError, match="^stop_token_ids"):
            llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(min_tokens=1, stop_token_ids=range(6)))
    assert len(outs[0].token_ids) == 3 and all(len(entry) == 6 for entry in outs[0].logprobs)
    assert len(outs[1].token_ids) == 3


@pytest.mark.parametrize("field, value, message", [
    ("temperature", float("nan"), "temperature"), ("temperature", 1e39, "temperature"), ("top_p", 0.0, "top_p"),
    ("top_p", float("nan"), "top_p"), ("top_k", -1, "top_k"), ("top_k", 2 ** 63, "top_k"), ("top_k", 2.0, "top_k")])
def test_the_draft_edge_refuses_what_sampling_params_refuses(field, value, message):
    """DraftSampling is built from a peer's message (gRPC, the pipe): a NaN temperature or top_p there made
    the draft's rows NaN, past every check the request had passed."""
    fields = dict(temperature=1.0, top_k=0, top_p=1.0, seed=None) | {field: value}
    with pytest.raises(ValueError, match=message):
        DraftSampling(**fields)


def test_the_draft_edge_takes_a_tiny_temperature_as_greedy():
    assert DraftSampling(temperature=1e-40, top_k=0, top_p=1.0, seed=None).temperature == 0.0
