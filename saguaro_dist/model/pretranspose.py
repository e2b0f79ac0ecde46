"""On a CPU, keep each linear's weight as [in, out] and multiply x @ W.

F.linear multiplies by the [out, in] weight transposed, and torch's CPU GEMM takes that path at a
per-call cost that dominates small matmuls: measured at 1-12 rows (decode, a verify, a draft's branch
step) the [in, out] layout ran 1.3-2.2x faster, and within noise either way at 192-512 rows (prefill).
A demo-draft tree of 4 branch steps went 3.80 -> 3.38 ms. GPUs are left as they are (cuBLAS takes
either layout at the same speed). Applied to a built, loaded model, like model/fuse.py.
"""
from __future__ import annotations

import torch
from torch import nn

from saguaro_dist.model.layers import PlainModule

TIED_TABLE_LIMIT = 64 << 20  # bytes: a tied head is copied (the embedding keeps the rows) only when small


class PretransposedLinear(PlainModule):
    """y = x @ weight_t (+ bias), weight_t [in, out] contiguous: the same map as the nn.Linear it replaces."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def _worth_it(linear: nn.Linear, shared: set[int]) -> bool:
    """A weight another module shares (a tied LM head) is copied, not moved: only if it is small."""
    w = linear.weight
    return id(w) not in shared or w.numel() * w.element_size() <= TIED_TABLE_LIMIT


def pretranspose_linears(model: nn.Module) -> None:
    """Swap every plain nn.Linear (not the tensor-parallel ones, which all-reduce) in place."""
    shared = {id(p) for m in model.modules() if type(m) is not nn.Linear for p in m.parameters(recurse=False)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and _worth_it(child, shared):
                setattr(parent, name, PretransposedLinear(child))
