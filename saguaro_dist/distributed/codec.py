"""Pure conversions between engine/messages.py dataclasses and their saguaro.v1 protobuf messages.

`*_to_proto` never fails on a well-formed dataclass; `*_from_proto` validates what it reads and raises
CodecError (a ValueError) on anything malformed, which the DraftService answers with INVALID_ARGUMENT.

Proposal distributions travel in the cheapest exact form: nothing for None (one-hot), sparse
(ids + probs of the support) when the draft's q was truncated (top-k / top-p) so that is smaller,
dense bytes otherwise. Every float crosses bit for bit.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.engine.messages import (
    DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Proposal, Release, ResetPrefixCache, SpeculationTree, TreePlan,
)

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


class CodecError(ValueError):
    """A protobuf message that does not describe a valid protocol message."""


_DT = pb.Tensor.DType
_DTYPES = {
    torch.float32: _DT.FLOAT32, torch.float16: _DT.FLOAT16, torch.bfloat16: _DT.BFLOAT16,
    torch.float64: _DT.FLOAT64, torch.int64: _DT.INT64, torch.int32: _DT.INT32, torch.int16: _DT.INT16,
    torch.int8: _DT.INT8, torch.uint8: _DT.UINT8, torch.bool: _DT.BOOL,
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}
_INT32 = _DT.INT32
_ITEMSIZE = {d: d.itemsize for d in _DTYPES}
# Bytes move through numpy: a torch op costs ~10 us here, a numpy call ~1 us, and a tree is dozens of
# small tensors. numpy has no bfloat16: its elements travel as their int16 bits.
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16, torch.float64: np.float64,
          torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
          torch.uint8: np.uint8, torch.bool: np.bool_}
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1
# A sparse q is laid out dense on arrival, [rows, vocab_size], by a vocab_size the message states. A real
# one is far smaller (a 48-row tree over a 262k vocabulary: 50 MB in float32).
MAX_LAID_OUT_BYTES = 1 << 30


# ---- tensors ------------------------------------------------------------------------------------
def little_endian(arr: np.ndarray) -> np.ndarray:
    """arr with little-endian elements: the wire's byte order (a no-op on little-endian hosts)."""
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False)


def host_array(t: torch.Tensor) -> np.ndarray:
    """t's elements as a numpy array in host memory (bfloat16 as its int16 bits; strides kept)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def tensor_to_proto(t: torch.Tensor) -> pb.Tensor:
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise CodecError(f"tensor dtype {t.dtype} has no wire form")
    return _array_to_proto(host_array(t), dtype)


def _array_to_proto(arr: np.ndarray, dtype) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=list(arr.shape), data=little_endian(arr).tobytes())  # C order


def tensor_from_proto(msg: pb.Tensor) -> torch.Tensor:
    dtype = _TORCH_DTYPES.get(msg.dtype)
    if dtype is None:
        raise CodecError(f"tensor dtype {msg.dtype} is not supported")
    t = torch.from_numpy(_array_from_proto(msg, dtype))
    return t.view(torch.bfloat16) if dtype is torch.bfloat16 else t


def _array_from_proto(msg: pb.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A private, writable, native-order copy of the message's elements, shaped."""
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise CodecError(f"tensor shape {shape} has a negative dimension")
    numel = _numel(shape)
    if len(msg.data) != numel * _ITEMSIZE[dtype]:
        raise CodecError(f"tensor of shape {shape} and dtype {dtype} needs {numel * _ITEMSIZE[dtype]} bytes, "
                         f"got {len(msg.data)}")
    wire = np.dtype(_NUMPY[dtype]).newbyteorder("<")
    return np.frombuffer(msg.data, dtype=wire).astype(wire.newbyteorder("="), copy=True).reshape(shape)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- scalars ------------------------------------------------------------------------------------
def _int64(value, what: str) -> int:
    """Protobuf would raise its own error on overflow; name the field instead."""
    value = int(value)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise CodecError(f"{what} = {value} does not fit in int64")
    return value


def _non_negative(value: int, what: str) -> int:
    if value < 0:
        raise CodecError(f"{what} must be >= 0, got {value}")
    return value


