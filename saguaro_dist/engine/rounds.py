"""One round loop per mode. The Engine drives: admit -> prepare -> verify, every step.

- admit(seqs):   prefill new sequences; returns each one's first token.
- prepare(seqs): give every sequence the speculation it verifies this round.
- verify(seqs):  one batched target pass; returns the tokens each sequence gained.
"""
from __future__ import annotations

import logging
import time

import torch

from saguaro_dist.config import Config, FallbackPolicy, Mode
from saguaro_dist.distributed.errors import DraftUnavailable
from saguaro_dist.engine.messages import JitDraftRequest, Outcome, PrefillRequest, Proposal, Release
from saguaro_dist.engine.metrics import EngineMetrics
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.engine.target import TargetScorer
from saguaro_dist.spec import choose_fallback, critical_batch_size, ngram_proposal, random_proposal

log = logging.getLogger(__name__)


class ARLoop:
    """Plain autoregressive decoding with the target alone."""

    def __init__(self, target: TargetScorer, metrics: EngineMetrics):
        self.target, self.metrics = target, metrics

    def admit(self, seqs: list[Sequence]) -> list[int]:
        return self.target.prefill(seqs)

    def prepare(self, seqs: list[Sequence]) -> None:
        pass

    def verify(self, seqs: list[Sequence]) -> list[list[int]]:
        for s in seqs:
            s.metrics.record_round(drafted=0, accepted=0)
        return [[t] for t in self.target.decode(seqs)]

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.target.release(s)

    def close(self) -> None:
        pass


class SDLoop(ARLoop):
    """Speculative decoding: the draft drafts K tokens just in time, then the target verifies."""

    def __init__(self, target: TargetScorer, draft, metrics: EngineMetrics):
        super().__init__(target, metrics)
        self.draft = draft

    def admit(self, seqs):
        first = self.target.prefill(seqs)
        self.draft.prefill([PrefillRequest(s.seq_id, s.prompt_token_ids, s.draft_sampling()) for s in seqs])
        for s, t in zip(seqs, first):
            s.last_outcome, s.speculation = (0, t), None
        return first

    def prepare(self, seqs):
        self._jit(seqs)

    def verify(self, seqs):
        start = time.perf_counter()
        accepted, bonus = self.target.verify(seqs)
        self.metrics.verify_s += time.perf_counter() - start
        gained = []
        for s, k, t in zip(seqs, accepted, bonus):
            s.metrics.record_round(drafted=len(s.speculation.tokens), accepted=k)
            gained.append(s.speculation.tokens[:k].tolist() + [t])
            s.last_outcome = (k, t)
        return gained

    def release(self, seqs):
        super().release(seqs)
        self.draft.release([Release(s.seq_id) for s in seqs])

    def close(self):
        self.draft.close()

    def _jit(self, seqs: list[Sequence]) -> None:
        """Neural draft for the real outcome: the first speculation is round 0, then one round per call."""
        if not seqs:
            return
        for s in seqs:
            s.round = s.round + 1 if s.speculation is not None else 0
        start = time.perf_counter()
        reqs = [JitDraftRequest(s.seq_id, s.round, *s.last_outcome) for s in seqs]
        for s, proposal in zip(seqs, self.draft.jit_draft(reqs)):
            s.speculation = proposal
        self.metrics.draft_wait_s += time.perf_counter() - start


class FallbackCosts:
    """Running estimates behind the batch-aware fallback choice (Saguaro Theorem 17)."""

    def __init__(self):
        self.hits = self.lookups = 0
        self.tokens = {"hit": [0, 0], "neural": [0, 0], "fast": [0, 0]}  # kind -> [tokens gained, rounds]
        self.verify_s = self.neural_s = 0.0
        self.verify_n = self.neural_n = 0

    def mean_tokens(self, kind: str, default: float) -> float:
        gained, rounds = self.tokens[kind]
        return gained / rounds if rounds else default

    def critical_batch_size(self, k: int) -> int:
        if not self.lookups or not self.verify_n or not self.neural_n:
            return 1 << 30  # no measurements yet: the neural backup is the safe choice
        t_neural = (self.neural_s / self.neural_n) / (self.verify_s / self.verify_n)
        return critical_batch_size(
            p_hit=self.hits / self.lookups, tokens_hit=self.mean_tokens("hit", k + 1.0),
            tokens_neural_miss=self.mean_tokens("neural", k / 2 + 1), tokens_fast_miss=self.mean_tokens("fast", 1.0),
            t_neural=t_neural)


