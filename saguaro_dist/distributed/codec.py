"""Pure conversions between engine/messages.py dataclasses and their saguaro.v1 protobuf messages.

`*_to_proto` never fails on a well-formed dataclass; `*_from_proto` validates what it reads and raises
CodecError (a ValueError) on anything malformed, which the DraftService answers with INVALID_ARGUMENT.

This module holds one converter per message, their batches and the Speculate stream's envelopes: the
codec's public face. Beneath it: tensors (tensor_codec.py), proposals with their sparse or dense q
(proposal_codec.py) and the field checks with CodecError (wire_checks.py).
"""
from __future__ import annotations

import numpy as np
import torch

from saguaro_dist.distributed.proposal_codec import proposal_from_proto, proposal_to_proto
from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.distributed.tensor_codec import (
    INT32, array_to_proto, host_array, integer_array, tensor_from_proto, tensor_to_proto,
)
from saguaro_dist.distributed.tensor_codec import little_endian  # noqa: F401  re-export: tests use codec.little_endian
from saguaro_dist.distributed.wire_checks import (
    CodecError, duration, int64, non_negative, non_negative_ints, required,
)
from saguaro_dist.engine.messages import (
    DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Proposal, Release, ResetPrefixCache, SpeculationTree, TreePlan,
)
from saguaro_dist.engine.sequence import check_cache_salt

__all__ = [
    "CodecError",
    "tensor_to_proto", "tensor_from_proto",
    "sampling_to_proto", "sampling_from_proto",
    "proposal_to_proto", "proposal_from_proto",
    "prefill_to_proto", "prefill_from_proto",
    "jit_request_to_proto", "jit_request_from_proto",
    "outcome_to_proto", "outcome_from_proto",
    "tree_to_proto", "tree_from_proto",
    "plan_to_proto", "plan_from_proto",
    "release_to_proto", "release_from_proto",
    "prefill_batch_to_proto", "prefill_batch_from_proto",
    "jit_batch_to_proto", "jit_batch_from_proto",
    "proposal_batch_to_proto", "proposal_batch_from_proto",
    "outcome_batch_to_proto", "outcome_batch_from_proto",
    "tree_batch_to_proto", "tree_batch_from_proto",
    "plan_batch_to_proto", "plan_batch_from_proto",
    "release_batch_to_proto", "release_batch_from_proto",
    "jit_call_from_proto", "jit_result_to_proto", "jit_error_to_proto",
]


# ---- DraftSampling ------------------------------------------------------------------------------
def sampling_to_proto(s: DraftSampling) -> pb.DraftSampling:
    msg = pb.DraftSampling(temperature=float(s.temperature), top_k=int64(s.top_k, "top_k"), top_p=float(s.top_p),
                           min_p=float(s.min_p), presence_penalty=float(s.presence_penalty), frequency_penalty=float(s.frequency_penalty))
    if s.seed is not None:
        msg.seed = int64(s.seed, "seed")
    if s.repetition_penalty != 1:
        msg.repetition_penalty = float(s.repetition_penalty)
    msg.logit_bias.update({int64(t, "logit_bias token id"): b for t, b in s.logit_bias})
    msg.allowed_token_ids.extend(s.allowed_token_ids or ())
    msg.grammar = s.grammar or ""
    msg.bad_words.extend(pb.TokenList(ids=word) for word in s.bad_words)
    msg.min_tokens = int64(s.min_tokens, "min_tokens")
    msg.end_token_ids.extend(s.end_token_ids)
    return msg


def sampling_from_proto(msg: pb.DraftSampling) -> DraftSampling:
    seed = msg.seed if msg.HasField("seed") else None
    repetition = msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0
    try:
        return DraftSampling(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, min_p=msg.min_p, seed=seed,
                             presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                             repetition_penalty=repetition, logit_bias=dict(msg.logit_bias),
                             allowed_token_ids=list(msg.allowed_token_ids) or None, grammar=msg.grammar or None,
                             bad_words=[non_negative_ints(w.ids, "bad_words") for w in msg.bad_words],
                             min_tokens=non_negative(msg.min_tokens, "min_tokens"),
                             end_token_ids=non_negative_ints(msg.end_token_ids, "end_token_ids"))
    except ValueError as exc:
        raise CodecError(f"DraftSampling: {exc}") from None

# ---- one message per stage ----------------------------------------------------------------------
def prefill_to_proto(r: PrefillRequest) -> pb.PrefillRequest:
    return pb.PrefillRequest(seq_id=int64(r.seq_id, "seq_id"), prompt_token_ids=list(r.prompt_token_ids),
                             sampling=sampling_to_proto(r.sampling), shard=r.shard, num_shards=r.num_shards,
                             prompt_len=r.prompt_len, generation=r.generation, cache_salt=r.cache_salt)


