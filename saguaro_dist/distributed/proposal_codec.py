"""Proposals (draft tokens and their distribution q) as saguaro.v1 Proposal messages.

q travels in the cheapest exact form: nothing for None (one-hot), sparse (ids + probs of the support)
when the draft's q was truncated (top-k / top-p) so that is smaller, dense bytes otherwise. Every
float crosses bit for bit; decoding validates (q included: a distribution, positive at each drafted token, so
verification stays exact) and raises CodecError.
"""
from __future__ import annotations

import numpy as np
import torch

from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.distributed.tensor_codec import (
    INT32, MAX_EXTENT, TORCH_DTYPES, WIRE_DTYPES, array_from_proto, array_to_proto, host_array, integer_array,
    tensor_from_proto,
)
from saguaro_dist.distributed.wire_checks import CodecError, required
from saguaro_dist.engine.messages import Proposal

__all__ = ["MAX_LAID_OUT_BYTES", "mass_tolerance", "proposal_to_proto", "proposal_from_proto"]

# A sparse q is laid out dense on arrival, [rows, vocab_size], by a vocab_size the message states. A real
# one is far smaller (a 48-row tree over a 262k vocabulary: 50 MB in float32).
MAX_LAID_OUT_BYTES = 1 << 30


def proposal_to_proto(p: Proposal) -> pb.Proposal:
    """tokens [K] and q [K, V]; or, for a tree's columns, tokens [N, K] and q [N, K, V]."""
    # Token ids travel as int32: half the bytes, and every vocabulary is far below 2**31.
    tokens = host_array(p.tokens)
    msg = pb.Proposal(tokens=array_to_proto(tokens.astype(np.int32), INT32))
    if p.probs is None:
        return msg
    probs = host_array(p.probs)  # one device copy; everything below runs on host memory
    if probs.shape[:-1] != tokens.shape:
        raise CodecError(f"proposal probs must be tokens' shape {list(tokens.shape)} + [V], got {list(probs.shape)}")
    dtype = WIRE_DTYPES.get(p.probs.dtype)
    if dtype is None:
        raise CodecError(f"proposal probs dtype {p.probs.dtype} has no wire form")
    # A bool mask first: numpy scans bools ~10x faster than floats. (bfloat16 bits: nonzero iff the
    # value is, for p >= 0.)
    support = probs != 0
    if _sparse_bytes(probs, int(np.count_nonzero(support))) < probs.nbytes:
        msg.sparse.CopyFrom(_sparse_to_proto(probs.reshape(-1, probs.shape[-1]), support, dtype))
    else:
        msg.dense.CopyFrom(array_to_proto(probs, dtype))
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
        row_offsets=array_to_proto(offsets, INT32),
        token_ids=array_to_proto((flat % vocab).astype(np.int32), INT32),
        probs=array_to_proto(probs.reshape(-1)[flat], dtype),
    )


def proposal_from_proto(msg: pb.Proposal, ndim: int = 1) -> Proposal:
    """A Proposal of tokens [K] (ndim 1), or a tree's columns: tokens [N, K], q [N, K, V] (ndim 2)."""
    tokens = integer_array(required(msg, "tokens", "Proposal"), "Proposal.tokens")
    if tokens.ndim != ndim:
        raise CodecError(f"Proposal.tokens must be {ndim}-D, got shape {list(tokens.shape)}")
    if (tokens < 0).any():
        raise CodecError("Proposal.tokens has a negative token id")
    kind = msg.WhichOneof("probs")
    if kind is None:
        return Proposal(tokens=torch.from_numpy(tokens.astype(np.int64)), probs=None)
    if kind == "dense":
        probs = _dense_from_proto(msg.dense, tokens.shape)
        low, mass = _row_stats(probs)
    else:
        # vocab_size, not -1: a proposal with no tokens has no rows to infer it from
        probs, low, mass = _sparse_from_proto(msg.sparse, tokens.size)
        probs = probs.reshape(*tokens.shape, msg.sparse.vocab_size)
    _check_distribution(tokens, probs, low, mass)
    return Proposal(tokens=torch.from_numpy(tokens.astype(np.int64)), probs=probs)


def mass_tolerance(dtype: torch.dtype, vocab: int = 0) -> float:
    """How far a row of q may sum from 1: the rounding of a float32 softmax sent in dtype (bfloat16 moves
    each entry by up to 2**-9 of itself, so a row by up to 2**-9), far below any bias worth leaning on; plus,
    for entries below the least normal (float16's under 6e-5: a near-uniform row over 150k tokens), up to one
    subnormal step each (tiny * eps: 6e-8 in float16, nothing in float32 / bfloat16)."""
    finfo = torch.finfo(dtype)
    return max(1e-3, finfo.eps) + vocab * finfo.tiny * finfo.eps


