"""Fused projections compute exactly what the separate ones did (the parity tests cover whole models)."""
import torch
from torch import nn

from saguaro_dist.model.fuse import fuse_linears


def test_fused_linear_equals_the_parts_side_by_side():
    torch.manual_seed(0)
    parts = [nn.Linear(16, n, bias=True) for n in (16, 8, 8)]
    x = torch.randn(3, 5, 16)
    fused = fuse_linears(parts)
    expected = torch.cat([p(x) for p in parts], dim=-1)
    torch.testing.assert_close(fused(x), expected, rtol=0, atol=1e-6)
    assert not fused.weight.requires_grad


def test_fused_linear_without_bias():
    parts = [nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False)]
    fused = fuse_linears(parts)
    assert fused.bias is None and fused.weight.shape == (12, 4)