class SSDLoop(SDLoop):
    """Speculative speculative decoding: trees are prepared while the target verifies."""

    def __init__(self, target: TargetScorer, draft, metrics: EngineMetrics, config: Config):
        super().__init__(target, draft, metrics)
        self.config = config
        self.costs = FallbackCosts()

    def prepare(self, seqs):
        new = [s for s in seqs if s.speculation is None]
        self._jit(new)
        running = [s for s in seqs if s.speculation is not None and s not in new]
        outcomes = self._next_speculations(running) if running else []
        self.draft.send_outcomes(outcomes)  # the draft starts the next trees now, while we verify

    def verify(self, seqs):
        start = time.perf_counter()
        gained = super().verify(seqs)
        self.costs.verify_s += time.perf_counter() - start
        self.costs.verify_n += 1
        for s, g in zip(seqs, gained):
            self.costs.tokens[s.speculation_kind][0] += len(g)
            self.costs.tokens[s.speculation_kind][1] += 1
        return gained

    def _jit(self, seqs):
        super()._jit(seqs)
        for s in seqs:
            s.speculation_kind = "neural"

    def _next_speculations(self, seqs: list[Sequence]) -> list[Outcome]:
        """Hits take their cached branch; misses go to the fallback. Returns the outcomes to stream."""
        start = time.perf_counter()
        trees = self.draft.wait_trees([(s.seq_id, s.round) for s in seqs], self.config.tree_timeout_s)
        self.metrics.draft_wait_s += time.perf_counter() - start
        outcomes, misses = [], []
        for s in seqs:
            branch = self._lookup(trees.get(s.seq_id), s.last_outcome)
            if branch is None:
                misses.append(s)
                continue
            s.metrics.cache_hits += 1
            outcomes.append(Outcome(s.seq_id, s.round, *s.last_outcome, next_tokens=None))
            s.speculation, s.speculation_kind, s.round = branch, "hit", s.round + 1
        self._count_lookups(len(seqs), len(seqs) - len(misses))
        return outcomes + self._fallback(misses, len(seqs))

    @staticmethod
    def _lookup(tree, outcome) -> Proposal | None:
        if tree is None:
            return None
        return next((b.proposal for b in tree.branches if (b.accepted, b.bonus_token) == tuple(outcome)), None)

    def _count_lookups(self, lookups: int, hits: int) -> None:
        self.costs.lookups += lookups
        self.costs.hits += hits
        self.metrics.cache_hits += hits
        self.metrics.cache_misses += lookups - hits

    def _fallback(self, misses: list[Sequence], batch_size: int) -> list[Outcome]:
        if not misses:
            return []
        for s in misses:
            s.metrics.cache_misses += 1
        kind = choose_fallback(self.config.fallback, batch_size, self.costs.critical_batch_size(self.config.k))
        if kind is FallbackPolicy.NEURAL:
            try:
                return self._neural(misses)
            except DraftUnavailable as err:  # a dead draft worker costs speed, never tokens
                log.warning("draft unavailable (%s): fast backup for %d sequences", err, len(misses))
                kind = FallbackPolicy.FAST
        return self._fast(misses, kind)

    def _neural(self, misses: list[Sequence]) -> list[Outcome]:
        start = time.perf_counter()
        self._jit(misses)
        self.costs.neural_s += time.perf_counter() - start
        self.costs.neural_n += 1
        for s in misses:
            s.metrics.record_fallback(FallbackPolicy.NEURAL.value)
            self.metrics.fallbacks[FallbackPolicy.NEURAL.value] += 1
        return []  # the just-in-time draft told the draft side everything

    def _fast(self, misses: list[Sequence], kind: FallbackPolicy) -> list[Outcome]:
        outcomes = []
        for s in misses:
            k, t = s.last_outcome
            s.speculation, s.speculation_kind = self._fast_proposal(s, kind), "fast"
            outcomes.append(Outcome(s.seq_id, s.round, k, t, next_tokens=s.speculation.tokens.tolist()))
            s.round += 1
            s.metrics.record_fallback(kind.value)
            self.metrics.fallbacks[kind.value] += 1
        return outcomes

    def _fast_proposal(self, s: Sequence, kind: FallbackPolicy) -> Proposal:
        k, vocab = self.config.k, self.target.vocab_size
        if kind is FallbackPolicy.RANDOM:
            tokens = random_proposal(vocab, k, s.generator)
            return Proposal(tokens, torch.full((k, vocab), 1.0 / vocab))  # drawn uniformly: q is uniform
        return Proposal(torch.tensor(ngram_proposal(s.tokens, k), dtype=torch.long), None)  # deterministic: one-hot


def build_loop(config: Config, target: TargetScorer, draft, metrics: EngineMetrics):
    """The round loop for the configured mode."""
    loops = {
        Mode.AR: lambda: ARLoop(target, metrics),
        Mode.SD: lambda: SDLoop(target, draft, metrics),
        Mode.SSD: lambda: SSDLoop(target, draft, metrics, config),
    }
    return loops[config.mode]()
