"""Tensor parallel over more ranks than KV heads (vLLM's KV head replicas: Gemma 3 1B's one KV head at TP = 2,
Qwen2.5-1.5B's two at TP = 4): each rank holds the one KV head its query heads read (k / v rows, biases, OLMo 2's
whole-projection k norm) and a KV cache of that head alone. On gloo CPU ranks, rank 0's logits are transformers'
(prefill then decode), every rank's rank 0's to the bit, and greedy decoding transformers' generate. What tensor
parallel still cannot split is refused from config.json before Ray starts."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_greedy_equal, hf_greedy
from model_checks import ATOL, hf_logits, randomise, random_tokens
from tp_ranks import rank_results
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Olmo2Config,
                          Olmo2ForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from saguaro_dist.config import Config
from saguaro_dist.distributed.cluster import check_tensor_parallel

VOCAB, PROMPT, NEW = 64, [5, 17, 3, 44, 9, 28, 61, 2], 10
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 256, "bos_token_id": None, "eos_token_id": None,
          "pad_token_id": None, "tie_word_embeddings": False}
GEMMA3 = {**COMMON, "num_hidden_layers": 3, "head_dim": 8, "sliding_window": 6, "query_pre_attn_scalar": 12,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
# family -> (model class, config of `kv` KV heads): Llama's and Qwen2's k / v biases, Gemma 3's per-head k norm,
# OLMo 2's k norm over the whole k projection (its replicated head's squares summed once per replica)
FAMILIES = {"llama": lambda kv: (LlamaForCausalLM, LlamaConfig(**COMMON, num_key_value_heads=kv, attention_bias=True)),
            "qwen2": lambda kv: (Qwen2ForCausalLM, Qwen2Config(**COMMON, num_key_value_heads=kv)),
            "gemma3": lambda kv: (Gemma3ForCausalLM, Gemma3TextConfig(**GEMMA3, num_key_value_heads=kv)),
            "olmo2": lambda kv: (Olmo2ForCausalLM, Olmo2Config(**COMMON, num_key_value_heads=kv))}


def save(path, family: str, kv_heads: int, seed: int):
    """A seeded tiny checkpoint (attention sharpened, biases off HF's zeros, a peaked LM head); the model."""
    cls, config = FAMILIES[family](kv_heads)
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomise(model, sharpen=4.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return model


def check_ranks(tmp_path, world: int, cases: list[tuple[str, int]]) -> None:
    """Each (family, KV heads) case over `world` ranks: one KV head a rank, transformers' logits and tokens."""
    models = [save(tmp_path / f"{f}{kv}", f, kv, seed=i) for i, (f, kv) in enumerate(cases)]
    paths = [str(tmp_path / f"{f}{kv}") for f, kv in cases]
    seq = random_tokens(3, 12, VOCAB)
    ranks = rank_results(tmp_path, world, paths, seq, PROMPT, NEW)
    for i, model in enumerate(models):
        first = ranks[0][i]
        assert first["kv_heads"] == 1, cases[i]
        torch.testing.assert_close(first["logits"], hf_logits(model, seq), atol=ATOL, rtol=0)
        assert_greedy_equal(first["greedy"], hf_greedy(model, PROMPT, NEW), PROMPT, model)
        for other in ranks[1:]:
            torch.testing.assert_close(other[i]["logits"], first["logits"], atol=0, rtol=0)
            assert other[i]["greedy"] == first["greedy"] and other[i]["kv_heads"] == 1


@pytest.mark.slow
def test_one_kv_head_over_two_ranks(tmp_path):
    check_ranks(tmp_path, 2, [("llama", 1), ("gemma3", 1), ("olmo2", 1)])


@pytest.mark.slow
def test_one_and_two_kv_heads_over_four_ranks(tmp_path):
    check_ranks(tmp_path, 4, [("llama", 1), ("qwen2", 2), ("olmo2", 2)])


def test_each_rank_reads_the_kv_head_of_its_query_heads():
    """Query heads split in order; query head h reads KV head h // (heads / kv_heads), as transformers' GQA."""
    from saguaro_dist.model.tp import kv_head_span, unsplittable
    assert [kv_head_span(1, r, 2) for r in range(2)] == [(0, 1)] * 2
    assert [kv_head_span(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_span(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    heads, kv, world = 8, 2, 8
    for rank in range(world):
        q_head = rank * heads // world
        assert kv_head_span(kv, rank, world) == (q_head // (heads // kv), q_head // (heads // kv) + 1)
    assert unsplittable({"num_attention_heads": 4, "num_key_value_heads": 1}, 4) == []
    assert unsplittable({"num_attention_heads": 12, "num_key_value_heads": 3}, 4) == ["num_key_value_heads=3"]
    assert unsplittable({"num_attention_heads": 6, "num_key_value_heads": 3}, 2) == ["num_key_value_heads=3"]


def tp_config(model: str, size: int) -> Config:
    return Config(model=model, mode="ar", cluster="auto", tensor_parallel_size=size)


def config_only(path, **changes):
    """A checkpoint folder holding only config.json (all check_tensor_parallel reads)."""
    LlamaConfig(**{**COMMON, "num_key_value_heads": 2, **changes}).save_pretrained(path)
    return str(path)


def test_fewer_kv_heads_than_ranks_pass_the_check_before_ray(tmp_path):
    for size, kv in ((2, 1), (4, 1), (4, 2)):
        check_tensor_parallel(tp_config(config_only(tmp_path / f"{size}{kv}", num_key_value_heads=kv), size))


@pytest.mark.parametrize("changes, size, message", [
    ({"num_attention_heads": 12, "hidden_size": 48, "num_key_value_heads": 3}, 4,
     r"attention heads \(num_key_value_heads = 3 in .*\(or, with fewer KV heads than ranks, be a multiple of "
     r"num_key_value_heads"),
    ({"intermediate_size": 66}, 4, r"tensor_parallel_size = 4 must divide the model's MLP widths "
                                   r"\(intermediate_size = 66 in .*'s config.json\)$"),
])
def test_what_tensor_parallel_cannot_split_fails_before_ray(tmp_path, changes, size, message):
    """An MLP width tp does not divide failed only once the Ray ranks built the model; now from config.json."""
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(tp_config(config_only(tmp_path, **changes), size))


def test_expert_widths_are_checked_before_ray(tmp_path):
    from transformers import Qwen2MoeConfig
    Qwen2MoeConfig(**{**COMMON, "num_key_value_heads": 2}, moe_intermediate_size=24, num_experts=4,
                   num_experts_per_tok=2, shared_expert_intermediate_size=25).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"MLP widths \(shared_expert_intermediate_size = 25 in "):
        check_tensor_parallel(tp_config(str(tmp_path), 2))
