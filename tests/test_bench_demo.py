"""On the shipped demo pair: a short greedy generation is identical across ar / sd / ssd."""
from __future__ import annotations

import pytest

from saguaro_dist import LLM, SamplingParams


def demo_or_skip():
    from saguaro_dist.demo import demo_pair, demo_prompts
    try:
        return demo_pair(), demo_prompts(2)
    except FileNotFoundError as err:
        pytest.skip(f"demo pair absent ({err}); build it with `saguaro demo build`")


def test_greedy_identical_across_modes_on_the_demo_pair():
    (target, draft), prompts = demo_or_skip()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    texts = {}
    for mode in ("ar", "sd", "ssd"):
        with LLM(model=target, draft=None if mode == "ar" else draft, mode=mode, k=4, fan_out=12,
                 target_threads=1, draft_threads=1) as llm:
            texts[mode] = [o.token_ids for o in llm.generate([p[:200] for p in prompts], params)]
    assert texts["sd"] == texts["ar"] and texts["ssd"] == texts["ar"]
