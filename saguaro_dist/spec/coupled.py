"""Coupled bonus draws: a tree's bonus candidates drawn at random from the draft's guess of the bonus's
distribution, and the bonus then drawn against those candidates, so that it lands on one of them as
often as the guess overlaps the truth.

The bonus t* of outcome k is drawn from r = norm(max(0, p_k - q_k)) (a rejection at position k) or
p_{K+1} (all K accepted). However t* is drawn, P(t* in S) = r(S) for a candidate set S fixed in
advance: a tree of the draft's top-F tokens hits that often and no more. Draw the candidates
y_1..y_F at random instead, without replacement, from a guess g of r that the draft can make
(bonus_guess), and draw t* by speculative sampling against them in turn:

    r_1 = r, g_1 = g;  for i = 1..F: accept y_i with probability min(1, r_i(y_i) / g_i(y_i)), else
    r_{i+1} = norm(max(0, r_i - g_i)) and g_{i+1} = norm(g_i without y_i);  none accepted: t* ~ r_{F+1}.

Each step is one token of speculative sampling, which returns its target exactly for any proposal
(Leviathan et al. 2023, Theorem 1), so t* ~ r exactly; and g_{i+1} may depend on y_i, as r_{i+1} does
not. With one candidate t* = y_1 with probability sum_t min(r(t), g(t)) = 1 - TV(r, g), against
max_t r(t) for the draft's top-1: at T = 0.7 on the demo pair 0.57 against 0.23 over all outcomes
(benchmarks/bench_coupled_bonus.py, one candidate per outcome). Greedy rows gain nothing (r is one-hot): they keep top-F.

The guess travels from the draft to the target with the tree's plan, truncated to its GUESS_TOP likeliest
tokens per outcome: the truncated guess is what the candidates are drawn from, so exactness holds, and
only the tail's overlap with r is lost (at V = 128256 the full guess would be 2.5 MB a sequence a round).

Shapes: N rows, V vocabulary, F candidates per row, P outcome positions (K + 1, or K for a tree
without k = K), M kept tokens of a guess.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro_dist.spec.sampling import sample_with_uniforms
from saguaro_dist.spec.verify import residual_probs

GUESS_TOP = 256  # tokens of each outcome's guess kept: the candidates are drawn from them alone


@dataclass
class Coupling:
    """The target's side of coupled bonus draws for a batch: per row and outcome position, the draft's
    guess and the candidates drawn from it, with the row's uniforms for them. A row the draft drew no
    candidates for has candidates -1 throughout: its bonus is drawn as without coupling."""
    guess_ids: torch.Tensor    # [B, K+1, M] int64: g_k's kept tokens (sparse_guess) ...
    guess_probs: torch.Tensor  # [B, K+1, M] float: ... and their probabilities (zeros where there is no guess)
    candidates: torch.Tensor   # [B, K+1, F] int64: per outcome its candidates in draw order, -1 padded
    uniforms: torch.Tensor     # [B, F] float64 in [0, 1): one per candidate slot, from a stream of the row's own

    def draw(self, residual: torch.Tensor, accepted: torch.Tensor, last_uniform: torch.Tensor) -> torch.Tensor:
        """t* per row: residual [B, V] is outcome `accepted` [B]'s bonus distribution; last_uniform [B] the
        row's uniform for a draw from the last residual (verify's own bonus uniform) -> [B] int64. Only the
        outcome that happened is made dense: [B, V], not [B, K+1, V] (20 MB a round at V = 128256, b = 8)."""
        rows = torch.arange(residual.shape[0], device=residual.device)
        guess = dense_guess(self.guess_ids[rows, accepted], self.guess_probs[rows, accepted].to(residual.dtype),
                            residual.shape[1])
        uniforms = torch.cat([self.uniforms.to(last_uniform), last_uniform[:, None]], dim=1)
        return coupled_bonus(residual, guess, self.candidates[rows, accepted], uniforms)


def bonus_guess(draft_probs: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """g_k, the draft's guess of outcome k's bonus distribution: q_k without x_k (a rejected x_k has
    residual 0), renormalised, for k < K; q_{K+1}, the draft's next distribution, for k = K.

    draft_probs [B, K+1, V] (or [B, K, V] for a tree without k = K); draft_tokens [B, K] -> g, same shape.
    A row whose q_k held only x_k gets all zeros (no candidate can be drawn from it).
    """
    k = draft_tokens.shape[1]
    guess = draft_probs.clone()
    guess[:, :k].scatter_(-1, draft_tokens.unsqueeze(-1), 0.0)
    total = guess.sum(dim=-1, keepdim=True)
    return guess / total.clamp_min(torch.finfo(guess.dtype).tiny)


def sparse_guess(guess: torch.Tensor, top: int = GUESS_TOP) -> tuple[torch.Tensor, torch.Tensor]:
    """guess [P, V] truncated to each row's `top` likeliest tokens and renormalised, as (ids [P, M], probs
    [P, M]), M = min(top, V); a row of zeros stays zeros."""
    kept = guess.topk(min(top, guess.shape[-1]), dim=-1)
    total = kept.values.sum(dim=-1, keepdim=True)
    return kept.indices, kept.values / total.clamp_min(torch.finfo(kept.values.dtype).tiny)


def dense_guess(ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The [P, V] guess a sparse_guess (ids [P, M], probs [P, M]) stands for. Added, not set: a pad (id 0 at
    probability 0, Coupling's rows without a guess) leaves a real entry of that id as it was."""
    dense = torch.zeros(ids.shape[0], vocab_size, dtype=probs.dtype, device=probs.device)
    return dense.scatter_add_(1, ids, probs)


