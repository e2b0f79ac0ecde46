"""How many tokens a round of n-gram proposals alone proposes: the length that measures fastest.

How well a prompt-lookup proposal predicts the text shows in the n of the n-gram that found it. On the
demo pair's greedy text (8 held-out prompts, 128 tokens each, K = 4) a 3-gram's 4 tokens were accepted
3.5 at a time, a 1-gram's 0.8, no match's 0.04. At a fixed K the good matches stop at K while the verify
could take more for little (here 8 tokens verify in 1.12x the time of 4), and the poor ones pay K + 1
positions for about one token. So a round whose every row proposes by lookup (SSD's RoundMode.FAST, mode
"ngram") proposes L of candidate_lengths(K) tokens, the L of the most expected tokens per second:

    L* = argmax_L  sum_rows E[tokens | a_row, L] / verify_s(b, L),   E[tokens | a, L] = 1 + a + ... + a^L

where a_row is the per-token acceptance of proposals found by an n-gram of the row's n (greedy and
sampled rows apart), a geometric model fitted to every lookup proposal verified (censored at its
length: successes = accepted, trials = accepted + [a rejection]), and verify_s the verify's measured
seconds at this batch size and L, interpolated between measured lengths. Every L is exact: a lookup
proposal is deterministic given the tokens so far, so it is verified as a one-hot q of any length.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from saguaro_dist.spec.tree_gate import SECONDS_DECAY, TOKENS_DECAY, DecayedMean

MIN_PROPOSALS = 8     # lookup proposals of an n verified before its rate is trusted (until then: K, as before)
COST_SLOPE = 0.05     # a verify's relative growth per token proposed, until two lengths were measured (this box:
                      # 1 -> 4 tokens +28%, 4 -> 12 +23%; a GPU's small-batch verify barely grows)


def candidate_lengths(k: int) -> tuple[int, ...]:
    """The lengths a round of lookup proposals may take: one token (a poor match costs the least verify), K,
    2K and 3K (a long match runs on). Few, so that each is measured often; on CUDA, each is a graph shape."""
    return tuple(sorted({1, k, 2 * k, 3 * k}))


def expected_tokens(alpha: float, length: int) -> float:
    """Tokens a proposal of `length` gains (accepted + the bonus) when each is accepted with probability
    alpha until the first rejection: 1 + alpha + ... + alpha^length."""
    if alpha >= 1.0:
        return length + 1.0
    return 1.0 + alpha * (1.0 - alpha ** length) / (1.0 - alpha)


def best_length(alphas: list[float], lengths: list[int], seconds) -> int:
    """The length of the most expected tokens (over the rows' acceptance rates) per second(length)."""
    return max(lengths, key=lambda n: sum(expected_tokens(a, n) for a in alphas) / seconds(n))


def estimated_seconds(measured: dict[int, float], length: int, slope: float = COST_SLOPE) -> float:
    """A verify's seconds at `length` from those measured at other lengths (length -> seconds, at least one):
    linear between the nearest measured on either side; beyond them, on the line through the two nearest
    (never falling with more tokens), or with one, `slope` of it per token of difference."""
    if length in measured:
        return measured[length]
    shorter = sorted(n for n in measured if n < length)
    longer = sorted(n for n in measured if n > length)
    if shorter and longer:
        lo, hi = shorter[-1], longer[0]
        return measured[lo] + (measured[hi] - measured[lo]) * (length - lo) / (hi - lo)
    side = shorter[::-1] or longer  # nearest first
    near = side[0]
    if len(side) == 1:
        per_token = slope * measured[near]
    else:
        per_token = max(0.0, (measured[near] - measured[side[1]]) / (near - side[1]))
    return max(0.5 * measured[near], measured[near] + per_token * (length - near))


@dataclass
class Acceptance:
    """A decayed censored-geometric fit of per-token acceptance: successes over trials."""
    successes: DecayedMean = field(default_factory=lambda: DecayedMean(TOKENS_DECAY))

    def add(self, accepted: int, length: int) -> None:
        self.successes.add(float(accepted), float(accepted + (accepted < length)))

    @property
    def rate(self) -> float | None:
        trials = self.successes.weight
        return self.successes.mean if self.successes.count >= MIN_PROPOSALS and trials else None


@dataclass
class LookupLengths:
    """The measurements behind best_length: acceptance per (n of the match, greedy), verify seconds per
    (batch size, length)."""
    k: int
    acceptance: dict = field(default_factory=dict)  # (n, greedy) -> Acceptance
    seconds: dict = field(default_factory=dict)     # batch size -> {length: DecayedMean of verify seconds}

    @property
    def lengths(self) -> tuple[int, ...]:
        return candidate_lengths(self.k)

    def choose(self, keys: list[tuple[int, bool]], room: int) -> int:
        """The length for a round of lookup proposals whose rows matched keys[i] = (n, greedy), at most
        `room` (what every row's KV, output and draft can still take; at least 1); K, capped, while a row's
        n or this batch size's verify is unmeasured."""
        rates = [self._rate(key) for key in keys]
        measured = {n: m.mean for n, m in self.seconds.get(len(keys), {}).items()}
        fits = [n for n in self.lengths if n <= room] or [1]
        if None in rates or not measured:
            return min(self.k, max(fits))
        return best_length(rates, fits, lambda n: estimated_seconds(measured, n))

    def record(self, keys: list[tuple[int, bool]], accepted: list[int], length: int, verify_s: float) -> None:
        """A verified round of lookup proposals of `length`: each row's accepted count, the verify's seconds."""
        for key, a in zip(keys, accepted):
            self.acceptance.setdefault(key, Acceptance()).add(a, length)
        per_length = self.seconds.setdefault(len(keys), {})
        per_length.setdefault(length, DecayedMean(SECONDS_DECAY)).add_clipped(verify_s)

    def _rate(self, key: tuple[int, bool]) -> float | None:
        fit = self.acceptance.get(key)
        return fit.rate if fit is not None else None
