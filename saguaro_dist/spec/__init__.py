"""Speculative maths: pure functions (tensors in, tensors out) plus the small state classes the
engine keeps (SpeculationCache, SpecStats). See each function's docstring for its formula."""
from __future__ import annotations

from saguaro_dist.spec.branches import BranchSet, full_acceptance_worth_skipping, select_branches, without_full_acceptance
from saguaro_dist.spec.budget import BudgetController, DraftLoad, draft_load, next_budget_scale, scaled_budget
from saguaro_dist.spec.cache import SpeculationCache
from saguaro_dist.spec.fallback import (
    choose_fallback,
    critical_batch_size,
    explore_fallback,
    fast_backup_throughput,
    neural_backup_throughput,
    ngram_proposal,
    random_proposal,
)
from saguaro_dist.spec.fanout import (
    geometric_fanout, geometric_outcome_probs, outcome_fanout, resolve_fanout, round_to_budget, uniform_fanout, vocab_caps,
)
from saguaro_dist.spec.logit_bias import bias_row
from saguaro_dist.spec.penalties import (
    apply_penalties, batch_position_counts, penalize_batch, penalize_positions, position_counts, prompt_mask,
)
from saguaro_dist.spec.sampling import (
    greedy_tokens,
    one_hot_probs,
    row_uniforms,
    saguaro_probs,
    sample,
    sample_with_uniforms,
    target_probs,
    top_f_mask,
    top_k_proposal,
)
from saguaro_dist.spec.stats import ProposalSource, SpecStats, Timing
from saguaro_dist.spec.theory import expected_tokens_per_round, predicted_speedup
from saguaro_dist.spec.verify import (
    VerifyResult,
    acceptance_ratios,
    bonus_probs,
    emitted_tokens,
    first_rejection,
    greedy_verify,
    residual_probs,
    verify,
)

__all__ = [
    "BranchSet", "select_branches", "without_full_acceptance", "full_acceptance_worth_skipping",
    "BudgetController", "DraftLoad", "draft_load", "next_budget_scale", "scaled_budget",
    "SpeculationCache",
    "choose_fallback", "explore_fallback", "critical_batch_size", "fast_backup_throughput", "neural_backup_throughput",
    "ngram_proposal", "random_proposal",
    "geometric_fanout", "geometric_outcome_probs", "outcome_fanout", "resolve_fanout", "round_to_budget",
    "uniform_fanout", "vocab_caps",
    "bias_row",
    "apply_penalties", "batch_position_counts", "penalize_batch", "penalize_positions", "position_counts", "prompt_mask",
    "greedy_tokens", "one_hot_probs", "row_uniforms", "saguaro_probs", "sample", "sample_with_uniforms", "target_probs",
    "top_f_mask", "top_k_proposal",
    "ProposalSource", "SpecStats", "Timing",
    "expected_tokens_per_round", "predicted_speedup",
    "VerifyResult", "acceptance_ratios", "bonus_probs", "emitted_tokens", "first_rejection", "greedy_verify",
    "residual_probs", "verify",
]
