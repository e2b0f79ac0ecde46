"""The inflated target (bench/inflate.py): bigger, and the same function as its source."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from saguaro_dist.bench.inflate import inflate_llama

TOKENS = torch.tensor([[3, 17, 5, 42, 8, 1, 60, 2, 9, 33]])


def logits_and_size(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits[0], sum(p.numel() for p in model.parameters()), model.config


@pytest.mark.parametrize("kind", ["llama", "tied"])
def test_inflated_target_computes_the_source_function(tiny_checkpoint, tmp_path, kind):
    src = tiny_checkpoint(kind)
    out = inflate_llama(str(src), str(tmp_path / "big"), extra_layers=3, intermediate_size=256, dtype="float32")
    want, small, _ = logits_and_size(src)
    got, big, config = logits_and_size(out)
    assert (config.num_hidden_layers, config.intermediate_size) == (5, 256)
    assert big > 3 * small
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_inflate_refuses_what_it_cannot_keep_exact(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="llama"):
        inflate_llama(str(tiny_checkpoint("qwen3")), str(tmp_path / "q"), extra_layers=1, intermediate_size=256)
    with pytest.raises(ValueError, match="intermediate_size"):
        inflate_llama(str(tiny_checkpoint("llama")), str(tmp_path / "l"), extra_layers=1, intermediate_size=8)
