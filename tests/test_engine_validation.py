"""Bad input to LLM: a clear ValueError before any work, and the engine keeps serving afterwards."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine_helpers import llama_config, save_model
from saguaro_dist import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_pair):
    target, draft = tiny_llama_pair
    with LLM(model=target, draft=draft, mode="ssd", k=2, fan_out=6, max_model_len=64) as engine:
        yield engine


def test_a_max_tokens_past_the_context_is_capped_there(llm):
    """vLLM's offline LLM: prompt + max_tokens beyond max_model_len runs to the context's end, finish "length"
    (it was refused)."""
    out = llm.generate(prompt_token_ids=[[1] * 50], sampling_params=SamplingParams(temperature=0, max_tokens=30))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == llm.max_model_len == 64 and out.finish_reason == "length"


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_token_ids=[[]]), "empty prompt"),
    (dict(prompt_token_ids=[[1, 2, 999]]), "token ids must be in"),
    (dict(prompt_token_ids=[[1] * 64]), "leaves 0 of the model's max length 64"),
    (dict(prompt_token_ids=[[1] * 50], sampling_params=SamplingParams(max_tokens=30, min_tokens=15)), "needs 15"),
    (dict(prompts=["hello"]), "no tokenizer"),
    (dict(), "exactly one of"),
    (dict(prompt_token_ids=[[1], [2]], sampling_params=[SamplingParams()]), "sampling_params for 2 prompts"),
    (dict(prompt_token_ids=[[1]], sampling_params=SamplingParams(logit_bias={999: 1.0})), "logit_bias names token 999"),
    (dict(prompt_token_ids=[[1]], sampling_params=SamplingParams(allowed_token_ids=[1, 999])), "allowed_token_ids names"),
    (dict(prompt_token_ids=[[1]], sampling_params=SamplingParams(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=2)),
     "only end tokens"),
    (dict(prompt_token_ids=[[1]], priority=[1]), "scheduling_policy='priority'"),
    (dict(prompt_token_ids=[[1], [2]], priority=[0]), "one int per prompt"),
    (dict(prompt_token_ids=[[1.7, 2]]), "integer token ids"), (dict(prompt_token_ids=[["12", 2]]), "integer token ids"),
    (dict(prompt_token_ids=[[True, 2]]), "integer token ids"), (dict(prompt_token_ids=[1, 2]), "for one prompt"),
    (dict(prompt_token_ids=5), "list of prompts"), (dict(prompts=5), "a string or a list of strings"),
    # a dict where a SamplingParams goes failed deep inside with an AttributeError
    (dict(prompt_token_ids=[[1]], sampling_params={"max_tokens": 2}), "a SamplingParams or a list of them"),
    (dict(prompt_token_ids=[[1]], sampling_params=[{"max_tokens": 2}]), "a SamplingParams or a list of them"),
])
def test_bad_requests_are_rejected_up_front(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(**kwargs)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].token_ids) == 4


def test_prompt_token_ids_may_be_arrays_or_tensors_of_integers(llm):
    import numpy as np
    greedy = SamplingParams(temperature=0, max_tokens=4)
    want = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=greedy)[0].token_ids
    for prompt in (np.array([1, 2, 3]), torch.tensor([1, 2, 3]), (1, 2, 3)):
        assert llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0].token_ids == want


def test_sampling_params_may_be_any_iterable_of_them(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    want = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=greedy)[0].token_ids
    got = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=(p for p in [greedy]))[0].token_ids
    assert got == want


def test_a_k_as_long_as_the_context_runs_to_its_end(tiny_llama_pair):
    """Once, a k as long as the context failed every request against "the model's max length -89", then was
    refused ("k = 4 leaves no room in max_model_len = 6"): a round's K + 1 scored positions now run in the
    target's position slack, so a context of 2 holds a prompt token and a generated one in every mode."""
    target, draft = tiny_llama_pair
    with LLM(model=target, draft=draft, mode="sd", k=4, fan_out=5, max_model_len=2) as tight:
        assert tight.max_model_len == 2
        out = tight.generate(prompt_token_ids=[[1]], sampling_params=SamplingParams(temperature=0, max_tokens=9))
    assert len(out[0].token_ids) == 1 and out[0].finish_reason == "length"


def test_vocab_mismatch_between_target_and_draft(tiny_llama_pair, tmp_path):
    target, _ = tiny_llama_pair
    save_model(tmp_path / "other", llama_config(80, 32, 1), seed=5)
    with pytest.raises(ValueError, match="vocab"):
        LLM(model=target, draft=str(tmp_path / "other"), mode="sd")


def test_stream_yields_deltas_that_add_up(llm):
    async def collect():
        deltas = []
        async for d in llm.stream(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(temperature=0, max_tokens=9)):
            deltas.append(d)
        return deltas
    deltas = asyncio.run(collect())
    full = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(temperature=0, max_tokens=9))[0]
    assert sum((d.token_ids for d in deltas), []) == full.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "length" and deltas[-1].metrics is not None


@pytest.mark.parametrize("bad", [{"output_kind": "everything"}, {"stream_interval_s": -1},
                                 {"stream_interval_s": float("inf")}, {"stream_interval_s": "50"}])
def test_stream_names_a_wrong_delivery_setting(llm, bad):
    async def first():
        return await anext(llm.stream(prompt_token_ids=[5, 6], **bad))
    with pytest.raises(ValueError, match=str(list(bad.values())[0])):
        asyncio.run(first())


def test_closing_a_stream_early_aborts_the_request(llm):
    async def first_only():
        gen = llm.stream(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(temperature=0, max_tokens=40))
        async for _ in gen:
            break
        await gen.aclose()
    asyncio.run(first_only())
    out = llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].token_ids) == 3


def test_seeded_sampling_is_reproducible_on_a_fixed_path(tiny_llama_pair):
    # By default SSD picks each round's proposal source by measurement (tree gate, auto fallback, fan-out
    # fitted to the outcomes so far), so reruns may consume different draws; the README's recipe fixes it.
    target, draft = tiny_llama_pair
    params = SamplingParams(temperature=0.9, max_tokens=12, seed=7)
    with LLM(model=target, draft=draft, mode="ssd", k=2, fan_out=[3, 2, 1], tree_policy="always",
             hit_glue="always", fallback="neural", max_model_len=64) as engine:
        a = engine.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=params)[0].token_ids
        b = engine.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=params)[0].token_ids
    assert a == b


def test_unseeded_requests_leave_the_processs_torch_rng_alone(llm):
    """A request without a seed draws its seed from the OS: the caller's global torch RNG (torch.manual_seed)
    goes on as if no request had run (torch.seed() reseeded it at every request)."""
    torch.manual_seed(0)
    want = torch.rand(4)
    torch.manual_seed(0)
    llm.generate(prompt_token_ids=[[3, 4, 5]] * 4, sampling_params=SamplingParams(temperature=1.0, max_tokens=4),
                 use_tqdm=False)
    assert torch.equal(torch.rand(4), want)
