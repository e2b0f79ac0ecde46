"""Which verification outcomes (k, t*) to prepare speculations for: the draft's likeliest bonus tokens."""
from __future__ import annotations

from collections.abc import Callable, Sequence
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
    sigma_{F,C} pushed the residual towards); or [B, K, V] for a tree without the all-accepted outcome
    (its draft has not run x_K). draft_tokens [B, K]; fanout: one int per position, F_k <= V-1 (k < K)
    and F_K <= V, at least one branch in all (F_k = 0: no candidate there, as for k < K in a 1-token
    vocabulary). Returns a BranchSet with N = sum(fanout).
    """
    b, positions, v = draft_probs.shape
    k = draft_tokens.shape[1]
    caps = [v - 1] * k + [v]
    if (positions not in (k, k + 1) or len(fanout) != positions or sum(fanout) < 1
            or any(not 0 <= f <= c for f, c in zip(fanout, caps))):
        raise ValueError(f"fanout must be {positions} ints, 0 <= F_k <= V-1 (k < K), F_K <= V, summing to >= 1; "
                         f"got {list(fanout)}")
    # -1 sorts the drafted token below every real probability (>= 0) without touching the input.
    masked = draft_probs.clone()
    masked[:, :k].scatter_(-1, draft_tokens.unsqueeze(-1), -1.0)
    top = masked.topk(max(fanout), dim=-1).indices  # one topk for all positions, sliced per position below
    bonus = torch.cat([top[:, j, :f] for j, f in enumerate(fanout)], dim=1)
    accepted = torch.repeat_interleave(torch.arange(positions), torch.tensor(list(fanout)))
    return BranchSet(accepted=accepted.to(bonus.device).expand(b, -1).contiguous(), bonus=bonus)


def without_full_acceptance(fanout: Sequence[int], vocab_size: int) -> list[int]:
    """F_0..F_{K-1} for a tree that skips k = K (its draft has not run x_K): F_K's branches go to its
    neighbour k = K - 1 (at most V - 1 there), so the budget stays B where it can."""
    return [*fanout[:-2], min(fanout[-2] + fanout[-1], vocab_size - 1)]


def full_acceptance_worth_skipping(outcome_probs: Sequence[float], fanout: Sequence[int],
                                   hit_probability: Callable[[int], float]) -> bool:
    """Whether a tree that leaves out k = K (one draft forward fewer, F_K's branches moved to k = K - 1)
    loses fewer hits than it is worth; hit_probability(F): P(hit) of an outcome prepared with F branches.
    A miss costs about a just-in-time draft, K forwards; the skip saves one: worth it while the hits lost
    per round, times K, stay under 1. A draft that is usually right to the end (P(k = K) high) keeps it."""
    k = len(fanout) - 1
    lost = outcome_probs[k] * hit_probability(fanout[k])
    if k:
        moved = hit_probability(fanout[k - 1] + fanout[k]) - hit_probability(fanout[k - 1])
        lost -= outcome_probs[k - 1] * moved
    return lost * k < 1.0
