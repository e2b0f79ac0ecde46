"""A draft with a shorter context than the target's (its max_position_embeddings):
sequences that outgrow it leave the draft and go on with the fast n-gram backup, so the engine keeps the
target's whole context. Greedy output stays the target's on every path, whether a sequence crosses the
draft's limit while it generates or starts beyond it."""
from __future__ import annotations

import pytest

from engine_helpers import DEVICE, llama_config, save_model
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.build import fit_draft

DRAFT_CONTEXT, K = 48, 3
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# one crosses the draft's context while generating, one starts beyond it, one stays inside it
PROMPTS = [[(3 * i) % 50 for i in range(20)], [(7 * i) % 50 for i in range(60)], [5, 6, 7]]
SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("short_draft")
    save_model(root / "target", llama_config(64, 32, 2), seed=31)
    draft_config = llama_config(64, 16, 1)
    draft_config.max_position_embeddings = DRAFT_CONTEXT
    save_model(root / "draft", draft_config, seed=32)
    return str(root / "target"), str(root / "draft")


@pytest.fixture(scope="module")
def reference(pair):
    with LLM(model=pair[0], mode="ar", device=DEVICE) as llm:
        return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


def test_the_draft_is_fitted_to_its_own_context(pair):
    """The draft is built to its own 48 tokens where the engine holds more, else to the engine's."""
    assert fit_draft(Config(model=pair[0], draft=pair[1], mode="ssd"), None).max_model_len == DRAFT_CONTEXT
    assert fit_draft(Config(model=pair[0], draft=pair[1], mode="ssd", max_model_len=32), None).max_model_len == 32


@pytest.mark.parametrize("mode,executor", [("sd", "thread"), ("ssd", "thread"), ("ssd", "process")])
def test_sequences_outgrowing_the_draft_go_on_exactly(pair, reference, mode, executor):
    with LLM(model=pair[0], draft=pair[1], mode=mode, k=K, fan_out=6, draft_executor=executor, device=DEVICE) as llm:
        assert llm.max_model_len == 256  # the target's context, whole
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        metrics = llm.metrics
        assert [o.token_ids for o in outs] == reference
        assert metrics.fallbacks["fast"] > 0 and metrics.accepted_tokens > 0, metrics
        # the draft still serves what fits it
        assert llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SHORT)[0].token_ids == reference[2][:8]


def test_on_ray_too(pair, reference, ray_cluster):
    with LLM(model=pair[0], draft=pair[1], mode="ssd", k=K, fan_out=6, cluster="local", startup_timeout_s=120) as llm:
        assert [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == reference
