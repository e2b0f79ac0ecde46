"""Incremental text for a sequence: stop strings, and deltas safe to stream."""
from __future__ import annotations


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def stable_prefix(text: str, stops: tuple[str, ...]) -> str:
    """The part of `text` no later token can change: hold back a possible stop-string start and
    an incomplete multi-byte character (decoded as U+FFFD)."""
    holdback = max((len(s) - 1 for s in stops), default=0)
    stable = text[: len(text) - holdback] if holdback else text
    return stable.rstrip("\ufffd")


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
