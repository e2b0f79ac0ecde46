"""vLLM's `min_tokens` as the draft follows it: the end ids (the eos ids and stop_token_ids, ignore_eos or
not: vLLM's all_stop_token_ids) are barred at a position that fewer than min_tokens output tokens precede.

The target bars them itself (TargetScorer._hold_back_ends), so exactness never depends on the draft; a draft
told them (DraftSampling.min_tokens, end_token_ids) stops proposing an end the target cannot sample.
A drafted position's output count depends on the row's path: position j of a draft after an output of n
tokens (the pending bonus included) and a branch path p sits after n + len(p) + j output tokens.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

# Distinct end ids a draft is told, at most: past any vocabulary (ids beyond a vocabulary bar nothing), so
# keeping a request's smallest this many (draft_end_ids) loses none that could be sampled.
MAX_END_TOKEN_IDS = 1 << 20


def draft_end_ids(min_tokens: int, eos_token_ids: Iterable[int], stop_token_ids: Iterable[int],
                  vocab_size: int) -> tuple[int, ...]:
    """What the draft is told to hold back: the distinct ends the target has a logit for (ids past its
    vocabulary bar nothing, and a stop_token_id may be any int: one past int64 would not cross the wire),
    sorted (the smallest MAX_END_TOKEN_IDS); none where min_tokens holds nothing back."""
    if min_tokens <= 0:
        return ()
    ends = {t for t in eos_token_ids if t < vocab_size} | {t for t in stop_token_ids if t < vocab_size}
    return tuple(sorted(ends))[:MAX_END_TOKEN_IDS]


def checked_end_ids(min_tokens, ids) -> tuple[int, ...]:
    """The end ids from an edge (the draft protocol), min_tokens an int >= 0 and at most MAX_END_TOKEN_IDS
    token ids >= 0: as a sorted tuple of distinct ids."""
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {str(min_tokens)[:40]!r}")
    try:
        ids = tuple(ids)
    except TypeError:
        raise ValueError(f"end_token_ids must be a list of token ids, got a {type(ids).__name__}") from None
    if len(ids) > MAX_END_TOKEN_IDS:
        raise ValueError(f"end_token_ids must hold at most {MAX_END_TOKEN_IDS} token ids, got {len(ids)}")
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
    if bad is not None:  # the error names the value, never the payload (a gRPC trailer's size is limited)
        raise ValueError(f"end_token_ids must be token ids (ints >= 0), holding {str(bad)[:40]!r}")
    return tuple(sorted(set(ids)))


def held_back_rows(output_len: int, min_tokens: int, rows: int) -> int:
    """How many of `rows` consecutive positions, the first after output_len output tokens, are short of
    min_tokens (their ends barred): the first ones, min_tokens - output_len of them, within 0..rows."""
    return max(0, min(rows, min_tokens - output_len))


def in_vocab(ids: Iterable[int], vocab_size: int) -> list[int]:
    """The ids that have a logit to bar."""
    return [t for t in ids if t < vocab_size]


@dataclass
class RowEnds:
    """min_tokens state of rows that each draw one token a step (the draft's K draws): apply() bars each
    row's ends while it is short of min_tokens, drew() counts the token drawn."""
    ends: list[tuple[int, ...]]  # per row: its request's end ids (empty: none to bar)
    before: list[int]            # per row: the output tokens before its next draw (output, path, draws)
    min_tokens: list[int]        # per row: its request's min_tokens

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V], barred tokens at -inf (a copy where any is barred). Rows sharing a request's ends
        (the same tuple) are barred in one indexed assignment: a request may hold back many ids."""
        short: dict[int, list[int]] = {}  # id of an ends tuple -> its rows still short of min_tokens
        for r, (ends, n, m) in enumerate(zip(self.ends, self.before, self.min_tokens)):
            if ends and held_back_rows(n, m, 1):
                short.setdefault(id(ends), []).append(r)
        if not short:
            return logits
        logits = logits.clone()
        for rows in short.values():
            ids = in_vocab(self.ends[rows[0]], logits.shape[-1])
            if ids:
                index = torch.tensor(rows, device=logits.device)[:, None], torch.tensor(ids, device=logits.device)
                logits[index] = float("-inf")
        return logits

    def drew(self, tokens: torch.Tensor) -> None:
        """tokens [R]: each row's next token (one more output token before its next draw)."""
        self.before = [n + 1 for n in self.before]


def hold_back_positions(logits: torch.Tensor, output_len: int, min_tokens: int, ends: Iterable[int]) -> torch.Tensor:
    """logits [T, V], row j deciding the token after output_len + j output tokens: the ends at -inf in the
    rows short of min_tokens (a copy where any is barred)."""
    n, barred = held_back_rows(output_len, min_tokens, logits.shape[0]), in_vocab(ends, logits.shape[-1])
    if not n or not barred:
        return logits
    logits = logits.clone()
    logits[:n, barred] = float("-inf")
    return logits
