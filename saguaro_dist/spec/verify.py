"""Lossless verification of a speculation by rejection sampling (batched, per-row generators).

Shapes: B rows (sequences), K draft tokens per row, V vocabulary. Position i (0-based) of
target_probs is p_{i+1}, the target's distribution for the token after the prefix plus x_1..x_i;
draft_probs[:, i] is q_{i+1}, the distribution x_{i+1} was really drawn from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from saguaro_dist.spec.sampling import Generators, greedy_tokens, one_hot_probs, row_uniforms, sample_with_uniforms

if TYPE_CHECKING:
    from saguaro_dist.spec.coupled import Coupling


@dataclass
class VerifyResult:
    accepted: torch.Tensor  # [B] int64: k*, the number of leading draft tokens accepted (0..K)
    bonus: torch.Tensor     # [B] int64: t*, the token sampled after them


def acceptance_ratios(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                      draft_probs: torch.Tensor | None) -> torch.Tensor:
    """ratio_i = min(1, p_i(x_i) / q_i(x_i)); q = None means one-hot on x (so ratio_i = p_i(x_i)).

    A token the draft could not have drawn (q_i(x_i) = 0) gets ratio [p_i(x_i) > 0].
    target_probs [B, K+1, V], draft_tokens [B, K], draft_probs [B, K, V] or None -> ratios [B, K].
    """
    k = draft_tokens.shape[1]
    idx = draft_tokens.unsqueeze(-1)
    p = target_probs[:, :k].gather(-1, idx).squeeze(-1)
    if draft_probs is None:
        return p
    q = draft_probs.to(p.dtype).gather(-1, idx).squeeze(-1)
    return torch.where(p >= q, (p > 0).to(p.dtype), p / q)


def first_rejection(ratios: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """accepted = max{k : u_i < ratio_i for all i < k}: the count of leading accepted tokens.

    ratios [B, K], uniforms [B, K] in [0, 1) -> accepted [B] int64 in 0..K.
    """
    accept = uniforms < ratios.to(uniforms.dtype)
    return accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """r = norm(max(0, p - q)). If p <= q everywhere (so a rejection had probability 0) r = p.

    p [N, V], q [N, V] -> r [N, V].
    """
    r = (p - q.to(p.dtype)).clamp_min(0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(total.dtype).tiny), p)


def bonus_probs(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                accepted: torch.Tensor) -> torch.Tensor:
    """The bonus token's distribution: residual(p_{k+1}, q_{k+1}) if k = accepted < K, else p_{K+1}.

    target_probs [B, K+1, V], draft_tokens [B, K], draft_probs [B, K, V] or None, accepted [B]
    -> probs [B, V].
    """
    b, k = draft_tokens.shape
    rows = torch.arange(b, device=accepted.device)
    p = target_probs[rows, accepted]
    pos = accepted.clamp(max=k - 1)  # rows with accepted = K take p_{K+1} below; any q position will do
    if draft_probs is None:
        q = one_hot_probs(draft_tokens[rows, pos], target_probs.shape[-1], p.dtype)
    else:
        q = draft_probs[rows, pos]
    return torch.where((accepted < k)[:, None], residual_probs(p, q), p)


def verify(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           generators: Generators = None, coupling: Coupling | None = None) -> VerifyResult:
    """Standard speculative rejection sampling; the emitted tokens follow the target exactly.

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) until the first rejection at position k;
    the bonus is drawn from norm(max(0, p_{k+1} - q_{k+1})) then, or from p_{K+1} if all K pass.
    Greedy (p, q one-hot): accept iff x_i = argmax p_i, bonus = argmax p at the first mismatch.
    Each row draws exactly K+1 uniforms from its own generator, whatever the outcome.

    target_probs [B, K+1, V]; draft_tokens [B, K] int64; draft_probs [B, K, V] or None (one-hot on
    draft_tokens: greedy or deterministic proposals such as n-gram); generators: B entries or None;
    coupling: the tree's candidates to draw the bonus against (spec/coupled.py: the same distribution).
    """
    b, k = draft_tokens.shape
    if target_probs.shape[:2] != (b, k + 1):
        raise ValueError(f"target_probs must be [B, K+1, V] = [{b}, {k + 1}, V], got {list(target_probs.shape)}")
    u = row_uniforms(generators, b, k + 1, target_probs.device)
    accepted = first_rejection(acceptance_ratios(target_probs, draft_tokens, draft_probs), u[:, :k])
    probs = bonus_probs(target_probs, draft_tokens, draft_probs, accepted)
    bonus = sample_with_uniforms(probs, u[:, k]) if coupling is None else coupling.draw(probs, accepted, u[:, k])
    return VerifyResult(accepted=accepted, bonus=bonus)


def greedy_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> VerifyResult:
    """verify() for rows that all decode greedily, from the logits. With p_i = one_hot(argmax logits_i),
    ratio_i = min(1, p_i(x_i) / q_i(x_i)) = [x_i = argmax_i] whatever q is, so k* is the count of
    leading matches; at a mismatch max(0, p - q) is zero off the argmax (and r falls back to p when it
    is zero everywhere), so t* = argmax at position k* either way (p_{K+1} when all K match). The same
    tokens as verify() on the one-hot p, without building [B, K+1, V] probabilities or drawing uniforms.

    target_logits [B, K+1, V]; draft_tokens [B, K] int64.
    """
    k = draft_tokens.shape[1]
    best = greedy_tokens(target_logits)                                                # [B, K+1]
    accepted = (best[:, :k] == draft_tokens).to(torch.int64).cumprod(dim=-1).sum(dim=-1)
    return VerifyResult(accepted=accepted, bonus=best.gather(1, accepted[:, None]).squeeze(1))


def emitted_tokens(draft_tokens: torch.Tensor, result: VerifyResult) -> list[list[int]]:
    """Per row, the tokens a round commits: x_1..x_{k*} then t*. draft_tokens [B, K] -> B lists."""
    drafts, accepted, bonus = draft_tokens.tolist(), result.accepted.tolist(), result.bonus.tolist()
    return [row[:n] + [t] for row, n, t in zip(drafts, accepted, bonus)]
