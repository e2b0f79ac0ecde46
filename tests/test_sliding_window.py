"""Sliding-window attention (Mistral: every layer; Qwen2 / Qwen3 with use_sliding_window: the layers
transformers' layer_types marks "sliding_attention") computed as transformers computes it, on every attention
path (prefill, chunked prefill, decode, batched extend, branch steps, the static CUDA-graph steps), on tiny
seeded checkpoints whose prompts run well past the window; the context no longer capped at the window."""
from __future__ import annotations

import pytest
import torch
from model_checks import (check_batched_extends, check_branch_steps, check_greedy_generation, check_logits,
                          check_static_steps, hf_logits, perturbed_pair, random_tokens, save_seeded)
from test_model_families import decode_ops
from test_step_graphs import static_runner
from transformers import (AutoConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from saguaro_dist.model import attention, branch, static_branch
from saguaro_dist.model.hf_config import parse_config
from saguaro_dist.model.runner import ModelRunner

VOCAB, WINDOW = 64, 6
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": None,
          "eos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False}
QWEN = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}  # layer 0 full, 1-2 sliding
FAMILIES = {"mistral": (MistralForCausalLM, lambda: MistralConfig(**COMMON, sliding_window=WINDOW)),
            "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**COMMON, **QWEN)),
            "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**COMMON, **QWEN, head_dim=8))}
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def save_family(path, family: str, seed: int = 0, sharpen: float = 1.0):
    """A seeded tiny checkpoint written by transformers; q and k scaled up so attention is far from uniform
    (a key wrongly seen or hidden then moves the logits), the LM head by `sharpen` (for the greedy runs)."""
    return save_seeded(path, *FAMILIES[family], seed, sharpen)


def tokens(seed: int, n: int) -> list[int]:
    return random_tokens(seed, n, VOCAB)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "m"
    torch.set_num_threads(1)
    return {"name": request.param, "path": path, "model": save_family(path, request.param, seed=3)}


# ---- which layers slide, and the context ----------------------------------------------------------
def test_each_layer_slides_as_transformers_marks_it(family):
    cfg = parse_config(AutoConfig.from_pretrained(family["path"]).to_dict())
    want = (WINDOW,) * 3 if family["name"] == "mistral" else (None, WINDOW, WINDOW)
    assert cfg.layer_windows == want
    if family["name"] != "mistral":
        assert family["model"].config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]


@pytest.mark.parametrize("cls", [Qwen2Config, Qwen3Config])
def test_qwen_without_layer_types_derives_them_from_max_window_layers(cls):
    hf = {k: v for k, v in cls(**COMMON, **{**QWEN, "max_window_layers": 2}).to_dict().items() if k != "layer_types"}
    assert parse_config(hf).layer_windows == (None, None, WINDOW)
    assert parse_config({**hf, "use_sliding_window": False}).layer_windows == ()  # transformers: no window then
    with pytest.raises(ValueError, match="layer_types has 'sliding_attention' layers but no sliding window"):
        parse_config({**hf, "use_sliding_window": False, "layer_types": ["sliding_attention"] * 3})


def test_a_bad_window_is_refused():
    hf = MistralConfig(**COMMON).to_dict()
    for bad in (0, -2, "8", True):
        with pytest.raises(ValueError, match="sliding_window must be a positive integer or null"):
            parse_config({**hf, "sliding_window": bad})


def test_max_model_len_is_max_position_embeddings_not_the_window(family):
    assert ModelRunner(family["path"]).max_model_len == COMMON["max_position_embeddings"]


# ---- logits on every path -------------------------------------------------------------------------
def test_prefill_and_decode_match_transformers(family):
    check_logits(family["path"], family["model"], tokens(2, 40))  # 20 prefilled (from the start), 20 decoded


def test_a_chunked_prefill_matches_transformers(family):
    """Chunks after the first extend stored KV: the masked path, its window over the earlier chunks' keys."""
    seq = tokens(4, 40)
    runner = ModelRunner(family["path"], max_num_batched_tokens=7)
    runner.add("s")
    got = runner.extend(["s"], [seq], [len(seq)])[0]
    torch.testing.assert_close(got, hf_logits(family["model"], seq), atol=ATOL, rtol=0)


