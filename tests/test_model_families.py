"""IBM Granite (model_type "granite") and AI2 OLMo 2 ("olmo2"): logits as transformers' GraniteForCausalLM /
Olmo2ForCausalLM compute them on tiny seeded checkpoints, greedy ar / sd / ssd as its generate (a draft of the
same family), their config fields validated at load, and the Llama path left without an added op."""
from __future__ import annotations

import json

import pytest
import torch
from model_checks import (check_batched_extends, check_bf16_prefill_bitwise, check_greedy_generation, check_logits,
                          check_static_steps, check_two_branches, perturbed_pair, random_tokens, runner_logits,
                          save_seeded, two_rank_logits)
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (AutoModelForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM,
                          Olmo2Config, Olmo2ForCausalLM)

from saguaro_dist.model.hf_config import parse_config
from saguaro_dist.model.runner import ModelRunner

VOCAB = 64
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": None,
          "eos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False}
# Granite 3.x 2B's scalars (attention_multiplier 1/64, not 1/sqrt(head_dim)); logits_scaling flattens the logits
GRANITE_SCALARS = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
                   "logits_scaling": 8.0}
# Granite 3.x ties its LM head to the embeddings (which embedding_multiplier scales only as they are read)
FAMILIES = {"granite": (GraniteForCausalLM, lambda: GraniteConfig(**{**COMMON, "tie_word_embeddings": True},
                                                                  **GRANITE_SCALARS)),
            "olmo2": (Olmo2ForCausalLM, lambda: Olmo2Config(**COMMON))}
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def save_family(path, family: str, seed: int = 0, sharpen: float = 1.0):
    """A seeded tiny checkpoint written by transformers; norms randomised (HF: ones), q and k scaled up (HF's
    init makes attention near uniform, whatever its scale: a wrong scale would pass unseen), the LM head
    scaled by `sharpen` (peaked distributions, as a real LM's, for the greedy runs)."""
    return save_seeded(path, *FAMILIES[family], seed, sharpen)


def reloaded(path):
    """transformers' own fp32 load of a saved checkpoint: the reference these tests read."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tokens(seed: int, n: int) -> list[int]:
    return random_tokens(seed, n, VOCAB)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_in_prefill_and_decode(tmp_path, family):
    model = save_family(tmp_path / family, family, seed=3)
    assert type(model).__name__.lower().startswith(family)
    check_logits(tmp_path / family, reloaded(tmp_path / family), tokens(2, 24))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_prefill_matches_transformers_bit_for_bit(tmp_path, family):
    """In bf16 the order of roundings shows: OLMo 2 keeps its cos / sin in fp32 (q and k rotate in fp32),
    and its norms multiply the weight before the cast. A whole prompt is bitwise transformers' (as Llama's)."""
    save_family(tmp_path / family, family, seed=3)
    check_bf16_prefill_bitwise(tmp_path / family, tokens(2, 16))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_extend_of_mixed_lengths_matches_transformers(tmp_path, family):
    """The masked dense path (sequences at different positions in one forward), not the causal kernel."""
    save_family(tmp_path / family, family, seed=4)
    check_batched_extends(tmp_path / family, reloaded(tmp_path / family), [tokens(7, 9), tokens(8, 5)], [[4], [2]])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_branch_steps_match_transformers(tmp_path, family):
    """The tree-branch path (a draft's, or a target's in SSD): branches over one stored prefix, stepped."""
    save_family(tmp_path / family, family, seed=5)
    check_two_branches(tmp_path / family, reloaded(tmp_path / family), tokens(9, 7))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_static_steps_cuda_graphs_capture_give_the_eager_logits(tmp_path, family):
    """StaticBatch / StaticBranchBatch (run uncaptured here; captured on a GPU) take the family's scale too."""
    save_family(tmp_path / family, family, seed=6)
    check_static_steps(tmp_path / family)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"pair_{request.param}")
    torch.set_num_threads(1)
    sharpen = 4.0 * (GRANITE_SCALARS["logits_scaling"] if request.param == "granite" else 1.0)
    return perturbed_pair(root, save_family(root / "target", request.param, seed=0, sharpen=sharpen))


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_generation_matches_transformers_generate(family_pair, mode):
    check_greedy_generation(family_pair, mode, tokens(5, 12), 24)


