"""A rope-scaled checkpoint's context: vLLM's derived max_model_len (max_position_embeddings x the factor of
the rope types that extend the context), exact past max_position_embeddings as transformers computes it."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import DEVICE, assert_greedy_equal, hf_greedy, save_model, save_perturbed
from transformers import LlamaConfig

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.model.hf_config import context_limit, load_config
from saguaro_dist.model.runner import ModelRunner

POSITIONS = 32  # config.json max_position_embeddings; linear factor 2 extends it to 64
LINEAR = {"rope_type": "linear", "factor": 2.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
PROMPT = [5, 9, 2, 7, 11, 3, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]  # 16 tokens, then 44 more: to position 59


def scaled_config(rope_scaling: dict) -> LlamaConfig:
    return LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS,
                       rope_scaling=rope_scaling, tie_word_embeddings=False, bos_token_id=None,
                       eos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def linear(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope_linear")
    torch.set_num_threads(1)
    model = save_model(root / "target", scaled_config(LINEAR), seed=0)
    save_perturbed(root / "draft", model, seed=1, noise=0.15)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": model}


@pytest.mark.parametrize("hf, want", [
    ({"model_type": "llama", "max_position_embeddings": 32}, 32),
    ({"model_type": "llama", "max_position_embeddings": 32, "rope_scaling": LINEAR}, 64),
    ({"model_type": "llama", "max_position_embeddings": 32, "rope_scaling": {"type": "linear", "factor": 2.5}}, 80),
    ({"model_type": "llama", "max_position_embeddings": 32, "rope_parameters": {**LINEAR, "rope_theta": 1e4}}, 64),
    ({"model_type": "llama", "max_position_embeddings": 32, "rope_scaling": LLAMA3}, 32),  # already the extended one
    # a sliding window bounds attention, not positions: it never caps the context
    ({"model_type": "mistral", "max_position_embeddings": 32, "sliding_window": 48, "rope_scaling": LINEAR}, 64),
    ({"model_type": "mistral", "max_position_embeddings": 32, "sliding_window": 16, "rope_scaling": LINEAR}, 64),
])
def test_context_limit_follows_vllms_rope_rule(hf, want):
    assert context_limit(hf)[0] == want


def test_a_linear_scaled_checkpoint_runs_to_its_extended_length(linear):
    assert load_config(linear["target"]).max_position_embeddings == 2 * POSITIONS
    assert ModelRunner(linear["target"]).max_model_len == 2 * POSITIONS  # the default, as vLLM's


def test_a_longer_max_model_len_names_the_limit_and_why(linear):
    with pytest.raises(ValueError, match=r"max_model_len must be in 1\.\.64 \(config\.json max_position_embeddings "
                                         r"32 x rope_scaling linear factor 2\.0\), got 65"):
        ModelRunner(linear["target"], max_model_len=65)


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_greedy_past_max_position_embeddings_matches_transformers(linear, mode):
    """transformers does not cap a linear-scaled model at max_position_embeddings: neither do we."""
    n = 2 * POSITIONS - len(PROMPT)  # every mode to the context's end (ssd's last round in the position slack)
    want = hf_greedy(linear["model"], PROMPT, n)
    speculative = {"draft": linear["draft"], "k": 3, "draft_executor": "thread"} if mode == "ssd" else {}
    with LLM(device=DEVICE, model=linear["target"], mode=mode, max_model_len=2 * POSITIONS, max_batch_size=1,
             **speculative) as llm:
        got = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids
    assert len(PROMPT) + len(got) > POSITIONS + 20
    assert_greedy_equal(list(got), want, PROMPT, linear["model"])