def _check_distribution(tokens: np.ndarray, probs: torch.Tensor, low: float, mass: np.ndarray) -> None:
    """q must be a distribution each drafted token could be drawn from. Verification accepts x with
    min(1, p(x) / q(x)), which is 1 whenever p(x) >= q(x), and draws the rest from norm(max(0, p - q)): a
    negative or non-finite q, q(x) = 0, or a row of mass far from 1 would emit x (or others) more often than p
    says. low: q's least entry (NaN if any is), mass [rows]: each row's sum."""
    vocab = probs.shape[-1]
    if tokens.size and int(tokens.max()) >= vocab:
        raise CodecError(f"Proposal.tokens must lie in q's vocabulary [0, {vocab})")
    if not tokens.size:
        return
    drawn = probs.reshape(-1, vocab).gather(1, torch.from_numpy(tokens.reshape(-1, 1).astype(np.int64)))
    tolerance = mass_tolerance(probs.dtype, vocab)
    if not (low >= 0 and (np.abs(mass - 1) <= tolerance).all() and bool((drawn > 0).all())):
        raise CodecError(f"proposal q must be a distribution: entries finite and >= 0, each row summing to 1 (within "
                         f"{tolerance:g}), and > 0 at the token drafted from it")


def _float_array(values: np.ndarray | torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """numpy floats to reduce over: float32 / float64 as they are, bfloat16 (its int16 bits: numpy has no
    bfloat16) and float16 (numpy would accumulate in float16) widened to float32."""
    if dtype is torch.bfloat16:
        values = torch.as_tensor(values).view(torch.bfloat16).float()
    values = values.numpy() if isinstance(values, torch.Tensor) else values
    return values if values.dtype in (np.float32, np.float64) else values.astype(np.float32)


def _row_stats(probs: torch.Tensor) -> tuple[float, np.ndarray]:
    """(least entry, each row's sum) of a dense q: two numpy passes (torch's reductions cost ~5x the CPU at
    [4, 128k], its threads spinning; einsum ~3x less than ndarray.sum's pairwise sum)."""
    if probs.numel() == 0:  # no rows (no tokens), or V = 0 (every token refused as outside it)
        return 0.0, np.empty(0)
    rows = _float_array(probs, probs.dtype).reshape(-1, probs.shape[-1])
    return rows.min(), np.einsum("ij->i", rows)


def _dense_from_proto(msg: pb.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    probs = tensor_from_proto(msg)
    if probs.shape[:-1] != shape or probs.dim() != len(shape) + 1 or not probs.is_floating_point():
        raise CodecError(f"dense probs must be a float {list(shape)} + [V] tensor, got {probs.dtype} {list(probs.shape)}")
    return probs


def _sparse_from_proto(msg: pb.SparseProbs, k: int) -> tuple[torch.Tensor, float, np.ndarray]:
    """(q [k, vocab_size] laid out dense, its least entry, each row's sum), the last two from the nnz entries."""
    offsets = integer_array(required(msg, "row_offsets", "SparseProbs"), "sparse probs: row_offsets").astype(np.int64)
    ids = integer_array(required(msg, "token_ids", "SparseProbs"), "sparse probs: token_ids").astype(np.int64)
    values_msg = required(msg, "probs", "SparseProbs")
    dtype = TORCH_DTYPES.get(values_msg.dtype)
    if dtype is None or not dtype.is_floating_point:
        raise CodecError("sparse probs: probs must be float")
    values = array_from_proto(values_msg, dtype)
    _check_sparse(offsets, ids, values, k, msg.vocab_size)
    row_of = np.repeat(np.arange(k), np.diff(offsets))
    probs = np.zeros((k, msg.vocab_size), dtype=values.dtype)
    probs[row_of, ids] = values
    probs = torch.from_numpy(probs)
    floats = _float_array(values, dtype)
    low, mass = (floats.min() if len(floats) else 0.0), np.bincount(row_of, weights=floats, minlength=k)
    return (probs.view(torch.bfloat16) if dtype is torch.bfloat16 else probs), low, mass


def _check_sparse(offsets: np.ndarray, ids: np.ndarray, values: np.ndarray, k: int, vocab_size: int) -> None:
    nnz = len(ids)
    if offsets.ndim != 1 or len(offsets) != k + 1 or offsets[0] != 0 or offsets[-1] != nnz:
        raise CodecError(f"sparse probs: row_offsets must be [K+1={k + 1}] from 0 to nnz={nnz}")
    if (offsets[1:] < offsets[:-1]).any():
        raise CodecError("sparse probs: row_offsets must be non-decreasing")
    if ids.ndim != 1 or values.ndim != 1 or len(values) != nnz:
        raise CodecError("sparse probs: token_ids and probs must be 1-D of the same length, probs float")
    if not 0 < vocab_size <= MAX_EXTENT:  # only claimed: with k = 0 no byte count below would catch it
        raise CodecError(f"sparse probs: vocab_size {vocab_size} must be in 1..{MAX_EXTENT}")
    if nnz and (ids.min() < 0 or ids.max() >= vocab_size):
        raise CodecError(f"sparse probs: token ids must lie in [0, vocab_size={vocab_size})")
    ascending = np.diff(ids) > 0  # within a row, as the encoder writes them: a repeated id would overwrite
    ascending[offsets[1:-1][(0 < offsets[1:-1]) & (offsets[1:-1] < nnz)] - 1] = True  # a new row may start lower
    if not ascending.all():
        raise CodecError("sparse probs: a row's token ids must ascend (each id once)")
    laid_out = k * vocab_size * values.itemsize
    if laid_out > MAX_LAID_OUT_BYTES:  # vocab_size is only claimed: it must not size an allocation unchecked
        raise CodecError(f"sparse probs: {k} rows of vocab_size {vocab_size} would lay out {laid_out} bytes, over "
                         f"the {MAX_LAID_OUT_BYTES} byte limit")