def sampled_branches(ids: torch.Tensor, probs: torch.Tensor, fanout, uniforms: torch.Tensor) -> list[tuple[int, int]]:
    """(k, t) per branch: F_k candidates drawn from outcome k's sparse guess (ids [P, M], probs [P, M]) by
    draw_candidates with uniforms [P, M], in draw order; a candidate of probability 0 (the guess's support
    used up) is left out. fanout: P ints."""
    return sampled_branches_of(ids[None], probs[None], [fanout], uniforms[None])[0]


def sampled_branches_of(ids: torch.Tensor, probs: torch.Tensor, fanouts: list, uniforms: torch.Tensor
                        ) -> list[list[tuple[int, int]]]:
    """sampled_branches for C guesses at once: ids, probs, uniforms [C, P, M]; fanouts: C lists of P ints. One
    race over the batch (~12 small ops a guess otherwise, 64 guesses a round): a guess's first F finishers are
    the same tokens, in the same order, whatever the batch's largest F."""
    f = min(max((max(fanout) for fanout in fanouts), default=0), ids.shape[-1])
    slots = draw_candidates(probs.flatten(0, 1), f, uniforms.flatten(0, 1)).view(*ids.shape[:2], f)
    drawn, live = ids.gather(-1, slots).tolist(), (probs.gather(-1, slots) > 0).tolist()
    return [[(k, t) for k, n in enumerate(fanout) for t, ok in zip(d[k][:n], a[k][:n]) if ok]
            for fanout, d, a in zip(fanouts, drawn, live)]


def draw_candidates(guess: torch.Tensor, f: int, uniforms: torch.Tensor) -> torch.Tensor:
    """F tokens per row drawn from `guess` one after another without replacement, as an exponential race:
    token t finishes at E_t / g(t), E_t ~ Exp(1) = -log(u_t); the first F to finish are such draws, in
    order (the Gumbel top-k trick). Tokens of probability 0 finish last, at infinity (drawn only once the
    guess's support is used up: coupled_bonus never accepts them).

    guess [N, V]; uniforms [N, V] in (0, 1) -> candidates [N, F] int64.
    """
    finish = -torch.log(uniforms.clamp_min(torch.finfo(uniforms.dtype).tiny)) / guess.to(uniforms.dtype)
    return finish.topk(f, dim=-1, largest=False).indices


def coupled_bonus(residual: torch.Tensor, guess: torch.Tensor, candidates: torch.Tensor,
                  uniforms: torch.Tensor) -> torch.Tensor:
    """t* ~ residual exactly, equal to one of `candidates` as often as their guess allows (module doc).

    residual [N, V] (r); guess [N, V] (g, what the candidates were drawn from by draw_candidates);
    candidates [N, F] int64 (-1: no candidate in that slot); uniforms [N, F + 1] in [0, 1): one per
    candidate, then one for the last residual -> t* [N] int64.
    """
    r, g = residual, guess.to(residual.dtype)  # never written: every update below makes new tensors
    rows = torch.arange(r.shape[0], device=r.device)
    bonus = torch.full((r.shape[0],), -1, dtype=torch.int64, device=r.device)
    # Whether a row has a candidate in slot i or later: the loop ends once no undecided row has one, and a
    # slot after which every row has its bonus skips the updates of r and g (~0.1 ms of [N, V] ops at b = 1
    # on a CPU) that only undecided rows would read. The uniforms were drawn up front, so where it ends
    # changes no draw; at T = 0.7 the first candidate is taken ~0.6 of the time.
    ahead = (candidates >= 0).flip(1).cumsum(1).flip(1) > 0
    for i in range(candidates.shape[1]):
        if not bool(((bonus < 0) & ahead[:, i]).any()):
            break
        y = candidates[:, i].clamp_min(0)
        g = g / g.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(g.dtype).tiny)
        gy, ry = g[rows, y], r[rows, y]
        # A candidate of guess 0 was not drawn (the guess's support ran out): it is never accepted.
        drawn = (candidates[:, i] >= 0) & (gy > 0)
        bonus = torch.where((bonus < 0) & drawn & (uniforms[:, i] * gy < ry), y, bonus)
        if bool((bonus >= 0).all()):
            return bonus
        r = torch.where(drawn[:, None], residual_probs(r, g), r)
        g = torch.where(drawn[:, None], g.scatter(1, y[:, None], 0.0), g)
    # Here some row is undecided (a row's bonus returns in the slot that decides the last one).
    return torch.where(bonus >= 0, bonus, sample_with_uniforms(r, uniforms[:, -1]))