def test_batched_extend_of_mixed_lengths_matches_transformers(family):
    """Rows at different positions in one forward (the masked path), then a batched decode step."""
    seqs, firsts = [tokens(7, 39), tokens(8, 30), tokens(9, 36)], [3, 20, 9]
    cuts = [[first, len(seq) - 1] for seq, first in zip(seqs, firsts)]  # the last piece: one token each
    check_batched_extends(family["path"], family["model"], seqs, cuts)


def branch_run(runner: ModelRunner, model, depth: int) -> None:
    """Branches of two sequences (prefixes 33 and 27: the window's start differs per branch), stepped
    `depth` times: past the window, a branch's own first private keys leave it too."""
    prefixes, paths = {"s": tokens(10, 33), "t": tokens(11, 27)}, [tokens(20 + i, depth) for i in range(3)]
    check_branch_steps(runner, model, prefixes, ["s", "t", "s"], paths)


def test_branch_steps_match_transformers(family):
    branch_run(ModelRunner(family["path"]), family["model"], depth=WINDOW + 3)


def test_static_branch_steps_match_transformers(family):
    """StaticBranchBatch (captured on a GPU; run uncaptured here), to its depth cap of 8: past the window."""
    branch_run(static_runner(family["path"]), family["model"], depth=8)


def test_the_static_steps_give_the_eager_logits(family):
    """StaticBatch / StaticBranchBatch against ExtendBatch / BranchBatch over test_step_graphs' steps
    (sequences growing past 128 positions: far past the window)."""
    check_static_steps(family["path"])


def test_static_decode_and_verify_match_transformers(family):
    runner, seq = static_runner(family["path"]), tokens(12, 40)
    runner.add("s")
    got = [runner.extend(["s"], [seq[:30]], [1])[0]]  # eager prefill, then graph-path steps of 1 and 3 tokens
    got += [runner.extend(["s"], [seq[i:i + n]], [n])[0] for i, n in ((30, 1), (31, 3), (34, 3), (37, 3))]
    torch.testing.assert_close(torch.cat(got), hf_logits(family["model"], seq)[29:], atol=ATOL, rtol=0)


# ---- the tests see the window's boundary ----------------------------------------------------------
@pytest.mark.parametrize("shift", [-1, 1])
def test_a_window_off_by_one_fails_these_checks(family, monkeypatch, shift):
    """The window moved by one position either way (one key more or fewer) is caught on every path."""
    def off_by_one(key_pos, query_pos, window):
        return key_pos > query_pos - window - shift

    for module in (attention, branch, static_branch):
        monkeypatch.setattr(module, "in_window", off_by_one)
    checks = [lambda: test_prefill_and_decode_match_transformers(family),
              lambda: test_batched_extend_of_mixed_lengths_matches_transformers(family),
              lambda: test_branch_steps_match_transformers(family),
              lambda: test_static_branch_steps_match_transformers(family),
              lambda: test_static_decode_and_verify_match_transformers(family)]
    for check in checks:
        with pytest.raises(AssertionError, match="Tensor-likes are not close"):
            check()


def test_a_window_not_yet_reached_adds_no_op_to_decode(tmp_path):
    """Llama's decode ops, and a sliding model's while its keys fit in the window: no mask built."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**COMMON)).save_pretrained(tmp_path / "llama")
    MistralForCausalLM(MistralConfig(**COMMON, sliding_window=100)).save_pretrained(tmp_path / "mistral")
    assert decode_ops(tmp_path / "mistral") == decode_ops(tmp_path / "llama")


# ---- greedy generation ----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(FAMILIES))
def family_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"pair_{request.param}")
    torch.set_num_threads(1)
    return perturbed_pair(root, save_family(root / "target", request.param, seed=0, sharpen=4.0))


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_generation_matches_transformers_generate(family_pair, mode):
    check_greedy_generation(family_pair, mode, tokens(5, 40), 20)
