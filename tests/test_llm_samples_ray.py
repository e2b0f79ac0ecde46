"""n samples per prompt on the Ray engine: the samples are requests of their own there too (one actor call
submits and aborts them all), exact and reproducible as on one host."""
from __future__ import annotations

import pytest

from saguaro_dist import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = [[3, 4, 5], [6, 7, 8, 9]]


def test_samples_on_ray_are_exact_and_the_seed_plus_i_requests(ray_cluster, tiny_checkpoint):
    target = tiny_checkpoint("llama")
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(model=target, mode="ar", max_model_len=64) as local:
        want = [o.token_ids for o in local.generate(prompt_token_ids=PROMPTS, sampling_params=greedy, use_tqdm=False)]
    # (a fixed lookup length: the adaptive one, measured from timings, makes seeded ngram runs differ run to run)
    with LLM(model=target, mode="ngram", k=3, adaptive_lookup_length=False, cluster="auto", max_batch_size=4,
             max_model_len=64) as llm:
        run = lambda params: llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        twice = run(SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2))
        assert [[c.token_ids for c in o.outputs] for o in twice] == [[w, w] for w in want]
        three = run(SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=11, n=3))
        for i in range(3):
            single = run(SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=11 + i))
            assert [o.outputs[i].token_ids for o in three] == [o.token_ids for o in single]
        assert len({tuple(c.token_ids) for c in three[0].outputs}) == 3
