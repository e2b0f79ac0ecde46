"""Config.seed (vLLM's LLM(seed=...) / --seed): unseeded requests draw from streams derived from the engine's seed
and their order of arrival, so one LLM(seed=S) run reproduces; a request's own seed is left alone."""
from __future__ import annotations

import pytest

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.cli import build_parser
from saguaro_dist.cli.serve import engine_args
from saguaro_dist.config import Config
from saguaro_dist.engine.sequence import engine_request_seed
from saguaro_dist.serve.args import config_from_args

SEED = 1234
PROMPTS = [[1, 2, 3, 4], [1, 2, 3, 4], [7, 8, 9], [5, 6]]  # the first two alike: their streams must still differ
# SSD on the README's fixed path (explicit fan-out, a tree every round, x_K after every hit, neural fallback):
# which draws feed which token then depends on nothing measured
MODES = {"ar": dict(mode="ar"), "sd": dict(mode="sd", k=2),
         "ssd": dict(mode="ssd", k=2, fan_out=[2, 2, 2], tree_policy="always", hit_glue="always", fallback="neural",
                 draft_executor="thread")}
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("seed", [None, 0, -2**63, 2**63 - 1, 7])
def test_a_seed_is_none_or_an_int64(seed):
    assert Config(model="m", mode="ar", seed=seed).seed == seed


@pytest.mark.parametrize("seed", [True, 2**63, -2**63 - 1, 1.0, "7"])
def test_other_seeds_are_refused(seed):
    with pytest.raises(ValueError, match="seed must be an integer"):
        Config(model="m", mode="ar", seed=seed)


def test_request_seeds_are_deterministic_distinct_and_leave_room_for_n():
    seeds = [engine_request_seed(SEED, i) for i in range(1000)]
    assert seeds == [engine_request_seed(SEED, i) for i in range(1000)]
    assert len(set(seeds)) == 1000 and all(0 <= s < 2**62 for s in seeds)
    assert seeds != [engine_request_seed(SEED + 1, i) for i in range(1000)]
    assert engine_request_seed(-1, 0) == engine_request_seed(2**64 - 1, 0)  # a negative seed is its int64 bits


def test_serve_takes_an_engine_seed_generate_keeps_its_request_seed():
    """generate's --seed was already each request's (SamplingParams.seed): the engine's --seed is the flag of the
    server, whose requests come with seeds of their own (its HTTP bodies)."""
    parser = build_parser()
    serve = parser.parse_args(["serve", "--model", "m", "--seed", "5"])
    assert config_from_args(engine_args(serve)).seed == 5
    generate = parser.parse_args(["generate", "--model", "m", "--seed", "5", "--prompt", "x"])
    assert generate.seed == 5 and "seed" not in engine_args(generate)
    assert config_from_args({"model": "m", "mode": "ar", "seed": "9"}).seed == 9  # a `serve run` YAML's string


def sampled_tokens(pair, seed, mode: str, params=SAMPLED) -> list[tuple[int, ...]]:
    target, draft = pair
    kwargs = MODES[mode]
    with LLM(model=str(target), draft=None if mode == "ar" else str(draft), seed=seed, **kwargs) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        more = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params, use_tqdm=False)  # arrives later
    return [tuple(o.outputs[0].token_ids) for o in outs + more]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_one_engine_seed_reproduces_a_run_and_another_differs(tiny_llama_pair, mode):
    first = sampled_tokens(tiny_llama_pair, SEED, mode)
    assert sampled_tokens(tiny_llama_pair, SEED, mode) == first
    assert len(set(first)) == len(first)  # alike prompts, and a later call, each draw a stream of their own
    other = sampled_tokens(tiny_llama_pair, SEED + 1, mode)
    assert all(a != b for a, b in zip(first, other))


@pytest.mark.slow
def test_a_requests_own_seed_wins_over_the_engines(tiny_llama_pair):
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=99)
    assert sampled_tokens(tiny_llama_pair, SEED, "sd", seeded) == sampled_tokens(tiny_llama_pair, None, "sd", seeded)


@pytest.mark.slow
def test_an_unseeded_requests_samples_reproduce_and_differ(tiny_llama_pair):
    target, _ = tiny_llama_pair
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=3)

    def samples():
        with LLM(model=str(target), mode="ar", seed=SEED) as llm:
            out = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params, use_tqdm=False)[0]
        return [tuple(s.token_ids) for s in out.outputs]
    first = samples()
    assert samples() == first and len(set(first)) == 3
