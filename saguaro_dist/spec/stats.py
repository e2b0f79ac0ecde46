"""Online estimates of what the fan-out (Theorem 12) and the fallback choice (Theorem 17) need."""
from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import torch

from saguaro_dist.config import FanOut
from saguaro_dist.spec.fallback import (
    EXPLORE_EVERY, MAX_CRITICAL_BATCH, critical_batch_size, explore_every, fast_backup_throughput, neural_backup_throughput,
)
from saguaro_dist.spec.fanout import geometric_outcome_probs, resolve_fanout
from saguaro_dist.spec.theory import expected_tokens_per_round

MISS_CLAMP = (1e-3, 1.0 - 1e-3)  # a bin with no hits (or no misses) still gives a finite log
R_RANGE = (0.05, 4.0)
OUTCOME_PRIOR_ROUNDS = 8.0  # the geometric P(k*) counts as this many rounds in outcome_probs
FAST_PRIOR_ROUNDS = 2.0     # the fast backup counts as this many rounds as good as the draft until measured


class ProposalSource(str, enum.Enum):
    CACHE = "cache"    # SSD cache hit: prepared by the primary speculator
    NEURAL = "neural"  # the draft model drafting just in time (SD rounds, SSD's neural backup)
    FAST = "fast"      # n-gram or random backup
    LOOKUP = "lookup"  # a row that took its n-gram proposal over the draft's, a tree or a draft made now (spec/lookup_pick.py)


class Timing(str, enum.Enum):
    VERIFY = "verify"                # one target verification of K+1 positions
    DRAFT = "draft"                  # the primary speculator building a round's cache
    NEURAL_BACKUP = "neural_backup"  # a just-in-time K-token draft on a miss
    TREE_WAIT = "tree_wait"          # the target's wait for a round's trees once its verify is done


class _Decayed:
    """Exponentially decayed sum and count: mean = sum / count, old data fading by `decay` per update."""

    def __init__(self, decay: float):
        self.decay, self.total, self.count = decay, 0.0, 0.0

    def add(self, total: float, count: float) -> None:
        self.total = self.decay * self.total + total
        self.count = self.decay * self.count + count

    def mean(self, default: float) -> float:
        return self.total / self.count if self.count > 0 else default


def acceptance_counts(accepted: Sequence[int], k: int) -> tuple[float, float]:
    """(successes, trials) of the per-token acceptance test in a batch of rounds: each round tested
    its tokens until the first rejection, so successes = sum k*, trials = sum k* + #[k* < K].
    successes / trials is the maximum-likelihood a (sum k* / (B K) would be biased low)."""
    successes = float(sum(accepted))
    return successes, successes + sum(1 for a in accepted if a < k)


def fit_miss_exponent(fanouts: Sequence[int], misses: Sequence[float], lookups: Sequence[float]) -> float | None:
    """r of 1 - p_hit(F) = F^-r by weighted least squares through the origin on log m = -r log F:
    r = sum w log F (-log m) / sum w (log F)^2, w = lookups, m = misses/lookups clamped to [1e-3, 1-1e-3].
    Fan-outs of 1 carry no information (log 1 = 0). None when nothing informative was seen."""
    num = den = 0.0
    for f, miss, n in zip(fanouts, misses, lookups):
        if f < 2 or n <= 0:
            continue
        m = min(max(miss / n, MISS_CLAMP[0]), MISS_CLAMP[1])
        num += n * math.log(f) * -math.log(m)
        den += n * math.log(f) ** 2
    return num / den if den > 0 else None


