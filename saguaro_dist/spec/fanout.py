"""How many bonus-token candidates to cache at each outcome position k = 0..K (Saguaro Theorem 12)."""
from __future__ import annotations

import math
from collections.abc import Sequence

from saguaro_dist.config import FanOut

ACCEPT_RATE_RANGE = (0.01, 0.99)  # keeps a^x and (1 - a)^x finite and the allocation non-degenerate


def round_to_budget(ideal: Sequence[float], budget: int, caps: Sequence[int] | None = None) -> list[int]:
    """Largest-remainder rounding of `ideal` to integers 1 <= F_j <= cap_j with sum F = budget.

    Start from clamp(floor(ideal_j), 1, cap_j); add units where ideal_j - F_j is largest (ties: lower
    j), remove units where it is smallest. The sum falls short of `budget` only if sum(caps) < budget.
    A position with cap_j <= 0 has no candidate at all (a 1-token vocabulary's k < K, where the one token
    is the drafted one): F_j = 0 there, and the budget need only cover the others. A non-finite ideal_j
    counts as 0 (it only orders the remainders).
    """
    n = len(ideal)
    needed = n if caps is None else sum(1 for c in caps if c > 0)
    caps = [max(int(c), 0) for c in caps] if caps is not None else [budget] * n
    ideal = [x if math.isfinite(x) else 0.0 for x in ideal]
    if budget < needed:
        raise ValueError(f"budget {budget} < {needed}: every position with a candidate needs at least one branch")
    f = [min(max(int(x), 1), c) for x, c in zip(ideal, caps)]
    while sum(f) < budget:
        room = [j for j in range(n) if f[j] < caps[j]]
        if not room:
            break
        f[max(room, key=lambda j: (ideal[j] - f[j], -j))] += 1
    while sum(f) > budget:
        f[min((j for j in range(n) if f[j] > 1), key=lambda j: (ideal[j] - f[j], -j))] -= 1
    return f


def unit_gain(p: float, f: int, r: float) -> float:
    """Hit probability one more branch adds at a position with f >= 1 branches: p (f^-r - (f+1)^-r)."""
    return p * (f ** -r - (f + 1) ** -r)


def transfer_to_optimum(start: Sequence[int], probs: Sequence[float], r: float, caps: Sequence[int]) -> list[int]:
    """The integer optimum of sum_j P(j) (1 - F_j^-r) with the sum, the floor of one and the caps of `start`.

    Why: rounding the real optimum can lose hit rate (~0.2%: 10 branches, K = 4, a = 0.31, r = 1 rounds to
    [5, 2, 1, 1, 1], the optimum is [4, 3, 1, 1, 1]). The objective is separable and concave in each F_j,
    so an allocation no one-branch transfer improves is optimal; starting from the rounding, few are needed
    (a greedy hand-out from all ones would take `budget` steps). Each move strictly raises the sum of the
    computed gains, so it ends; with r = 0 nothing moves (no F changes the objective)."""
    f = list(start)
    live = [j for j in range(len(f)) if f[j] >= 1]  # cap 0: no candidate, F_j stays 0
    while True:
        up = [j for j in live if f[j] < caps[j]]
        down = [j for j in live if f[j] > 1]
        if not up or not down:
            return f
        gain_j = max(up, key=lambda j: (unit_gain(probs[j], f[j], r), -j))
        loss_i = min(down, key=lambda i: (unit_gain(probs[i], f[i] - 1, r), -i))
        if gain_j == loss_i or unit_gain(probs[gain_j], f[gain_j], r) <= unit_gain(probs[loss_i], f[loss_i] - 1, r):
            return f
        f[gain_j] += 1
        f[loss_i] -= 1


def geometric_fanout(budget: int, k: int, accept_rate: float, r: float, caps: Sequence[int] | None = None) -> list[int]:
    """F_k = F_0 a^(k/(1+r)) (k < K), F_K = F_0 a^(K/(1+r)) (1-a)^(-1/(1+r)), F_0 fixed by sum F = budget;
    in integers >= 1 summing to `budget` (see outcome_fanout). Returns K+1 ints. It is
    outcome_fanout for the i.i.d. outcome distribution (the common factor (1-a)^(1/(1+r)) cancels)."""
    return outcome_fanout(budget, geometric_outcome_probs(k, accept_rate), r, caps)


