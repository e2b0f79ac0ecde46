"""Which verification outcomes (k, t*) to prepare speculations for: the draft's likeliest bonus tokens."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class BranchSet:
    accepted: torch.Tensor  # [B, N] int64: k, the outcome position each branch answers (N = sum F_k)
    bonus: torch.Tensor     # [B, N] int64: t, the candidate bonus token


def select_branches(draft_probs: torch.Tensor, draft_tokens: torch.Tensor, fanout: Sequence[int]) -> BranchSet:
    """Candidates per outcome: for k < K, top-F_k of draft_probs[:, k] excluding draft_tokens[:, k]
    (a rejected x_{k+1} has residual max(0, p - q)(x_{k+1}) = 0, so it can never be the bonus);
    for k = K, top-F_K of draft_probs[:, K]. Branches are ordered by k, then by descending probability.

    draft_probs [B, K+1, V]: position k is the draft's distribution for the token after prefix +
    x_1..x_k (pass the draft's own z, before Saguaro scaling, so the cached tokens are the ones
    sigma_{F,C} pushed the residual towards); draft_tokens [B, K]; fanout: K+1 ints with
    F_k <= V-1 (k < K) and F_K <= V. Returns a BranchSet with N = sum(fanout).
    """
    b, k_plus_1, v = draft_probs.shape
    k = k_plus_1 - 1
    if len(fanout) != k_plus_1 or any(f < 1 for f in fanout) or max(fanout[:k], default=0) > v - 1 or fanout[k] > v:
        raise ValueError(f"fanout must be {k_plus_1} ints, 1 <= F_k <= V-1 (k < K), F_K <= V; got {list(fanout)}")
    # -1 sorts the drafted token below every real probability (>= 0) without touching the input.
    masked = draft_probs.clone()
    masked[:, :k].scatter_(-1, draft_tokens.unsqueeze(-1), -1.0)
    top = masked.topk(max(fanout), dim=-1).indices  # one topk for all positions, sliced per position below
    bonus = torch.cat([top[:, j, :f] for j, f in enumerate(fanout)], dim=1)
    positions = torch.repeat_interleave(torch.arange(k_plus_1), torch.tensor(list(fanout)))
    return BranchSet(accepted=positions.to(bonus.device).expand(b, -1).contiguous(), bonus=bonus)
