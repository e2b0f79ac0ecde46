"""vLLM's `bad_words`: token sequences the output may not complete, as a mask on the target's logits.

A banned sequence w = (w_1..w_n) bans w_n at a position whose output so far ends with w_1..w_{n-1}
(a one-token word is banned everywhere); only the output counts, not the prompt (vLLM's rule). The
mask changes the target's distribution, so it belongs to the target side, as the penalties: row t of
a verify decides the token after output + drafted[:t] and is masked with exactly that context, so the
verifier compares the draft's q with the masked p whatever the draft proposed. The draft is told the
words too (DraftSampling.bad_words, RowBadWords), for acceptance only: it then proposes no token the target bars.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from saguaro_dist.bad_word_ids import BadWordIds


def longest_prefix(words: BadWordIds) -> int:
    """How many of the last tokens can start a match: a context's tail this long decides what it bans."""
    return max((len(w) for w in words), default=1) - 1


def tail(tokens: Sequence[int], n: int) -> list[int]:
    """tokens' last n (none for n = 0, where tokens[-0:] would be all of them)."""
    return list(tokens[max(0, len(tokens) - n):])


def banned_at(context: Sequence[int], words: BadWordIds) -> list[int]:
    """The tokens banned right after `context` (the output so far)."""
    return [w[-1] for w in words if len(w) - 1 <= len(context) and tuple(context[len(context) - len(w) + 1:]) == w[:-1]]


def bad_words_mask(output_ids: Sequence[int], drafted: Sequence[int], rows: int, words: BadWordIds,
                   vocab_size: int) -> torch.Tensor:
    """[rows, V] bool, True where banned: row t decides the token after output_ids + drafted[:t]."""
    mask = torch.zeros(rows, vocab_size, dtype=torch.bool)
    context = list(output_ids)
    n = longest_prefix(words)  # only the last tokens can start a match
    for t in range(rows):
        banned = [b for b in banned_at(tail(context, n), words) if b < vocab_size]
        mask[t, banned] = True
        if t < len(drafted):
            context.append(drafted[t])
    return mask


@dataclass
class RowBadWords:
    """Bad-word state of rows that each draw one token a step (the draft's K draws): apply() bars what each
    row's context would complete, drew() extends the contexts by the tokens drawn."""
    words: list[BadWordIds]     # per row: its request's bad words (empty: none)
    contexts: list[list[int]]   # per row: the tail of its output so far (longest_prefix tokens suffice)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V], barred tokens at -inf (a copy where any is barred)."""
        vocab = logits.shape[-1]
        cells = [(r, b) for r, (words, context) in enumerate(zip(self.words, self.contexts)) if words
                 for b in banned_at(context, words) if b < vocab]
        if not cells:
            return logits
        rows, tokens = torch.tensor(cells, dtype=torch.long, device=logits.device).T
        return logits.index_put((rows, tokens), torch.tensor(float("-inf"), device=logits.device, dtype=logits.dtype))

    def drew(self, tokens: torch.Tensor) -> None:
        """tokens [R]: each row's next token, kept within its tail."""
        for words, context, token in zip(self.words, self.contexts, tokens.tolist()):
            context.append(token)
            del context[:max(0, len(context) - longest_prefix(words))]