class _OpCounter(TorchDispatchMode):
    """Every aten op a forward runs, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def decode_ops(path) -> list[str]:
    runner = ModelRunner(path)
    runner.add("s")
    runner.extend(["s"], [tokens(1, 6)], [1])
    with _OpCounter() as counter:
        runner.extend(["s"], [[3]], [1])
    return counter.ops


def test_scalars_of_one_add_no_op_to_the_llama_path(tmp_path):
    """A Granite checkpoint whose multipliers are 1 (attention_multiplier 1/sqrt(head_dim)) runs exactly
    Llama's decode ops; real Granite scalars add one multiply per sublayer, one for the embeddings and one
    divide for the logits."""
    unit = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 8 ** -0.5,
            "logits_scaling": 1.0}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**COMMON)).save_pretrained(tmp_path / "llama")
    GraniteForCausalLM(GraniteConfig(**COMMON, **unit)).save_pretrained(tmp_path / "unit")
    GraniteForCausalLM(GraniteConfig(**COMMON, **GRANITE_SCALARS)).save_pretrained(tmp_path / "granite")
    llama = decode_ops(tmp_path / "llama")
    assert decode_ops(tmp_path / "unit") == llama
    granite = decode_ops(tmp_path / "granite")
    extra = {op: granite.count(op) - llama.count(op) for op in set(granite)}
    assert {op: n for op, n in extra.items() if n} == {"aten.mul": 2 * COMMON["num_hidden_layers"] + 1, "aten.div": 1}


def granite_json(**changes) -> dict:
    return {**GraniteConfig(**COMMON, **GRANITE_SCALARS).to_dict(), **changes}


@pytest.mark.parametrize("key", list(GRANITE_SCALARS))
@pytest.mark.parametrize("value", [0, -1.0, "8", None, float("inf")])
def test_bad_granite_scalars_are_refused_clearly(key, value):
    with pytest.raises(ValueError, match=f"model_type 'granite'\\) {key} must be a finite number > 0, got"):
        parse_config(granite_json(**{key: value}))


def test_granite_scalars_default_to_one_as_transformers_reads_them():
    hf = {k: v for k, v in granite_json().items() if k not in GRANITE_SCALARS}
    cfg = parse_config(hf)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_scaling) == (1, 1, 1, 1)


def test_olmo2_reads_its_own_norm_eps_default():
    hf = {k: v for k, v in Olmo2Config(**COMMON).to_dict().items() if k != "rms_norm_eps"}
    cfg = parse_config(hf)
    assert cfg.rms_norm_eps == 1e-5 and cfg.post_norms and not cfg.qk_norm


def test_a_family_still_unsupported_is_refused_naming_the_supported_ones(tmp_path):
    save_family(tmp_path / "m", "olmo2")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "olmo"}))
    with pytest.raises(ValueError, match="model_type 'olmo'.*supported model_type: .*granite, olmo2"):
        ModelRunner(tmp_path / "m")


def test_a_granite_hidden_act_other_than_silu_is_refused():
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        parse_config(granite_json(hidden_act="gelu"))


# ---- tensor parallel: Granite's scalars split as Llama's; OLMo 2's whole-projection q / k norms over all ranks ----
@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_two_ranks(tmp_path, family):
    """Over 2 ranks: the one-rank logits (OLMo 2's q / k norms, each spanning every head, from all ranks' sums
    of squares; tests/test_model_olmo2_tp.py checks its branches and bf16)."""
    save_family(tmp_path / "m", family)
    got = two_rank_logits(tmp_path / "m", tokens(3, 12))
    want = runner_logits(ModelRunner(str(tmp_path / "m")), tokens(3, 12))
    torch.testing.assert_close(got[0], want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], got[0], atol=0, rtol=0)