class SpecStats:
    """Running estimates: acceptance rate a, miss exponent r, hit rate, tokens per round by proposal
    source, and mean times; each decays by `decay` per record call so the estimates track drift."""

    def __init__(self, k: int, decay: float = 0.99, default_accept_rate: float = 0.7, default_r: float = 0.5,
                 default_hit_rate: float = 0.5, min_lookups: int = 32):
        self.k, self.decay, self.min_lookups = k, decay, min_lookups
        self.defaults = {"accept_rate": default_accept_rate, "r": default_r, "hit_rate": default_hit_rate}
        self._accept = _Decayed(decay)
        self._hits = _Decayed(decay)
        self._tokens = {s: _Decayed(decay) for s in ProposalSource}
        self._times = {t: _Decayed(decay) for t in Timing}
        self._misses_by_f: dict[int, _Decayed] = {}
        self._outcomes = [_Decayed(decay) for _ in range(k + 1)]  # rounds that ended with k* = j

    def record_verify(self, accepted, source: ProposalSource) -> None:
        """accepted: k* per row (list or [B] tensor) of rounds whose proposals came from `source`.
        Only the primary speculator's rounds (CACHE, NEURAL) feed the acceptance rate a."""
        # Plain Python: a batch is a few ints, and this runs for every round (torch ops cost ~10 us each).
        accepted = accepted.reshape(-1).tolist() if isinstance(accepted, torch.Tensor) else [int(a) for a in accepted]
        if not accepted:
            return
        if source in (ProposalSource.CACHE, ProposalSource.NEURAL):  # (a str enum: its value works alike)
            self.record_outcomes(accepted)
        self._tokens[source].add(float(sum(accepted) + len(accepted)), len(accepted))

    def record_outcomes(self, accepted: Sequence[int]) -> None:
        """k* of rounds whose proposals this estimate models: they feed a and P(k*)."""
        self._accept.add(*acceptance_counts(accepted, self.k))
        counts = [0] * (self.k + 1)
        for a in accepted:
            counts[min(max(a, 0), self.k)] += 1
        for d, c in zip(self._outcomes, counts):
            d.add(float(c), float(c))

    def record_lookups(self, fanouts: Sequence[int], hits: Sequence[bool]) -> None:
        """One entry per cache lookup: F_{k*}, the fan-out at the real outcome's position, and hit or not."""
        hits = [bool(h) for h in hits]
        self._hits.add(sum(hits), len(hits))
        per_f: dict[int, list[int]] = {}
        for f, h in zip(fanouts, hits):
            per_f.setdefault(int(f), []).append(0 if h else 1)
        for f in set(self._misses_by_f) | set(per_f):
            misses = per_f.get(f, [])
            self._misses_by_f.setdefault(f, _Decayed(self.decay)).add(sum(misses), len(misses))

    def record_time(self, timing: Timing, seconds: float) -> None:
        self._times[timing].add(seconds, 1.0)  # a str enum: its value finds the same entry

    @property
    def accept_rate(self) -> float:
        return self._accept.mean(self.defaults["accept_rate"])

    @property
    def outcome_probs(self) -> list[float]:
        """P(k* = j), j = 0..K, of the primary speculator's rounds (decayed counts), smoothed towards
        the geometric model of the current a with OUTCOME_PRIOR_ROUNDS pseudo-rounds."""
        prior = geometric_outcome_probs(self.k, self.accept_rate)
        counts = [d.total for d in self._outcomes]
        n = sum(counts) + OUTCOME_PRIOR_ROUNDS
        return [(c + OUTCOME_PRIOR_ROUNDS * p) / n for c, p in zip(counts, prior)]

    @property
    def hit_rate(self) -> float:
        return self._hits.mean(self.defaults["hit_rate"])

    @property
    def r(self) -> float:
        """The miss exponent; the default until min_lookups informative lookups (F >= 2) were seen."""
        bins = [(f, d.total, d.count) for f, d in self._misses_by_f.items() if f >= 2]
        if not bins or sum(n for _, _, n in bins) < self.min_lookups:  # (no bins: nothing to fit, whatever min_lookups)
            return self.defaults["r"]
        fitted = fit_miss_exponent(*zip(*bins))
        return self.defaults["r"] if fitted is None else min(max(fitted, R_RANGE[0]), R_RANGE[1])

    def hit_probability(self, fanout: int) -> float:
        """P(hit) for an outcome prepared with `fanout` branches: as measured at that fan-out once
        min_lookups were seen there (one branch is common and the model's 1 - F^-r says 0 for it), else
        the model's."""
        if fanout <= 0:
            return 0.0
        seen = self._misses_by_f.get(fanout)
        if seen is not None and seen.count >= self.min_lookups:
            return 1.0 - seen.total / seen.count
        return 1.0 - fanout ** -self.r if fanout > 1 else self.hit_rate

    def tokens_per_round(self, source: ProposalSource) -> float:
        """Mean k* + 1 for rounds from `source`; before data: sum_{i<=K} a^i. The fast backup keeps
        FAST_PRIOR_ROUNDS rounds of that prior, so it is tried before it is judged: with a pessimistic
        prior (1 token) the neural backup won the choice at b = 1 before the fast one was ever measured,
        and kept it for the engine's life, even on text where prompt lookup does well."""
        source = ProposalSource(source)
        prior, tokens = expected_tokens_per_round(self.accept_rate, self.k), self._tokens[source]
        if source is ProposalSource.FAST:
            return (tokens.total + FAST_PRIOR_ROUNDS * prior) / (tokens.count + FAST_PRIOR_ROUNDS)
        return tokens.mean(prior)

    def mean_accepted(self, source: ProposalSource) -> float:
        return self.tokens_per_round(source) - 1.0

    def time(self, timing: Timing) -> float | None:
        """Mean seconds, or None before any measurement."""
        d = self._times[Timing(timing)]
        return d.total / d.count if d.count > 0 else None

    def relative_time(self, timing: Timing) -> float | None:
        """Mean time / mean verify time (the theorems' unit), or None before both were measured."""
        t, verify = self.time(timing), self.time(Timing.VERIFY)
        return t / verify if t is not None and verify else None

    def fanout(self, kind: FanOut, budget_or_list: int | Sequence[int], vocab_size: int,
               outcomes: SpecStats | None = None) -> list[int]:
        """resolve_fanout with the current r, and a and P(k*) of `outcomes` (another estimate of how the
        verified proposals fare: the draft's trees after target-side proposals; default this one's)."""
        model = outcomes or self
        return resolve_fanout(kind, budget_or_list, self.k, model.accept_rate, self.r, vocab_size, model.outcome_probs)

    @property
    def round_cost(self) -> float:
        """Theorem 7's max(1, T_p) as the target lives it: a round with trees costs its verify plus its
        wait for them (1 until both were measured). Why it matters: with a draft slower than the verify
        (T > 0 on a CPU, where every branch draws from a [K, V] q) a round already costs ~1.5 verifies,
        and b* taken as if it cost 1 chose the fast backup at b = 1, T = 0.7, whose n-gram proposals
        are rarely accepted when sampling (acceptance 0.30 against the neural backup's 0.64)."""
        return 1.0 + (self.relative_time(Timing.TREE_WAIT) or 0.0)

    def critical_batch_size(self, max_batch: int = MAX_CRITICAL_BATCH) -> int:
        """b* from the current estimates. Neural (b* = max_batch) until the neural backup was timed
        (its first misses time it); then the fast backup, presumed good until tried, gets tried too."""
        estimates = self._backup_estimates()
        return max_batch if estimates is None else critical_batch_size(*estimates, max_batch, self.round_cost)

    def fallback_explore_every(self, batch_size: int) -> int:
        """explore_every at batch_size from the throughputs b* compares (EXPLORE_EVERY before the neural
        backup was timed): the backup behind is tried less often the further behind it is."""
        estimates = self._backup_estimates()
        if estimates is None:
            return EXPLORE_EVERY
        p_hit, tokens_hit, tokens_neural, tokens_fast, t_neural = estimates
        neural = neural_backup_throughput(batch_size, p_hit, tokens_hit, tokens_neural, t_neural, self.round_cost)
        fast = fast_backup_throughput(batch_size, p_hit, tokens_hit, tokens_fast, self.round_cost)
        behind = self._times[Timing.NEURAL_BACKUP] if fast >= neural else self._tokens[ProposalSource.FAST]
        return explore_every(neural, fast, behind.count)

    def _backup_estimates(self) -> tuple[float, float, float, float, float] | None:
        """(p_hit, tokens of a hit's round, of a neural miss's, of a fast miss's, the neural backup's time
        relative to a verify): what the choice between the backups weighs; None before the neural backup
        was timed."""
        t_neural = self.relative_time(Timing.NEURAL_BACKUP)
        if t_neural is None:
            return None
        return (self.hit_rate, self.tokens_per_round(ProposalSource.CACHE), self.tokens_per_round(ProposalSource.NEURAL),
                self.tokens_per_round(ProposalSource.FAST), t_neural)