def prefill_from_proto(msg: pb.PrefillRequest) -> PrefillRequest:
    sampling = sampling_from_proto(required(msg, "sampling", "PrefillRequest"))
    num_shards = max(1, msg.num_shards)  # 0: a sender that predates cache-parallel
    if not 0 <= msg.shard < num_shards:
        raise CodecError(f"PrefillRequest.shard must be in [0, num_shards={num_shards}), got {msg.shard}")
    if not 0 <= msg.prompt_len <= len(msg.prompt_token_ids):
        raise CodecError(f"PrefillRequest.prompt_len must be in [0, {len(msg.prompt_token_ids)}] "
                         f"(the tokens sent), got {msg.prompt_len}")
    return PrefillRequest(seq_id=msg.seq_id, prompt_token_ids=non_negative_ints(msg.prompt_token_ids, "prompt_token_ids"),
                          sampling=sampling, shard=msg.shard, num_shards=num_shards, prompt_len=msg.prompt_len,
                          generation=msg.generation, cache_salt=_cache_salt_from(msg))


def _cache_salt_from(msg: pb.PrefillRequest) -> str | None:
    """PrefillRequest.cache_salt, None when absent; a present one must pass the engine's check."""
    if not msg.HasField("cache_salt"):
        return None
    try:
        return check_cache_salt(msg.cache_salt, "PrefillRequest.cache_salt")
    except ValueError as exc:
        raise CodecError(str(exc)) from None


def jit_request_to_proto(r: JitDraftRequest) -> pb.JitDraftRequest:
    return pb.JitDraftRequest(seq_id=int64(r.seq_id, "seq_id"), round=r.round, accepted=r.accepted,
                              bonus_token=r.bonus_token, skip_tree=r.skip_tree, generation=r.generation)


def jit_request_from_proto(msg: pb.JitDraftRequest) -> JitDraftRequest:
    return JitDraftRequest(seq_id=msg.seq_id, round=non_negative(msg.round, "round"),
                           accepted=non_negative(msg.accepted, "accepted"),
                           bonus_token=non_negative(msg.bonus_token, "bonus_token"), skip_tree=msg.skip_tree,
                           generation=msg.generation)


def outcome_to_proto(o: Outcome) -> pb.Outcome:
    msg = pb.Outcome(seq_id=int64(o.seq_id, "seq_id"), round=o.round, accepted=o.accepted, bonus_token=o.bonus_token,
                     cache_hit=o.cache_hit, skip_tree=o.skip_tree, tree_wait_s=o.tree_wait_s,
                     target_proposed=o.target_proposed, generation=o.generation)
    if o.next_tokens is not None:
        msg.next_tokens.ids.extend(o.next_tokens)  # extend([]) still marks the field present
        msg.next_tokens.SetInParent()
    return msg


def outcome_from_proto(msg: pb.Outcome) -> Outcome:
    next_tokens = non_negative_ints(msg.next_tokens.ids, "next_tokens") if msg.HasField("next_tokens") else None
    return Outcome(seq_id=msg.seq_id, round=non_negative(msg.round, "round"),
                   accepted=non_negative(msg.accepted, "accepted"),
                   bonus_token=non_negative(msg.bonus_token, "bonus_token"), next_tokens=next_tokens,
                   cache_hit=msg.cache_hit, skip_tree=msg.skip_tree,
                   tree_wait_s=duration(msg.tree_wait_s, "tree_wait_s"), target_proposed=msg.target_proposed,
                   generation=msg.generation)


def tree_to_proto(t: SpeculationTree) -> pb.SpeculationTree:
    """The tree's columns (see the .proto): accepted [N], bonus tokens [N], tokens [N, K], q [N, K, V]."""
    n = t.num_branches
    if len(t.bonus_tokens) != n or (n and (t.proposals is None or t.proposals.tokens.ndim != 2
                                           or len(t.proposals.tokens) != n)):
        shape = None if t.proposals is None else list(t.proposals.tokens.shape)
        raise CodecError(f"SpeculationTree: {n} accepted counts, {len(t.bonus_tokens)} bonus tokens and tokens of "
                         f"shape {shape}: each branch needs one of each (tokens [N, K])")
    msg = pb.SpeculationTree(seq_id=int64(t.seq_id, "seq_id"), round=t.round, accepted=t.accepted,
                             bonus_tokens=t.bonus_tokens, build_s=t.build_s, generation=t.generation)
    if n:
        msg.proposals.CopyFrom(proposal_to_proto(t.proposals))
    return msg


