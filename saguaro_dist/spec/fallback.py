"""Backup speculators for cache misses and the batch-aware choice between them (Saguaro Theorem 17).

Both fast proposals are deterministic given the tokens they return (they do not depend on the
target's random draws), so they are verified exactly with draft_probs = None (one-hot q).
"""
from __future__ import annotations

from array import array

import torch

from saguaro_dist.config import FallbackPolicy
from saguaro_dist.spec.tree_gate import CLOSE_GAP, MAX_STRETCH, relative_gap

MAX_CRITICAL_BATCH = 1024
EXPLORE_EVERY = 16  # one automatic choice in this many takes the other backup (explore_fallback) while
                    # the two are close; up to MAX_STRETCH times fewer as it falls behind (explore_every)


def _latest_match(data: bytes, tokens: array, n: int) -> int | None:
    """Start of the most recent window tokens[i:i+n] equal to the last n tokens, with i + n < len.
    data is tokens' bytes: bytes.rfind searches at C speed (a Python or torch scan of a few hundred
    tokens took ~40 us, paid for every row of every round that offers an n-gram proposal)."""
    if len(tokens) <= n:
        return None
    pattern, end = data[-n * tokens.itemsize:], (len(tokens) - 1) * tokens.itemsize
    while True:
        at = data.rfind(pattern, 0, end)
        if at < 0:
            return None
        if at % tokens.itemsize == 0:  # a match inside a token's bytes is no match
            return at // tokens.itemsize
        end = at + len(pattern) - 1


def ngram_proposal(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: for n = max_ngram..min_ngram, find the latest earlier occurrence i of the last
    n tokens and propose what followed it, s_j = e[i + n + j] over e = tokens + s (so a continuation
    that runs off the end repeats with the match's period, e.g. ...a b a b -> a b a b).
    No match: k copies of the last token ([0] * k for no tokens). Always returns exactly k tokens."""
    return ngram_lookup(tokens, k, max_ngram, min_ngram)[0]


def ngram_lookup(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[list[int], int]:
    """ngram_proposal's tokens and the n of the n-gram that matched (0: none). A longer match predicts
    the text better: spec/lookup_pick.py weighs proposals by it."""
    if not tokens:
        return [0] * k, 0
    t = array("q", tokens)
    data = t.tobytes()
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        start = _latest_match(data, t, n)
        if start is not None:
            extended = list(tokens)
            for j in range(k):
                extended.append(extended[start + n + j])
            return extended[len(tokens):], n
    return [tokens[-1]] * k, 0


def random_proposal(vocab_size: int, k: int, generator: torch.Generator | None = None) -> list[int]:
    """k tokens uniform on [0, V) (the paper's fast backup), drawn from `generator`."""
    device = generator.device if generator is not None else None
    return torch.randint(vocab_size, (k,), generator=generator, device=device).tolist()


def neural_backup_throughput(b: int, p_hit: float, tokens_hit: float, tokens_neural_miss: float,
                             t_neural: float, round_cost: float = 1.0) -> float:
    """Tokens per unit time (verify = 1) with a neural backup. A round costs round_cost = max(1, T_p)
    (Theorem 7: the target waits for trees the draft builds slower than a verify), and the whole batch
    waits t_neural more whenever at least one of its b sequences misses:
    b [p E_hit + (1-p) E_neural] / (round_cost + (1 - p^b) t_neural)."""
    return b * (p_hit * tokens_hit + (1 - p_hit) * tokens_neural_miss) / (round_cost + (1 - p_hit ** b) * t_neural)


def fast_backup_throughput(b: int, p_hit: float, tokens_hit: float, tokens_fast_miss: float,
                           round_cost: float = 1.0) -> float:
    """Tokens per unit time with a free fast backup: b [p E_hit + (1-p) E_fast] / round_cost."""
    return b * (p_hit * tokens_hit + (1 - p_hit) * tokens_fast_miss) / round_cost


def critical_batch_size(p_hit: float, tokens_hit: float, tokens_neural_miss: float, tokens_fast_miss: float,
                        t_neural: float, max_batch: int = MAX_CRITICAL_BATCH, round_cost: float = 1.0) -> int:
    """b* = min{b >= 1 : fast_backup_throughput(b) >= neural_backup_throughput(b)}, or max_batch if none
    up to it. The neural side's stall probability 1 - p^b grows with b, so past b* fast wins.
    fast(b) / neural(b) = const x (round_cost + (1 - p^b) t_neural) is non-decreasing in b, so "fast
    wins" is monotone and b* is found by bisection (the round loop asks every round: O(log max_batch),
    not O(b*)). A round_cost above 1 (a draft slower than the verify) makes the neural backup's wait a
    smaller share of the round, and b* larger."""
    def fast_wins(b: int) -> bool:
        fast = fast_backup_throughput(b, p_hit, tokens_hit, tokens_fast_miss, round_cost)
        return fast >= neural_backup_throughput(b, p_hit, tokens_hit, tokens_neural_miss, t_neural, round_cost)
    lo, hi = 1, max_batch  # invariant: b* in [lo, hi] (hi = max_batch also means "none up to it")
    while lo < hi:
        mid = (lo + hi) // 2
        if fast_wins(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def explore_fallback(kind: FallbackPolicy, decision: int, every: int = EXPLORE_EVERY) -> FallbackPolicy:
    """The automatic choice, except that decision number every - 1, 2 every - 1, ... takes the other
    backup. The choice reads each backup's measured cost and tokens, which only its own rounds update:
    without this, one slow first neural backup (it ran beside a tree build) chose the fast backup for the
    engine's life, at T = 0.7 too, where its proposals are rarely accepted (session 36: 264 misses of
    264 went fast, acceptance 0.31 against 0.63, ssd / sd 0.80)."""
    if decision % every != every - 1 or kind not in (FallbackPolicy.NEURAL, FallbackPolicy.FAST):
        return kind
    return FallbackPolicy.FAST if kind is FallbackPolicy.NEURAL else FallbackPolicy.NEURAL


def explore_every(neural: float, fast: float, tries: float, every: int = EXPLORE_EVERY) -> int:
    """Automatic choices per try of the backup not chosen (explore_fallback's `every`), from the two
    backups' expected throughputs (what b* compares): `every` while they are close, up to MAX_STRETCH times
    that as the other falls behind, as the tree gate re-tries a slower mode (spec/tree_gate.py). A try costs
    in proportion to the gap and is needed less the wider it is: at T = 0.7 the fast backup's n-gram
    proposals are almost never accepted (0.015 against the neural backup's 0.58, demo pair, session 66),
    and one miss in 16 still went to them. `tries`: how often the backup behind was measured (decayed); the
    stretch is at most that, since a gap seen once may be a fluke (one slow first neural backup)."""
    by_gap = (relative_gap(neural, fast) / CLOSE_GAP) ** 2 if neural > 0 and fast > 0 else 1.0
    return round(every * min(MAX_STRETCH, max(1.0, tries), max(1.0, by_gap)))


def choose_fallback(policy: FallbackPolicy, batch_size: int, b_star: int) -> FallbackPolicy:
    """AUTO -> NEURAL if batch_size < b_star else FAST; any other policy is returned as is."""
    policy = FallbackPolicy(policy)
    if policy is not FallbackPolicy.AUTO:
        return policy
    return FallbackPolicy.NEURAL if batch_size < b_star else FallbackPolicy.FAST
