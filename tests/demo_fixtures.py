"""Tiny demo-export material shared by the demo export tests (a pytest plugin: `pytest_plugins = ["demo_fixtures"]`)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from saguaro_dist.demo.tokenizer import train_tokenizer, wrap_fast

SOURCE = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(40))


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))


def files(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def fast_tok():
    return wrap_fast(train_tokenizer([SOURCE] * 4, 300), 64)
