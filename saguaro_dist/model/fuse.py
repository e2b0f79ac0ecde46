"""Fuse q/k/v into one projection and gate/up into another once the weights are loaded.

Decode on a CPU (and small batches on a GPU) is bound by per-op overhead, not FLOPs: one matmul with
the three outputs side by side costs about what one of the three did. Applied to a built model, after
tensor parallelism and loading, so both keep the checkpoint's tensor names; a tensor-parallel rank fuses
its own column slices (its local q, k, v heads), which is exactly its slice of the fused layer.
"""
from __future__ import annotations

import torch
from torch import nn


def fuse_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the parts' outputs concatenated (same input, no bias mixing)."""
    first = parts[0]
    has_bias = first.bias is not None
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=has_bias,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused.requires_grad_(False)


def fuse_projections(model: nn.Module) -> None:
    """qkv_proj replaces q_proj/k_proj/v_proj; gate_up_proj replaces gate_proj/up_proj (in place), in the
    dense MLP or in each expert (and shared expert) of a mixture-of-experts layer (model/moe.py)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        attn.qkv_sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        del attn.q_proj, attn.k_proj, attn.v_proj
        shared = [mlp.shared_expert] if hasattr(mlp, "shared_expert") else []  # Qwen2-MoE's
        for dense in [*getattr(mlp, "experts", [mlp]), *shared]:
            dense.gate_up_proj = fuse_linears([dense.gate_proj, dense.up_proj])
            del dense.gate_proj, dense.up_proj
