"""The round loops without a draft model: plain autoregressive decoding and prompt lookup (mode ngram),
and what the speculative loops (engine/sd_loop.py, ssd_loop.py) share with them: verifying speculations, and the
prompt-lookup proposal that is also SSD's fast backup."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from saguaro_dist.config import Config
from saguaro_dist.engine.lookup_rounds import LookupRounds
from saguaro_dist.engine.messages import Proposal
from saguaro_dist.engine.metrics import EngineMetrics
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.engine.target import TargetScorer
from saguaro_dist.spec import ProposalSource, ngram_proposal
from saguaro_dist.spec.coupled import Coupling


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

    def reset_prefix_cache(self) -> None:
        self.target.prefixes.clear()

    def close(self) -> None:
        pass


def verify_speculations(target: TargetScorer, metrics: EngineMetrics, seqs: list[Sequence],
                        coupling: Callable[[], Coupling | None] | None = None) -> list[list[int]]:
    """One target pass over every sequence's speculation: the tokens each gains (accepted, then the bonus);
    coupling: TargetScorer.verify's (its wait for the draft's plans, metrics.plan_wait_s, is not verify time)."""
    start, waited = time.perf_counter(), metrics.plan_wait_s
    accepted, bonus = target.verify(seqs, coupling)
    metrics.verify_s += time.perf_counter() - start - (metrics.plan_wait_s - waited)
    gained = []
    for s, k, t in zip(seqs, accepted, bonus):
        s.metrics.record_round(drafted=len(s.speculation.tokens), accepted=k)
        metrics.record_draft(drafted=len(s.speculation.tokens), accepted=k)
        gained.append(s.speculation.tokens[:k].tolist() + [t])
        s.last_outcome = (k, t)
    return gained


def lookup_proposal(tokens: list[int], config: Config) -> Proposal:
    """K tokens by prompt lookup (spec.ngram_proposal): deterministic, so q is one-hot (None)."""
    proposed = ngram_proposal(tokens, config.k, config.prompt_lookup_max, config.prompt_lookup_min)
    return Proposal(torch.tensor(proposed, dtype=torch.long), None)


class NgramLoop(ARLoop):
    """Prompt lookup (vLLM's "ngram" method): each round proposes the tokens that followed the latest
    earlier occurrence of the sequence's last n-gram (spec.ngram_proposal, SSD's fast backup), no draft
    model; K of them, or 1, 2K or 3K where that measures faster (engine/lookup_rounds.py). A deterministic
    proposal is a one-hot q, so the verification is exact as for any draft, whatever its length."""

    def __init__(self, target: TargetScorer, metrics: EngineMetrics, config: Config):
        super().__init__(target, metrics)
        self.lookups = LookupRounds(config, target.runner.max_positions)  # each round's length: engine/lookup_rounds.py

    def prepare(self, seqs):
        for s, proposal in zip(seqs, self.lookups.propose(seqs)):
            s.speculation, s.speculation_kind = proposal, ProposalSource.FAST

    def verify(self, seqs):
        verified_s = self.metrics.verify_s
        gained = verify_speculations(self.target, self.metrics, seqs)
        self.lookups.record(seqs, self.metrics.verify_s - verified_s)
        return gained
