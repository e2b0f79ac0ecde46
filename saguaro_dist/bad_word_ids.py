"""vLLM's `bad_words` as token ids: the request's words tokenized (the engine's edge) and the ids checked where they
cross a process (the draft protocol). Pure Python: SamplingParams imports it, and the client SDK imports
SamplingParams without torch (spec/bad_words.py holds the masks).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

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


def checked_word_ids(ids, name: str = "bad_words") -> BadWordIds:
    """Bad words' token ids from an edge (the draft protocol): at most MAX_BAD_WORDS non-empty sequences of
    token ids >= 0, as a tuple of tuples."""
    what = f"{name} must be at most {MAX_BAD_WORDS} non-empty lists of token ids >= 0"
    try:
        words = tuple(tuple(w) for w in ids)
    except TypeError:
        raise ValueError(f"{what}, got a {type(ids).__name__} or an item that is no list") from None
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"{what}, got {len(words)}")
    for i, word in enumerate(words):  # the error names the place, never the payload (a gRPC status's details
        bad = next((t for t in word if not (isinstance(t, int) and not isinstance(t, bool) and t >= 0)), None)
        if not word or bad is not None:  # travel in a trailer, which gRPC drops past 8-16 KiB)
            raise ValueError(f"{what}: {name}[{i}] is {'empty' if not word else f'holding {str(bad)[:40]!r}'}")
    return words