def geometric_outcome_probs(k: int, accept_rate: float) -> list[float]:
    """P(k* = j) when every token is accepted independently with probability a: a^j (1 - a) for
    j < K, a^K for j = K (the model behind Theorem 12's geometric fan-out); a clamped to [0.01, 0.99]."""
    a = min(max(accept_rate, ACCEPT_RATE_RANGE[0]), ACCEPT_RATE_RANGE[1])
    return [a ** j * (1.0 - a) for j in range(k)] + [a ** k]


def outcome_fanout(budget: int, outcome_probs: Sequence[float], r: float, caps: Sequence[int] | None = None) -> list[int]:
    """Theorem 12's optimum for a measured outcome distribution: maximising sum_j P(j) (1 - F_j^-r)
    subject to sum F = budget gives F_j proportional to P(j)^(1/(1+r)). With the geometric P of
    geometric_outcome_probs this is geometric_fanout; with P counted from verified rounds it also fits
    acceptance that is not i.i.d. over positions (e.g. a draft that is usually wrong at the K-th).
    In integers >= 1 summing to `budget`: the integer optimum, found from the largest-remainder rounding of
    the real one by transfer_to_optimum. Returns len(outcome_probs) ints."""
    r = max(r, 0.0)
    probs = [max(p, 0.0) if math.isfinite(p) else 0.0 for p in outcome_probs]
    w = [p ** (1.0 / (1.0 + r)) for p in probs]
    total = sum(w)
    if total <= 0:
        raise ValueError(f"outcome probabilities must have positive mass, got {list(outcome_probs)}")
    rounded = round_to_budget([budget * x / total for x in w], budget, caps)
    caps = [max(int(c), 0) for c in caps] if caps is not None else [budget] * len(probs)
    return transfer_to_optimum(rounded, probs, r, caps)


def uniform_fanout(budget: int, k: int, caps: Sequence[int] | None = None) -> list[int]:
    """F_j = budget / (K+1), remainders to the lower positions first. Returns K+1 ints."""
    return round_to_budget([budget / (k + 1)] * (k + 1), budget, caps)


def vocab_caps(k: int, vocab_size: int) -> list[int]:
    """Candidates that exist: V-1 at k < K (the drafted token is excluded), V at the all-accepted position
    (never below 0: a 1-token vocabulary has none at k < K, where a rejection cannot happen)."""
    return [max(vocab_size - 1, 0)] * k + [max(vocab_size, 0)]


def resolve_fanout(kind: FanOut, budget_or_list: int | Sequence[int], k: int, accept_rate: float, r: float,
                   vocab_size: int, outcome_probs: Sequence[float] | None = None) -> list[int]:
    """The fan-out F_0..F_K to use: an explicit list (K+1 ints) wins and is only capped to the
    vocabulary; a budget is split by `kind` within the caps (see vocab_caps). OUTCOME needs the
    measured P(k* = j), j = 0..K (the geometric one stands in when None)."""
    caps = vocab_caps(k, vocab_size)
    if not isinstance(budget_or_list, int):
        explicit = list(budget_or_list)
        if len(explicit) != k + 1 or any(f < 1 for f in explicit):
            raise ValueError(f"an explicit fan-out needs K+1 = {k + 1} ints >= 1, got {explicit}")
        return [min(f, c) for f, c in zip(explicit, caps)]
    if FanOut(kind) is FanOut.GEOMETRIC:
        return geometric_fanout(budget_or_list, k, accept_rate, r, caps)
    if FanOut(kind) is FanOut.OUTCOME:
        probs = outcome_probs if outcome_probs is not None else geometric_outcome_probs(k, accept_rate)
        return outcome_fanout(budget_or_list, probs, r, caps)
    return uniform_fanout(budget_or_list, k, caps)