def tree_from_proto(msg: pb.SpeculationTree) -> SpeculationTree:
    accepted = non_negative_ints(msg.accepted, "SpeculationTree.accepted")
    bonus = non_negative_ints(msg.bonus_tokens, "SpeculationTree.bonus_tokens")
    if len(accepted) != len(bonus):
        raise CodecError(f"SpeculationTree: {len(accepted)} accepted counts but {len(bonus)} bonus tokens")
    tree = SpeculationTree(msg.seq_id, non_negative(msg.round, "round"), build_s=duration(msg.build_s, "build_s"),
                           generation=msg.generation)
    if not accepted:
        return tree
    columns = proposal_from_proto(required(msg, "proposals", "SpeculationTree"), ndim=2)
    if len(columns.tokens) != len(accepted):
        raise CodecError(f"SpeculationTree: {len(accepted)} branches but {len(columns.tokens)} proposals")
    tree.accepted, tree.bonus_tokens, tree.proposals = accepted, bonus, columns
    return tree


def plan_to_proto(p: TreePlan) -> pb.TreePlan:
    """The plan's outcomes, and its guess (coupled bonus draws) if it carries one: ids [P, M], probs [P, M]."""
    if len(p.accepted) != len(p.bonus_tokens):
        raise CodecError(f"TreePlan: {len(p.accepted)} accepted counts but {len(p.bonus_tokens)} bonus tokens")
    msg = pb.TreePlan(seq_id=int64(p.seq_id, "seq_id"), round=p.round, accepted=p.accepted, bonus_tokens=p.bonus_tokens,
                      generation=p.generation)
    if p.guess_ids is None and p.guess_probs is None:
        return msg
    if p.guess_ids is None or p.guess_probs is None or p.guess_ids.dim() != 2 or p.guess_ids.shape != p.guess_probs.shape:
        shapes = [None if t is None else list(t.shape) for t in (p.guess_ids, p.guess_probs)]
        raise CodecError(f"TreePlan: a guess needs ids and probs of one [P, M] shape, got {shapes[0]} and {shapes[1]}")
    # Token ids as int32, as a proposal's: half the bytes, and every vocabulary is far below 2**31.
    msg.guess_ids.CopyFrom(array_to_proto(host_array(p.guess_ids).astype(np.int32), INT32))
    msg.guess_probs.CopyFrom(tensor_to_proto(p.guess_probs))
    return msg


def plan_from_proto(msg: pb.TreePlan) -> TreePlan:
    accepted = non_negative_ints(msg.accepted, "TreePlan.accepted")
    bonus = non_negative_ints(msg.bonus_tokens, "TreePlan.bonus_tokens")
    if len(accepted) != len(bonus):
        raise CodecError(f"TreePlan: {len(accepted)} accepted counts but {len(bonus)} bonus tokens")
    plan = TreePlan(msg.seq_id, non_negative(msg.round, "round"), accepted, bonus, generation=msg.generation)
    if msg.HasField("guess_ids") or msg.HasField("guess_probs"):
        plan.guess_ids, plan.guess_probs = _guess_from_proto(msg)
    return plan


