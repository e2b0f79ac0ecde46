"""Property tests of the Python API's edge: any SamplingParams arguments, and any prompt_token_ids, are
either refused with a ValueError or make a request that runs, on a real SSD engine, beside a plain greedy
one whose tokens it leaves untouched. (A top_k past int64 was accepted and failed the whole batch's step:
every request in flight got an EngineError; a prompt of floats or digit strings was silently int()-ed.)"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saguaro_dist import LLM, SamplingParams

PROMPT = [3, 4, 5, 6]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
HUGE = st.sampled_from([2 ** 31, 2 ** 63, 2 ** 70])
IDS = st.integers(-2, 70) | HUGE  # the tiny checkpoints' vocabulary is 64
ODD = st.booleans() | st.none() | st.text(max_size=2)
NUMBERS = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 3) | st.sampled_from([0.0, 0.5, 1.0]) | HUGE
FIELDS = {
    "temperature": NUMBERS | ODD, "top_p": NUMBERS | ODD, "top_k": st.integers(-3, 70) | HUGE | ODD,
    "min_p": NUMBERS | ODD, "max_tokens": st.integers(-1, 6) | HUGE | ODD, "min_tokens": st.integers(-1, 7) | ODD,
    "seed": st.integers(-5, 5) | HUGE | ODD | st.floats(), "stop": st.lists(st.text(max_size=3), max_size=2) | ODD,
    "stop_token_ids": st.lists(IDS, max_size=2) | ODD, "ignore_eos": st.booleans(),
    "logprobs": st.integers(-1, 25) | ODD, "prompt_logprobs": st.integers(-1, 25) | ODD,
    "presence_penalty": NUMBERS | ODD, "frequency_penalty": NUMBERS | ODD, "repetition_penalty": NUMBERS | ODD,
    "logit_bias": st.dictionaries(IDS, NUMBERS, max_size=2) | ODD, "allowed_token_ids": st.lists(IDS, max_size=3) | ODD,
    "include_stop_str_in_output": ODD, "skip_special_tokens": ODD, "truncate_prompt_tokens": st.integers(-3, 8) | ODD,
}


@pytest.fixture(scope="module")
def engine(tiny_llama_pair):
    target, draft = tiny_llama_pair
    with LLM(model=target, draft=draft, mode="ssd", k=2, max_batch_size=4) as llm:
        reference = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, use_tqdm=False)[0].token_ids
        yield llm, reference


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(kwargs=st.fixed_dictionaries({}, optional=FIELDS))
def test_any_arguments_are_refused_or_run_beside_others_untouched(engine, kwargs):
    llm, reference = engine
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        return
    try:  # refused here only by what needs the model (ids past its vocabulary, a too long request)
        outputs = llm.generate(prompt_token_ids=[PROMPT, PROMPT], sampling_params=[params, GREEDY], use_tqdm=False)
    except ValueError:
        outputs = [None] + llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, use_tqdm=False)
    assert outputs[1].token_ids == reference


PROMPTS = st.lists(st.lists(IDS | ODD | st.floats(), max_size=4), max_size=2) | st.lists(IDS, max_size=4) | ODD


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(prompt_token_ids=PROMPTS)
def test_any_prompt_token_ids_are_refused_or_run(engine, prompt_token_ids):
    llm, reference = engine
    try:
        llm.generate(prompt_token_ids=prompt_token_ids, sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    except ValueError:
        pass
    assert llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, use_tqdm=False)[0].token_ids == reference


@pytest.mark.parametrize("kwargs", [dict(ignore_eos="false"), dict(ignore_eos=1), dict(seed=2 ** 63),
                                    dict(seed=-2 ** 63 - 1)])
def test_flags_and_seeds_outside_their_types_are_refused(kwargs):
    """ignore_eos="false" is truthy and ignored EOS; a seed past int64 cannot travel to Ray's draft workers
    (protobuf int64), and failed there inside the engine step, with every request in flight."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
    assert SamplingParams(seed=2 ** 63 - 1).seed == 2 ** 63 - 1 and SamplingParams(seed=-2 ** 63).seed == -2 ** 63
