"""The model runtime against transformers' own forward on tiny seeded checkpoints, for the config shapes real
Llama / Qwen2 / Mistral checkpoints carry, and the load-time refusals of what it does not compute."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, LlamaModel, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from saguaro_dist.distributed import tp_runner
from saguaro_dist.model import ModelRunner
from saguaro_dist.model.prefix_cache import PrefixCache

VOCAB = 64
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, tie_word_embeddings=False)
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def save(model, path, dtype=None):
    """A seeded random model written by transformers; biases and norm weights randomised too (HF: 0 / 1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    (model if dtype is None else model.to(dtype)).save_pretrained(path)
    return path


def llama(path, seed=0, cls=LlamaForCausalLM, dtype=None, **changes):
    torch.manual_seed(seed)
    return save(cls(LlamaConfig(**{**BASE, **changes})).eval(), path, dtype)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(path, toks, dtype=torch.float32) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return hf(torch.tensor([toks])).logits[0].float()


def prefill_decode_branch(runner: ModelRunner, seq: list[int], path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of seq (half prefilled, then one token a step), and [2, len(path), V] of `path` as branches
    off seq[:-3] and off the whole of seq."""
    runner.add("s")
    half = len(seq) // 2
    got = [runner.extend(["s"], [seq[:half]], [half])[0]]
    got += [runner.extend(["s"], [[t]], [1])[0] for t in seq[half:]]
    state, first = runner.branch_start(["s", "s"], [len(seq) - 3, len(seq)], [path[0], path[0]])
    steps = [first] + [runner.branch_step(state, torch.tensor([t, t])) for t in path[1:]]
    runner.branch_end(state)
    runner.free("s")
    return torch.cat(got), torch.stack(steps, dim=1)


# -- bugs: each test failed before its fix -------------------------------------------------------

def test_a_bare_decoder_checkpoint_loads_as_transformers_loads_it(tmp_path):
    """LlamaModel.save_pretrained names tensors without the `model.` prefix (embed_tokens.weight, layers.0...);
    transformers adds it when it loads one into LlamaForCausalLM. It was refused as lacking every tensor."""
    path = llama(tmp_path / "bare", cls=LlamaModel, tie_word_embeddings=True)
    seq = tokens(1, 12)
    runner = ModelRunner(path)
    runner.add(0)
    torch.testing.assert_close(runner.extend([0], [seq], [12])[0], hf_logits(path, seq), atol=ATOL, rtol=0)
    untied = llama(tmp_path / "bare_untied", cls=LlamaModel)  # no head in it: refused, not random
    with pytest.raises(ValueError, match=r"lacks tensor\(s\): lm_head\.weight$"):
        ModelRunner(untied)


def test_query_heads_not_a_multiple_of_kv_heads_are_refused_at_load(tmp_path):
    """transformers writes such a checkpoint (and fails in its forward); it loaded here and every forward
    then failed with a reshape error."""
    path = llama(tmp_path / "kv3", num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        ModelRunner(path)


@pytest.mark.parametrize("rope, lacking", [
    ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}, "low_freq_factor, high_freq_factor, original_max"),
    ({"rope_type": "linear", "rope_theta": 1e4}, "factor"),
])
def test_a_rope_scaling_lacking_its_fields_is_refused_clearly(tmp_path, rope, lacking):
    """It was a bare KeyError from inside the RoPE tables."""
    path = llama(tmp_path / "rope")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = rope
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"rope_type '{rope['rope_type']}' lacks {lacking}"):
        ModelRunner(path)


def test_a_follower_survives_a_replayed_call_that_failed(tmp_path, monkeypatch):
    """Rank 0 broadcasts a call, then runs it; one its checks refuse raises on every rank alike. The
    follower's thread used to die of it, leaving rank 0 (whose engine resets and carries on) waiting
    forever in its next broadcast or collective."""
    runner = ModelRunner(llama(tmp_path / "ckpt"))
    messages = iter([("extend", (["x"], [[1, 2]], [1])),      # unknown sequence: ValueError on every rank
                     ("add", ("x",)), ("extend", (["x"], [[1, 2, 3]], [1])), (tp_runner.STOP, ())])

    def broadcast(objects, src, group):
        objects[0] = next(messages)
    monkeypatch.setattr(tp_runner.dist, "broadcast_object_list", broadcast)
    tp_runner.follow(runner, group=None)
    assert runner.length("x") == 3


# -- checked and found right: logits equal transformers' ------------------------------------------

VARIANTS = {
    "rope-linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "rope-llama3": dict(rope_scaling={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "theta-eps": dict(rope_theta=1234.0, rms_norm_eps=1e-2),
    "head-dim-16": dict(head_dim=16),          # head_dim != hidden / heads
    "biases": dict(attention_bias=True, mlp_bias=True),
    "mha": dict(num_key_value_heads=4),
    "mqa": dict(num_key_value_heads=1),
    "tied": dict(tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(tmp_path, variant):
    path = llama(tmp_path / variant, seed=3, **VARIANTS[variant])
    seq, branch = tokens(2, 40), tokens(3, 5)
    got, branch_got = prefill_decode_branch(ModelRunner(path), seq, branch)
    torch.testing.assert_close(got, hf_logits(path, seq), atol=ATOL, rtol=0)
    for got_branch, prefix in zip(branch_got, (seq[:-3], seq)):
        torch.testing.assert_close(got_branch, hf_logits(path, prefix + branch)[len(prefix):], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bf16_checkpoint_matches_transformers_at_the_same_dtype(tmp_path, dtype):
    path = llama(tmp_path / "bf16", dtype=torch.bfloat16)
    seq = tokens(4, 24)
    got, _ = prefill_decode_branch(ModelRunner(path, dtype=dtype), seq, [1, 2])
    torch.testing.assert_close(got, hf_logits(path, seq, dtype), atol=ATOL if dtype == torch.float32 else 2e-2, rtol=0)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])  # yarn: tests/test_rope_yarn.py
def test_rope_types_not_computed_are_refused(tmp_path, rope_type):
    path = llama(tmp_path / "rope")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}' is not supported"):
        ModelRunner(path)


def test_prefix_hits_and_evictions_keep_the_logits(tmp_path):
    """A prefix copied from a kept row, the kept row then evicted (its pool row reused by another
    sequence) while the copy decodes on: the logits of a plain prefill throughout."""
    path = llama(tmp_path / "ckpt", seed=5)
    runner = ModelRunner(path)
    cache = PrefixCache(runner, min_reuse=4)
    system = tokens(6, 20)
    cache.start("a", system)
    runner.extend(["a"], [system], [1])
    cache.finish("a", system)
    prompt = system + tokens(7, 5)
    assert cache.start("b", prompt) == 20
    got = runner.extend(["b"], [prompt[20:]], [5])[0]
    cache.clear()                                   # the kept row goes back to the pool ...
    cache.start("c", tokens(8, 30))                 # ... and another sequence overwrites it
    runner.extend(["c"], [tokens(8, 30)], [1])
    got = torch.cat([got, runner.extend(["b"], [[9, 10]], [2])[0]])
    torch.testing.assert_close(got, hf_logits(path, prompt + [9, 10])[20:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind, fields", [("mistral", {}), ("qwen2", {"use_sliding_window": True, "max_window_layers": 0})])
def test_a_config_without_sliding_window_gets_transformers_default(tmp_path, kind, fields):
    """transformers' Mistral / Qwen2 Config fills an absent sliding_window with 4096 (Qwen2's only when
    use_sliding_window), and its forward slides past that: so do the layers here, the context running on to
    max_position_embeddings (tests/test_sliding_window.py checks the sliding logits)."""
    cls, config = {"mistral": (MistralForCausalLM, MistralConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[kind]
    torch.manual_seed(0)
    path = save(cls(config(**{**BASE, "max_position_embeddings": 8192})).eval(), tmp_path / kind)
    cfg = {k: v for k, v in json.loads((path / "config.json").read_text()).items()
           if k not in ("sliding_window", "layer_types")}  # Qwen2's layer_types: derived from max_window_layers
    (path / "config.json").write_text(json.dumps({**cfg, **fields}))
    assert AutoConfig.from_pretrained(path).sliding_window == 4096
    runner = ModelRunner(path)
    assert runner.max_model_len == 8192 and runner.config.layer_windows == (4096, 4096)
    (path / "config.json").write_text(json.dumps(cfg))  # Qwen2 without use_sliding_window: no window
    assert AutoConfig.from_pretrained(path).sliding_window == (4096 if kind == "mistral" else None)
    assert ModelRunner(path).config.layer_windows == ((4096, 4096) if kind == "mistral" else ())
