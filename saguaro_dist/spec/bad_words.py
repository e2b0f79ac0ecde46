"""vLLM's `bad_words`: token sequences the output may not complete, as a mask on the target's logits.

A banned sequence w = (w_1..w_n) bans w_n at a position whose output so far ends with w_1..w_{n-1}
(a one-token word is banned everywhere); only the output counts, not the prompt (vLLM's rule). The
mask changes the target's distribution, so it belongs to the target side, as the penalties: row t of
a verify decides the token after output + drafted[:t] and is masked with exactly that context, so the
verifier compares the draft's q with the masked p whatever the draft proposed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

BadWordIds = tuple[tuple[int, ...], ...]  # each banned word's token ids
MAX_BAD_WORDS = 128  # token sequences per request after tokenization (vLLM's VLLM_MAX_NUM_BAD_WORDS default)


def bad_word_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> BadWordIds:
    """vLLM's tokenization of bad words (SamplingParams.update_from_tokenizer): each word, left-stripped,
    encoded without special tokens; then " " + word, kept only where it starts with another token and
    has as many tokens (a word-initial spelling, as at the start of a text vs. mid-text)."""
    ids: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if not plain:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r}")
        ids.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            ids.append(spaced)
    if len(ids) > MAX_BAD_WORDS:
        raise ValueError(f"too many bad words after tokenization: {len(ids)} (at most {MAX_BAD_WORDS})")
    return tuple(ids)


def banned_at(context: Sequence[int], words: BadWordIds) -> list[int]:
    """The tokens banned right after `context` (the output so far)."""
    return [w[-1] for w in words if len(w) - 1 <= len(context) and tuple(context[len(context) - len(w) + 1:]) == w[:-1]]


def bad_words_mask(output_ids: Sequence[int], drafted: Sequence[int], rows: int, words: BadWordIds,
                   vocab_size: int) -> torch.Tensor:
    """[rows, V] bool, True where banned: row t decides the token after output_ids + drafted[:t]."""
    mask = torch.zeros(rows, vocab_size, dtype=torch.bool)
    context = list(output_ids)
    tail = max((len(w) for w in words), default=1) - 1  # only the last tokens can start a match
    for t in range(rows):
        banned = [b for b in banned_at(context[max(0, len(context) - tail):], words) if b < vocab_size]
        mask[t, banned] = True
        if t < len(drafted):
            context.append(drafted[t])
    return mask
