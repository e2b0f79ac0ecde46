"""A heavier target that computes the same function: for benchmarks where the target must cost what a
real one does (a GPU makes the 4.5M-parameter demo target as cheap as its draft), without weights
we cannot download.

The Llama residual stream makes this exact: a layer whose attention output projection and MLP down
projection are zero adds exactly nothing to the stream, and MLP channels whose down-projection
columns are zero contribute nothing either. So the inflated model keeps the source's layers, widens
every MLP with dead channels and appends dead layers; its weights are real-sized and really read on
every forward, its logits are the source's up to summation order, and the demo draft's acceptance
against it is the demo pair's.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def inflate_llama(source: str, out_dir: str, *, extra_layers: int, intermediate_size: int,
                  dtype: str = "bfloat16") -> Path:
    """Write a checkpoint of `source` (a Llama) with `extra_layers` dead layers appended and every MLP
    widened to `intermediate_size`; returns out_dir. Its tokenizer files, if any, are copied too."""
    from transformers import AutoModelForCausalLM
    src = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    if src.config.model_type != "llama":
        raise ValueError(f"inflate_llama needs a llama checkpoint, got model_type {src.config.model_type!r}")
    if intermediate_size < src.config.intermediate_size or extra_layers < 0:
        raise ValueError("intermediate_size must be >= the source's and extra_layers >= 0")
    big = _empty_like(src, src.config.num_hidden_layers + extra_layers, intermediate_size)
    with torch.no_grad():
        _copy_into(src, big)
    big.to(getattr(torch, dtype)).save_pretrained(out_dir)
    _copy_tokenizer(source, out_dir)
    log.info("inflated %s -> %s: %.0fM parameters", source, out_dir, sum(p.numel() for p in big.parameters()) / 1e6)
    return Path(out_dir)


def _empty_like(src, layers: int, intermediate_size: int):
    """A randomly initialised model of the bigger shape (random weights keep the dead channels'
    matrix work honest: no zero fast paths)."""
    config = src.config.__class__.from_dict({**src.config.to_dict(), "num_hidden_layers": layers,
                                             "intermediate_size": intermediate_size})
    return src.__class__(config).eval()


def _copy_into(src, big) -> None:
    """Source weights into big's leading slots; dead channels and dead layers write zeros to the stream."""
    big_params = dict(big.named_parameters())
    for name, p in src.named_parameters():
        dst = big_params[name]
        dst[tuple(slice(0, n) for n in p.shape)] = p
        if name.endswith("mlp.down_proj.weight"):
            dst[:, p.shape[1]:] = 0                      # dead channels: nothing reaches the stream
    for layer in big.model.layers[src.config.num_hidden_layers:]:
        layer.self_attn.o_proj.weight.zero_()             # dead layer: the residual passes unchanged
        layer.mlp.down_proj.weight.zero_()


def _copy_tokenizer(source: str, out_dir: str) -> None:
    src = Path(source)
    if not src.is_dir():
        return
    for f in src.iterdir():
        if f.suffix in (".json", ".model", ".txt") and f.name not in ("config.json", "generation_config.json") \
                and not f.name.endswith(".index.json"):
            (Path(out_dir) / f.name).write_bytes(f.read_bytes())