def _duration(value: float, what: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise CodecError(f"{what} must be a finite number of seconds >= 0, got {value}")
    return value


def _non_negative_ints(ids, what: str) -> list[int]:
    """Token ids, accepted counts: a repeated int64 field as a list, every value >= 0."""
    ids = list(ids)
    if any(t < 0 for t in ids):
        raise CodecError(f"{what} has a negative value")
    return ids


def _required(msg, field: str, owner: str):
    if not msg.HasField(field):
        raise CodecError(f"{owner}.{field} is required")
    return getattr(msg, field)


# ---- DraftSampling ------------------------------------------------------------------------------
def sampling_to_proto(s: DraftSampling) -> pb.DraftSampling:
    msg = pb.DraftSampling(temperature=float(s.temperature), top_k=_int64(s.top_k, "top_k"), top_p=float(s.top_p),
                           min_p=float(s.min_p), presence_penalty=float(s.presence_penalty), frequency_penalty=float(s.frequency_penalty))
    if s.seed is not None:
        msg.seed = _int64(s.seed, "seed")
    if s.repetition_penalty != 1:
        msg.repetition_penalty = float(s.repetition_penalty)
    msg.logit_bias.update({_int64(t, "logit_bias token id"): b for t, b in s.logit_bias})
    msg.allowed_token_ids.extend(s.allowed_token_ids or ())
    msg.grammar = s.grammar or ""
    return msg


def sampling_from_proto(msg: pb.DraftSampling) -> DraftSampling:
    seed = msg.seed if msg.HasField("seed") else None
    repetition = msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0
    try:
        return DraftSampling(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, min_p=msg.min_p, seed=seed,
                             presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                             repetition_penalty=repetition, logit_bias=dict(msg.logit_bias),
                             allowed_token_ids=list(msg.allowed_token_ids) or None, grammar=msg.grammar or None)
    except ValueError as exc:
        raise CodecError(f"DraftSampling: {exc}") from None


# ---- Proposal -----------------------------------------------------------------------------------
def proposal_to_proto(p: Proposal) -> pb.Proposal:
    """tokens [K] and q [K, V]; or, for a tree's columns, tokens [N, K] and q [N, K, V]."""
    # Token ids travel as int32: half the bytes, and every vocabulary is far below 2**31.
    tokens = host_array(p.tokens)
    msg = pb.Proposal(tokens=_array_to_proto(tokens.astype(np.int32), _INT32))
    if p.probs is None:
        return msg
    probs = host_array(p.probs)  # one device copy; everything below runs on host memory
    if probs.shape[:-1] != tokens.shape:
        raise CodecError(f"proposal probs must be tokens' shape {list(tokens.shape)} + [V], got {list(probs.shape)}")
    dtype = _DTYPES.get(p.probs.dtype)
    if dtype is None:
        raise CodecError(f"proposal probs dtype {p.probs.dtype} has no wire form")
    # A bool mask first: numpy scans bools ~10x faster than floats. (bfloat16 bits: nonzero iff the
    # value is, for p >= 0.)
    support = probs != 0
    if _sparse_bytes(probs, int(np.count_nonzero(support))) < probs.nbytes:
        msg.sparse.CopyFrom(_sparse_to_proto(probs.reshape(-1, probs.shape[-1]), support, dtype))
    else:
        msg.dense.CopyFrom(_array_to_proto(probs, dtype))
    return msg


def _sparse_bytes(probs: np.ndarray, nnz: int) -> int:
    return nnz * (4 + probs.itemsize) + (probs.size // probs.shape[-1] + 1) * 4


def _sparse_to_proto(probs: np.ndarray, support: np.ndarray, dtype) -> pb.SparseProbs:
    """probs [rows, V] (support: probs != 0) in compressed-row form, from one flat scan of the bool
    mask (on a [48, 2048] q: a 2-D np.nonzero of the floats ~800 us, this ~75 us)."""
    rows, vocab = probs.shape
    flat = np.flatnonzero(support)  # row-major order: rows ascending
    offsets = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(np.bincount(flat // vocab, minlength=rows), out=offsets[1:])
    return pb.SparseProbs(
        vocab_size=vocab,
        row_offsets=_array_to_proto(offsets, _INT32),
        token_ids=_array_to_proto((flat % vocab).astype(np.int32), _INT32),
        probs=_array_to_proto(probs.reshape(-1)[flat], dtype),
    )


def proposal_from_proto(msg: pb.Proposal, ndim: int = 1) -> Proposal:
    """A Proposal of tokens [K] (ndim 1), or a tree's columns: tokens [N, K], q [N, K, V] (ndim 2)."""
    tokens = _integer_array(_required(msg, "tokens", "Proposal"), "Proposal.tokens")
    if tokens.ndim != ndim:
        raise CodecError(f"Proposal.tokens must be {ndim}-D, got shape {list(tokens.shape)}")
    if (tokens < 0).any():
        raise CodecError("Proposal.tokens has a negative token id")
    kind = msg.WhichOneof("probs")
    probs = None
    if kind == "dense":
        probs = _dense_from_proto(msg.dense, tokens.shape)
    elif kind == "sparse":
        probs = _sparse_from_proto(msg.sparse, tokens.size).reshape(*tokens.shape, -1)
    return Proposal(tokens=torch.from_numpy(tokens.astype(np.int64)), probs=probs)


def _integer_array(msg: pb.Tensor, what: str) -> np.ndarray:
    dtype = _TORCH_DTYPES.get(msg.dtype)
    if dtype is None or dtype.is_floating_point or dtype == torch.bool:
        raise CodecError(f"{what} must be an integer tensor, got dtype {dtype or msg.dtype}")
    return _array_from_proto(msg, dtype)


def _dense_from_proto(msg: pb.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    probs = tensor_from_proto(msg)
    if probs.shape[:-1] != shape or probs.dim() != len(shape) + 1 or not probs.is_floating_point():
        raise CodecError(f"dense probs must be a float {list(shape)} + [V] tensor, got {probs.dtype} {list(probs.shape)}")
    return probs


def _sparse_from_proto(msg: pb.SparseProbs, k: int) -> torch.Tensor:
    offsets = _integer_array(_required(msg, "row_offsets", "SparseProbs"), "sparse probs: row_offsets").astype(np.int64)
    ids = _integer_array(_required(msg, "token_ids", "SparseProbs"), "sparse probs: token_ids").astype(np.int64)
    values_msg = _required(msg, "probs", "SparseProbs")
    dtype = _TORCH_DTYPES.get(values_msg.dtype)
    if dtype is None or not dtype.is_floating_point:
        raise CodecError("sparse probs: probs must be float")
    values = _array_from_proto(values_msg, dtype)
    _check_sparse(offsets, ids, values, k, msg.vocab_size)
    probs = np.zeros((k, msg.vocab_size), dtype=values.dtype)
    probs[np.repeat(np.arange(k), np.diff(offsets)), ids] = values
    probs = torch.from_numpy(probs)
    return probs.view(torch.bfloat16) if dtype is torch.bfloat16 else probs


def _check_sparse(offsets: np.ndarray, ids: np.ndarray, values: np.ndarray, k: int, vocab_size: int) -> None:
    nnz = len(ids)
    if offsets.ndim != 1 or len(offsets) != k + 1 or offsets[0] != 0 or offsets[-1] != nnz:
        raise CodecError(f"sparse probs: row_offsets must be [K+1={k + 1}] from 0 to nnz={nnz}")
    if (offsets[1:] < offsets[:-1]).any():
        raise CodecError("sparse probs: row_offsets must be non-decreasing")
    if ids.ndim != 1 or values.ndim != 1 or len(values) != nnz:
        raise CodecError("sparse probs: token_ids and probs must be 1-D of the same length, probs float")
    if vocab_size <= 0 or (nnz and (ids.min() < 0 or ids.max() >= vocab_size)):
        raise CodecError(f"sparse probs: token ids must lie in [0, vocab_size={vocab_size})")
    ascending = np.diff(ids) > 0  # within a row, as the encoder writes them: a repeated id would overwrite
    ascending[offsets[1:-1][(0 < offsets[1:-1]) & (offsets[1:-1] < nnz)] - 1] = True  # a new row may start lower
    if not ascending.all():
        raise CodecError("sparse probs: a row's token ids must ascend (each id once)")
    laid_out = k * vocab_size * values.itemsize
    if laid_out > MAX_LAID_OUT_BYTES:  # vocab_size is only claimed: it must not size an allocation unchecked
        raise CodecError(f"sparse probs: {k} rows of vocab_size {vocab_size} would lay out {laid_out} bytes, over "
                         f"the {MAX_LAID_OUT_BYTES} byte limit")


# ---- one message per stage ----------------------------------------------------------------------
def prefill_to_proto(r: PrefillRequest) -> pb.PrefillRequest:
    return pb.PrefillRequest(seq_id=_int64(r.seq_id, "seq_id"), prompt_token_ids=list(r.prompt_token_ids),
                             sampling=sampling_to_proto(r.sampling), shard=r.shard, num_shards=r.num_shards,
                             prompt_len=r.prompt_len, generation=r.generation)


def prefill_from_proto(msg: pb.PrefillRequest) -> PrefillRequest:
    sampling = sampling_from_proto(_required(msg, "sampling", "PrefillRequest"))
    num_shards = max(1, msg.num_shards)  # 0: a sender that predates cache-parallel
    if not 0 <= msg.shard < num_shards:
        raise CodecError(f"PrefillRequest.shard must be in [0, num_shards={num_shards}), got {msg.shard}")
    if not 0 <= msg.prompt_len <= len(msg.prompt_token_ids):
        raise CodecError(f"PrefillRequest.prompt_len must be in [0, {len(msg.prompt_token_ids)}] "
                         f"(the tokens sent), got {msg.prompt_len}")
    return PrefillRequest(seq_id=msg.seq_id, prompt_token_ids=_non_negative_ints(msg.prompt_token_ids, "prompt_token_ids"),
                          sampling=sampling, shard=msg.shard, num_shards=num_shards, prompt_len=msg.prompt_len,
                          generation=msg.generation)


def jit_request_to_proto(r: JitDraftRequest) -> pb.JitDraftRequest:
    return pb.JitDraftRequest(seq_id=_int64(r.seq_id, "seq_id"), round=r.round, accepted=r.accepted,
                              bonus_token=r.bonus_token, skip_tree=r.skip_tree, generation=r.generation)


def jit_request_from_proto(msg: pb.JitDraftRequest) -> JitDraftRequest:
    return JitDraftRequest(seq_id=msg.seq_id, round=_non_negative(msg.round, "round"),
                           accepted=_non_negative(msg.accepted, "accepted"),
                           bonus_token=_non_negative(msg.bonus_token, "bonus_token"), skip_tree=msg.skip_tree,
                           generation=msg.generation)


def outcome_to_proto(o: Outcome) -> pb.Outcome:
    msg = pb.Outcome(seq_id=_int64(o.seq_id, "seq_id"), round=o.round, accepted=o.accepted, bonus_token=o.bonus_token,
                     cache_hit=o.cache_hit, skip_tree=o.skip_tree, tree_wait_s=o.tree_wait_s,
                     target_proposed=o.target_proposed, generation=o.generation)
    if o.next_tokens is not None:
        msg.next_tokens.ids.extend(o.next_tokens)  # extend([]) still marks the field present
        msg.next_tokens.SetInParent()
    return msg


def outcome_from_proto(msg: pb.Outcome) -> Outcome:
    next_tokens = _non_negative_ints(msg.next_tokens.ids, "next_tokens") if msg.HasField("next_tokens") else None
    return Outcome(seq_id=msg.seq_id, round=_non_negative(msg.round, "round"),
                   accepted=_non_negative(msg.accepted, "accepted"),
                   bonus_token=_non_negative(msg.bonus_token, "bonus_token"), next_tokens=next_tokens,
                   cache_hit=msg.cache_hit, skip_tree=msg.skip_tree,
                   tree_wait_s=_duration(msg.tree_wait_s, "tree_wait_s"), target_proposed=msg.target_proposed,
                   generation=msg.generation)


def tree_to_proto(t: SpeculationTree) -> pb.SpeculationTree:
    """The tree's columns (see the .proto): accepted [N], bonus tokens [N], tokens [N, K], q [N, K, V]."""
    n = t.num_branches
    if len(t.bonus_tokens) != n or (n and (t.proposals is None or t.proposals.tokens.ndim != 2
                                           or len(t.proposals.tokens) != n)):
        shape = None if t.proposals is None else list(t.proposals.tokens.shape)
        raise CodecError(f"SpeculationTree: {n} accepted counts, {len(t.bonus_tokens)} bonus tokens and tokens of "
                         f"shape {shape}: each branch needs one of each (tokens [N, K])")
    msg = pb.SpeculationTree(seq_id=_int64(t.seq_id, "seq_id"), round=t.round, accepted=t.accepted,
                             bonus_tokens=t.bonus_tokens, build_s=t.build_s, generation=t.generation)
    if n:
        msg.proposals.CopyFrom(proposal_to_proto(t.proposals))
    return msg


def tree_from_proto(msg: pb.SpeculationTree) -> SpeculationTree:
    accepted = _non_negative_ints(msg.accepted, "SpeculationTree.accepted")
    bonus = _non_negative_ints(msg.bonus_tokens, "SpeculationTree.bonus_tokens")
    if len(accepted) != len(bonus):
        raise CodecError(f"SpeculationTree: {len(accepted)} accepted counts but {len(bonus)} bonus tokens")
    tree = SpeculationTree(msg.seq_id, _non_negative(msg.round, "round"), build_s=_duration(msg.build_s, "build_s"),
                           generation=msg.generation)
    if not accepted:
        return tree
    columns = proposal_from_proto(_required(msg, "proposals", "SpeculationTree"), ndim=2)
    if len(columns.tokens) != len(accepted):
        raise CodecError(f"SpeculationTree: {len(accepted)} branches but {len(columns.tokens)} proposals")
    tree.accepted, tree.bonus_tokens, tree.proposals = accepted, bonus, columns
    return tree


def plan_to_proto(p: TreePlan) -> pb.TreePlan:
    """The plan's outcomes, and its guess (coupled bonus draws) if it carries one: ids [P, M], probs [P, M]."""
    if len(p.accepted) != len(p.bonus_tokens):
        raise CodecError(f"TreePlan: {len(p.accepted)} accepted counts but {len(p.bonus_tokens)} bonus tokens")
    msg = pb.TreePlan(seq_id=_int64(p.seq_id, "seq_id"), round=p.round, accepted=p.accepted, bonus_tokens=p.bonus_tokens,
                      generation=p.generation)
    if p.guess_ids is None and p.guess_probs is None:
        return msg
    if p.guess_ids is None or p.guess_probs is None or p.guess_ids.dim() != 2 or p.guess_ids.shape != p.guess_probs.shape:
        shapes = [None if t is None else list(t.shape) for t in (p.guess_ids, p.guess_probs)]
        raise CodecError(f"TreePlan: a guess needs ids and probs of one [P, M] shape, got {shapes[0]} and {shapes[1]}")
    # Token ids as int32, as a proposal's: half the bytes, and every vocabulary is far below 2**31.
    msg.guess_ids.CopyFrom(_array_to_proto(host_array(p.guess_ids).astype(np.int32), _INT32))
    msg.guess_probs.CopyFrom(tensor_to_proto(p.guess_probs))
    return msg


def plan_from_proto(msg: pb.TreePlan) -> TreePlan:
    accepted = _non_negative_ints(msg.accepted, "TreePlan.accepted")
    bonus = _non_negative_ints(msg.bonus_tokens, "TreePlan.bonus_tokens")
    if len(accepted) != len(bonus):
        raise CodecError(f"TreePlan: {len(accepted)} accepted counts but {len(bonus)} bonus tokens")
    plan = TreePlan(msg.seq_id, _non_negative(msg.round, "round"), accepted, bonus, generation=msg.generation)
    if msg.HasField("guess_ids") or msg.HasField("guess_probs"):
        plan.guess_ids, plan.guess_probs = _guess_from_proto(msg)
    return plan


def _guess_from_proto(msg: pb.TreePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [P, M] int64, probs [P, M]) of a plan's guess. The target draws the bonus against it, so a guess
    that is no distribution (negative or non-finite mass) is refused here: it would bias that draw."""
    ids = _integer_array(_required(msg, "guess_ids", "TreePlan"), "TreePlan.guess_ids")
    probs = tensor_from_proto(_required(msg, "guess_probs", "TreePlan"))
    if ids.ndim != 2 or tuple(ids.shape) != tuple(probs.shape):
        raise CodecError(f"TreePlan: guess_ids and guess_probs must share one [P, M] shape, got {list(ids.shape)} "
                         f"and {list(probs.shape)}")
    if (ids < 0).any():
        raise CodecError("TreePlan.guess_ids has a negative token id")
    if not probs.is_floating_point() or not bool(((probs >= 0) & probs.isfinite()).all()):
        raise CodecError(f"TreePlan.guess_probs must be finite float probabilities >= 0, got dtype {probs.dtype}")
    return torch.from_numpy(ids.astype(np.int64)), probs


def release_to_proto(r: Release) -> pb.Release:
    return pb.Release(seq_id=_int64(r.seq_id, "seq_id"), generation=r.generation)


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
    return msg.call_id, jit_batch_from_proto(_required(msg, "batch", "JitDraftCall"))


def jit_result_to_proto(call_id: int, proposals: list[Proposal]) -> pb.SpeculateReply:
    return pb.SpeculateReply(jit_draft=pb.JitDraftResult(call_id=call_id, proposals=proposal_batch_to_proto(proposals)))


def jit_error_to_proto(call_id: int, code: int, message: str) -> pb.SpeculateReply:
    """code: a gRPC status code's number (grpc.StatusCode.X.value[0])."""
    return pb.SpeculateReply(jit_draft=pb.JitDraftResult(call_id=call_id, error=pb.CallError(code=code, message=message)))
