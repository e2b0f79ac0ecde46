"""Logit bias and allowed tokens: what they do to the target's logits, as OpenAI and vLLM define them.

Like the penalties, they change the target's distribution, so the target side applies them (before the
penalties, vLLM's order) and the verifier compares the draft's q with the biased p: the output follows
the biased target exactly whatever the draft proposed. The draft applies the same row to propose what
the biased target would choose (acceptance only). One additive row does both: bias where given, -inf
for a token outside the allowed list.
"""
from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=256)  # requests tend to share their bias (a served app's allowed list): build it once
def bias_row(logit_bias: tuple[tuple[int, float], ...], allowed: tuple[int, ...] | None, vocab_size: int) -> torch.Tensor:
    """[V] float32 to add to a row of logits: logit_bias[j] at token j, -inf at a token outside `allowed`
    (None: any token allowed). Ids at or beyond vocab_size are left out (a draft's vocabulary may be
    smaller); if none of `allowed` is in the vocabulary, the row allows every token rather than none.
    Shared between the calls that ask for the same row: read it, never write to it."""
    row = torch.zeros(vocab_size)
    inside = [t for t in allowed or () if t < vocab_size]
    if inside:
        row.fill_(float("-inf"))
        row[torch.tensor(inside, dtype=torch.long)] = 0.0
    pairs = [(t, b) for t, b in logit_bias if t < vocab_size]
    if pairs:
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        row[ids] += torch.tensor([b for _, b in pairs])
    return row
