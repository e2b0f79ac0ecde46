"""The target's side of coupled bonus draws (spec/coupled.py): a batch's Coupling from the plans of the
trees the draft builds while the batch verifies."""
from __future__ import annotations

from collections import Counter

import torch

from saguaro_dist.engine.messages import TreePlan
from saguaro_dist.engine.sequence import COUPLING_STREAM, Sequence, substream_seed
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
    width = max(max(Counter(p.accepted).values()) for _, p in coupled)
    kept = max(p.guess_ids.shape[1] for _, p in coupled)
    rows = [i for i, _ in coupled]
    # Batch-wide tensors made once from per-row pieces: a slice write per row and tensor cost ~2-3 us each,
    # 64 rows a round.
    guess_ids = _rows_padded([p.guess_ids.long() for _, p in coupled], rows, len(seqs), k + 1, kept)
    guess_probs = _rows_padded([p.guess_probs.float() for _, p in coupled], rows, len(seqs), k + 1, kept)
    slots = dict(zip(rows, (candidate_slots(p, k + 1, width) for _, p in coupled)))
    unplanned = [[-1] * width] * (k + 1)
    candidates = torch.tensor([slots.get(i, unplanned) for i in range(len(seqs))], dtype=torch.int64)
    uniforms = torch.zeros(len(seqs), width, dtype=torch.float64)
    stream = torch.Generator()  # reseeded per row: substream()'s draws, without a new generator per row
    for i in rows:
        # A stream apart from the row's verify uniforms: how many candidates the plan has changes no other draw.
        # Keyed by length, not round: a re-prefill (a draft worker died) starts the rounds over.
        stream.manual_seed(substream_seed(seqs[i].generator, COUPLING_STREAM | seqs[i].num_tokens))
        uniforms[i].uniform_(generator=stream)  # torch.rand(out=)'s draw without its checks: the same numbers
    return Coupling(guess_ids.to(device), guess_probs.to(device), candidates.to(device), uniforms.to(device))


def _rows_padded(parts: list[torch.Tensor], rows: list[int], n: int, positions: int, kept: int) -> torch.Tensor:
    """[n, positions, kept]: parts[j] (a plan's [P, M] guess) at row rows[j], zero padded; zero rows elsewhere."""
    parts = [torch.nn.functional.pad(x, (0, kept - x.shape[1], 0, positions - x.shape[0]))
             if x.shape != (positions, kept) else x for x in parts]
    stacked = torch.stack(parts)
    if len(rows) == n:  # every row planned (rows are in order): no scatter
        return stacked
    out = stacked.new_zeros(n, positions, kept)
    out[rows] = stacked
    return out


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
    if ids.numel():
        low, high = ids.aminmax()  # one pass, not two (a plan per row a round)
        if int(low) < 0 or int(high) >= vocab_size:
            return False
    positions = ids.shape[0]
    return (bool(plan.accepted) and all(0 <= j < positions for j in plan.accepted)
            and all(0 <= t < vocab_size for t in plan.bonus_tokens))
