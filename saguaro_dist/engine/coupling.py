"""The target's side of coupled bonus draws (spec/coupled.py): a batch's Coupling from the plans of the
trees the draft builds while the batch verifies."""
from __future__ import annotations

import torch

from saguaro_dist.engine.messages import TreePlan
from saguaro_dist.engine.sequence import COUPLING_STREAM, Sequence, substream
from saguaro_dist.spec.coupled import Coupling


def plan_coupling(seqs: list[Sequence], plans: dict[int, TreePlan], k: int, vocab_size: int,
                  device: torch.device | str) -> Coupling | None:
    """Each sequence's candidates and guesses from its plan, if that carries guesses that fit this target
    (K, vocabulary); None if no sequence's does. A sequence without one keeps candidates -1: its bonus
    is drawn as without coupling."""
    coupled = [(i, plans[s.seq_id]) for i, s in enumerate(seqs)
               if s.seq_id in plans and plan_fits(plans[s.seq_id], k, vocab_size)]
    if not coupled:
        return None
    width = max(max(p.accepted.count(j) for j in set(p.accepted)) for _, p in coupled)
    kept = max(p.guess_ids.shape[1] for _, p in coupled)
    guess_ids = torch.zeros(len(seqs), k + 1, kept, dtype=torch.int64)
    guess_probs = torch.zeros(len(seqs), k + 1, kept)
    candidates = torch.full((len(seqs), k + 1, width), -1, dtype=torch.int64)
    uniforms = torch.zeros(len(seqs), width, dtype=torch.float64)
    for i, plan in coupled:
        positions, m = plan.guess_ids.shape
        guess_ids[i, :positions, :m], guess_probs[i, :positions, :m] = plan.guess_ids, plan.guess_probs.float()
        candidates[i] = torch.tensor(candidate_slots(plan, k + 1, width))
        # A stream apart from the row's verify uniforms: how many candidates the plan has changes no other draw.
        # Keyed by length, not round: a re-prefill (a draft worker died) starts the rounds over.
        uniforms[i] = torch.rand(width, generator=substream(seqs[i].generator, COUPLING_STREAM | seqs[i].num_tokens),
                                 dtype=torch.float64)
    return Coupling(guess_ids.to(device), guess_probs.to(device), candidates.to(device), uniforms.to(device))


def candidate_slots(plan: TreePlan, positions: int, width: int) -> list[list[int]]:
    """Per outcome position j, the plan's candidates there in draw order, -1 padded to `width` (built as lists
    and made a tensor once: a tensor write per branch cost ~2.5 us, 30 of a round's ~60 at 12 branches)."""
    slots = [[] for _ in range(positions)]
    for j, t in zip(plan.accepted, plan.bonus_tokens):
        slots[j].append(t)
    return [row + [-1] * (width - len(row)) for row in slots]


def plan_fits(plan: TreePlan, k: int, vocab_size: int) -> bool:
    """Whether a plan from the draft side carries guesses this target can draw against: P = K or K + 1
    positions of ids inside the vocabulary, and candidates at those positions (a mismatched peer's plan
    is left out: its rows draw their bonus as without coupling)."""
    ids, probs = plan.guess_ids, plan.guess_probs
    if ids is None or probs is None or ids.dim() != 2 or ids.shape != probs.shape or ids.shape[0] not in (k, k + 1):
        return False
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return False
    positions = ids.shape[0]
    return (bool(plan.accepted) and all(0 <= j < positions for j in plan.accepted)
            and all(0 <= t < vocab_size for t in plan.bonus_tokens))
