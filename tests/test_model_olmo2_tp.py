"""OLMo 2 under tensor parallel: its q / k RMSNorms span the whole projection (every head), so each rank
normalises its heads' slice with the mean square all ranks' sums of squares give. 2 gloo ranks give 1 rank's
logits (and transformers') on prefill, decode and tree branches, in fp32 and in bf16; rank 1 rank 0's to the bit."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from model_checks import hf_logits, random_tokens, runner_logits, save_seeded
from test_model_tp import gloo_world, rendezvous, workload
from transformers import Olmo2Config, Olmo2ForCausalLM

from saguaro_dist.model.runner import ModelRunner

pytestmark = pytest.mark.slow

# 8 query heads over 4 key / value heads: each rank holds 4 and 2, half of each norm's width
CONFIG = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 128,
          "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False}
SEQ = random_tokens(3, 14, CONFIG["vocab_size"])


def _rank(rank: int, init_method: str, path: str, result_file: str) -> None:
    """Each rank's logits: the TP workload in fp32 and in bf16, and runner_logits of SEQ (fp32)."""
    torch.set_num_threads(1)
    with gloo_world(rank, 2, init_method) as group:
        result = {"fp32": workload(ModelRunner(path, tp_group=group)),
                  "bf16": workload(ModelRunner(path, tp_group=group, dtype=torch.bfloat16)),
                  "seq": runner_logits(ModelRunner(path, tp_group=group), SEQ)}
        torch.save(result, f"{result_file}.{rank}")


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    path = tmp_path_factory.mktemp("olmo2")
    torch.set_num_threads(1)
    model = save_seeded(path, Olmo2ForCausalLM, lambda: Olmo2Config(**CONFIG), seed=7)
    mp.spawn(_rank, args=(rendezvous(), str(path), str(path / "out")), nprocs=2, join=True)
    return {"path": str(path), "model": model, "ranks": [torch.load(path / f"out.{r}") for r in (0, 1)]}


def test_the_norm_weights_are_split_by_heads(olmo2):
    """The checkpoint's norm weights are not flat (randomised): a rank normalising with the wrong slice, or
    dividing by its own width, would move the logits below."""
    norm = olmo2["model"].model.layers[0].self_attn.q_norm.weight
    assert not torch.allclose(norm[:norm.numel() // 2], norm[norm.numel() // 2:])


def test_two_ranks_equal_one_on_prefill_decode_and_branches_fp32(olmo2):
    got0, got1 = (r["fp32"] for r in olmo2["ranks"])
    want = workload(ModelRunner(olmo2["path"]))
    assert len(got0) == len(want) == 6
    for a, b, w in zip(got0, got1, want):
        assert a.shape == w.shape
        torch.testing.assert_close(a, w, atol=1e-5, rtol=0)
        torch.testing.assert_close(b, a, atol=0, rtol=0)


def test_two_ranks_give_transformers_logits(olmo2):
    got0, got1 = (r["seq"] for r in olmo2["ranks"])
    torch.testing.assert_close(got0, hf_logits(olmo2["model"], SEQ), atol=1e-5, rtol=0)
    torch.testing.assert_close(got1, got0, atol=0, rtol=0)


def test_two_ranks_follow_one_in_bf16(olmo2):
    """In bf16 only the sums of squares' order of additions differs from one rank's (the norm's ops, weight
    before the cast, are WeightFirstRMSNorm's): the logits agree to bf16's rounding, rank 1 rank 0's bitwise."""
    got0, got1 = (r["bf16"] for r in olmo2["ranks"])
    want = workload(ModelRunner(olmo2["path"], dtype=torch.bfloat16))
    for a, b, w in zip(got0, got1, want):
        assert a.dtype == w.dtype and a.shape == w.shape
        torch.testing.assert_close(a.float(), w.float(), atol=0.02, rtol=0)
        torch.testing.assert_close(b, a, atol=0, rtol=0)