def _guess_from_proto(msg: pb.TreePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [P, M] int64, probs [P, M]) of a plan's guess. The target draws the bonus against it, so a guess
    that is no distribution (negative or non-finite mass) is refused here: it would bias that draw."""
    ids = integer_array(required(msg, "guess_ids", "TreePlan"), "TreePlan.guess_ids")
    probs = tensor_from_proto(required(msg, "guess_probs", "TreePlan"))
    if ids.ndim != 2 or tuple(ids.shape) != tuple(probs.shape):
        raise CodecError(f"TreePlan: guess_ids and guess_probs must share one [P, M] shape, got {list(ids.shape)} "
                         f"and {list(probs.shape)}")
    if (ids < 0).any():
        raise CodecError("TreePlan.guess_ids has a negative token id")
    if not probs.is_floating_point() or not bool(((probs >= 0) & probs.isfinite()).all()):
        raise CodecError(f"TreePlan.guess_probs must be finite float probabilities >= 0, got dtype {probs.dtype}")
    return torch.from_numpy(ids.astype(np.int64)), probs


def release_to_proto(r: Release) -> pb.Release:
    return pb.Release(seq_id=int64(r.seq_id, "seq_id"), generation=r.generation)


def release_from_proto(msg: pb.Release) -> Release:
    return Release(seq_id=msg.seq_id, generation=msg.generation)


# ---- batch wrappers -----------------------------------------------------------------------------
def reset_prefix_cache_to_proto(_: ResetPrefixCache) -> pb.ResetPrefixCache:
    return pb.ResetPrefixCache()


def reset_prefix_cache_from_proto(_: pb.ResetPrefixCache) -> ResetPrefixCache:
    return ResetPrefixCache()


def prefill_batch_to_proto(reqs: list[PrefillRequest]) -> pb.PrefillBatch:
    return pb.PrefillBatch(requests=[prefill_to_proto(r) for r in reqs])


def prefill_batch_from_proto(msg: pb.PrefillBatch) -> list[PrefillRequest]:
    return [prefill_from_proto(r) for r in msg.requests]


def jit_batch_to_proto(reqs: list[JitDraftRequest]) -> pb.JitDraftBatch:
    return pb.JitDraftBatch(requests=[jit_request_to_proto(r) for r in reqs])


def jit_batch_from_proto(msg: pb.JitDraftBatch) -> list[JitDraftRequest]:
    return [jit_request_from_proto(r) for r in msg.requests]


def proposal_batch_to_proto(proposals: list[Proposal]) -> pb.ProposalBatch:
    return pb.ProposalBatch(proposals=[proposal_to_proto(p) for p in proposals])


def proposal_batch_from_proto(msg: pb.ProposalBatch) -> list[Proposal]:
    return [proposal_from_proto(p) for p in msg.proposals]


def outcome_batch_to_proto(outcomes: list[Outcome]) -> pb.OutcomeBatch:
    return pb.OutcomeBatch(outcomes=[outcome_to_proto(o) for o in outcomes])


def outcome_batch_from_proto(msg: pb.OutcomeBatch) -> list[Outcome]:
    return [outcome_from_proto(o) for o in msg.outcomes]


def outcome_rounds_to_proto(rounds: list[list[Outcome]]) -> pb.OutcomeRounds:
    return pb.OutcomeRounds(rounds=[outcome_batch_to_proto(r) for r in rounds])


def outcome_rounds_from_proto(msg: pb.OutcomeRounds) -> list[list[Outcome]]:
    rounds = [outcome_batch_from_proto(r) for r in msg.rounds]
    if any(not o.skip_tree for outcomes in rounds for o in outcomes):
        raise CodecError("OutcomeRounds: every outcome caught up on must want no tree (skip_tree); send the others "
                         "as outcomes")
    return rounds


def tree_batch_to_proto(trees: list[SpeculationTree]) -> pb.SpeculationTreeBatch:
    return pb.SpeculationTreeBatch(trees=[tree_to_proto(t) for t in trees])


def tree_batch_from_proto(msg: pb.SpeculationTreeBatch) -> list[SpeculationTree]:
    return [tree_from_proto(t) for t in msg.trees]


def plan_batch_to_proto(plans: list[TreePlan]) -> pb.TreePlanBatch:
    return pb.TreePlanBatch(plans=[plan_to_proto(p) for p in plans])


def plan_batch_from_proto(msg: pb.TreePlanBatch) -> list[TreePlan]:
    return [plan_from_proto(m) for m in msg.plans]


def release_batch_to_proto(reqs: list[Release]) -> pb.ReleaseBatch:
    return pb.ReleaseBatch(releases=[release_to_proto(r) for r in reqs])


def release_batch_from_proto(msg: pb.ReleaseBatch) -> list[Release]:
    return [release_from_proto(r) for r in msg.releases]


# ---- the Speculate stream's envelopes (the one-of wrappers need no codec of their own) ---------------
def jit_call_from_proto(msg: pb.JitDraftCall) -> tuple[int, list[JitDraftRequest]]:
    """(call_id, requests) of a just-in-time draft sent on the stream."""
    return msg.call_id, jit_batch_from_proto(required(msg, "batch", "JitDraftCall"))


def jit_result_to_proto(call_id: int, proposals: list[Proposal]) -> pb.SpeculateReply:
    return pb.SpeculateReply(jit_draft=pb.JitDraftResult(call_id=call_id, proposals=proposal_batch_to_proto(proposals)))


def jit_error_to_proto(call_id: int, code: int, message: str) -> pb.SpeculateReply:
    """code: a gRPC status code's number (grpc.StatusCode.X.value[0])."""
    return pb.SpeculateReply(jit_draft=pb.JitDraftResult(call_id=call_id, error=pb.CallError(code=code, message=message)))
