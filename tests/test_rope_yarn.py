"""YaRN rope scaling (Qwen2.5 / Qwen3 long-context deployments): frequencies and the attention factor as
transformers computes them, exact past original_max_position_embeddings; the context vLLM derives for it
(original_max_position_embeddings x factor); its bad fields refused at load."""
from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import (
    DEVICE,
    assert_greedy_equal,
    hf_greedy,
    save_model,
    save_perturbed,
)
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from model_checks import random_tokens, runner_logits

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.model.hf_config import context_limit, rope_params
from saguaro_dist.model.runner import ModelRunner

ORIGINAL = 32            # original_max_position_embeddings: the prompts below run well past it
FACTOR = 4.0
EXTENDED = int(ORIGINAL * FACTOR)  # 128: vLLM's derived max_model_len
YARN = {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL}
VOCAB = 64
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": EXTENDED, "bos_token_id": None,
          "eos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False}
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
VARIANTS = {  # the yarn fields each family's checkpoints carry (Qwen's and DeepSeek-distill's defaults first)
    "defaults": {},
    "attention-factor": {"attention_factor": 1.3},
    "mscale-ratio": {"mscale": 1.0, "mscale_all_dim": 0.5},
    "betas": {"beta_fast": 4, "beta_slow": 0.5},  # head_dim 8: a ramp over indices 0..2, not the defaults' 0..1
    "untruncated": {"beta_fast": 1, "beta_slow": 0.1, "truncate": False},  # 0.71..1.71, not floored / ceiled
}
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def save_family(path, family: str, yarn: dict, seed: int = 0):
    """A seeded tiny checkpoint written by transformers, rope_scaling yarn; norms randomised (HF: ones)."""
    config_cls, model_cls = FAMILIES[family]
    extra = {"head_dim": 8} if family == "qwen3" else {}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra, rope_scaling={**YARN, **yarn})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def tokens(seed: int, n: int) -> list[int]:
    return random_tokens(seed, n, VOCAB)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_yarn_logits_match_transformers_past_the_original_context(tmp_path, family, variant):
    path = save_family(tmp_path / f"{family}-{variant}", family, VARIANTS[variant], seed=3)
    seq = tokens(2, 80)  # 80 positions, the original context 32
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0].float()
    torch.testing.assert_close(runner_logits(ModelRunner(path), seq), want, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def yarn_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope_yarn")
    torch.set_num_threads(1)
    config = LlamaConfig(**{**COMMON, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128}, rope_scaling=YARN)
    model = save_model(root / "target", config, seed=0)
    save_perturbed(root / "draft", model, seed=1, noise=0.15)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": model}


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_yarn_greedy_generation_matches_transformers_generate(yarn_pair, mode):
    prompt = tokens(5, 16)
    n = 64  # to position 80, past the original 32
    want = hf_greedy(yarn_pair["model"], prompt, n)
    speculative = {"draft": yarn_pair["draft"], "k": 3} if mode == "sd" else {}
    with LLM(device=DEVICE, model=yarn_pair["target"], mode=mode, max_batch_size=1, **speculative) as llm:
        got = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids
    assert_greedy_equal(list(got), want, prompt, yarn_pair["model"])


def test_a_yarn_checkpoint_runs_to_original_times_factor(yarn_pair):
    assert ModelRunner(yarn_pair["target"]).max_model_len == EXTENDED  # the default, as vLLM's
    with pytest.raises(ValueError, match=r"max_model_len must be in 1\.\.128 \(config\.json rope_scaling yarn "
                                         r"original_max_position_embeddings 32 x factor 4\.0\), got 129"):
        ModelRunner(yarn_pair["target"], max_model_len=129)


@pytest.mark.parametrize("positions, rope, want", [
    (40960, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),  # Qwen3
    (32768, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),  # Qwen2.5
    (131072, {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 1000}, 2500),  # not max_pos
])
def test_yarn_context_is_original_times_factor_as_vllm_derives_it(positions, rope, want):
    assert context_limit({"model_type": "qwen2", "max_position_embeddings": positions, "rope_scaling": rope})[0] == want


@pytest.mark.parametrize("changes, message", [
    ({"factor": 0}, "factor must be a number > 0, got 0"),
    ({"factor": "4"}, "factor must be a number > 0"),
    ({"factor": None}, "lacks factor"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings must be a positive integer"),
    ({"original_max_position_embeddings": 32.5}, "original_max_position_embeddings must be a positive integer"),
    ({"attention_factor": 0.0}, "attention_factor must be > 0"),
    ({"mscale": "big"}, "mscale must be a number"),
    ({"beta_slow": -1}, "beta_slow must be >= 0"),
    ({"beta_fast": 1, "beta_slow": 32}, "beta_fast .* must not be less than beta_slow"),
    ({"truncate": "no"}, "truncate must be true or false"),
])
def test_bad_yarn_fields_are_refused_clearly(changes, message):
    hf = {"model_type": "qwen2", "max_position_embeddings": EXTENDED, "rope_scaling": {**YARN, **changes}}
    with pytest.raises(ValueError, match=f"rope_type 'yarn' {message}"):
        rope_params(hf)


def test_a_linear_factor_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="rope_type 'linear' factor must be a number > 0, got -2"):
        rope_params({"rope_scaling": {"rope_type": "linear", "factor": -2}})


def test_an_outer_original_length_differing_from_yarns_is_refused_at_load(tmp_path):
    """transformers lets a top-level original_max_position_embeddings override the rope dict's."""
    path = save_family(tmp_path / "outer", "qwen2", {})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "original_max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="original_max_position_embeddings 64 differs from rope_scaling's 32"):
        ModelRunner(path)


@pytest.mark.parametrize("rope_type, why", [("dynamic", "recomputes its frequencies from the sequence's length"),
                                            ("longrope", "switches from its short to its long factors")])
def test_per_length_rope_types_are_refused_saying_why(rope_type, why):
    rope = {"rope_type": rope_type, "factor": 2.0, "original_max_position_embeddings": ORIGINAL}
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}' is not supported: .*{why}"):
        rope_params({"rope_scaling": rope})
