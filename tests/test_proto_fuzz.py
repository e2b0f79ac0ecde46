"""Property tests of the protocol's edge: any protobuf message a peer could send, decoded, either gives a
valid protocol message or raises CodecError (which the DraftService answers with INVALID_ARGUMENT), never
another exception, and never allocates by what the message claims rather than what it carries; and a
real DraftService answers any of them with a status a peer can act on, and serves on.

Messages are drawn from the .proto's own descriptors, every field (nested messages, repeated and map
fields, open enums, NaN and infinite doubles, int64 extremes) set or left out at random, so a field
added to the .proto is fuzzed without this file changing."""
from __future__ import annotations

import functools
import itertools

import grpc
import numpy as np
import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saguaro_dist.config import Config
from saguaro_dist.distributed import codec
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.proto import saguaro_pb2 as pb, saguaro_pb2_grpc
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.distributed.grpc_link import STATUS_BY_NUMBER
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
from test_grpc_toy_worker import ToyWorker

INT64 = st.one_of(st.integers(-2, 64), st.sampled_from([-(2 ** 63), 2 ** 63 - 1, 2 ** 31, -(2 ** 31)]))
SCALARS = {
    FD.TYPE_INT64: INT64, FD.TYPE_SINT64: INT64, FD.TYPE_SFIXED64: INT64,
    FD.TYPE_INT32: st.integers(-2, 64) | st.sampled_from([-(2 ** 31), 2 ** 31 - 1]),
    FD.TYPE_UINT64: st.integers(0, 64) | st.just(2 ** 64 - 1), FD.TYPE_UINT32: st.integers(0, 2 ** 32 - 1),
    FD.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    FD.TYPE_FLOAT: st.floats(width=32, allow_nan=True, allow_infinity=True),
    FD.TYPE_BOOL: st.booleans(), FD.TYPE_STRING: st.text(max_size=8), FD.TYPE_BYTES: st.binary(max_size=64),
}
MAX_DEPTH = 4


# The strategies are built once per field (and message type and depth), not on every draw: hypothesis validates a
# strategy object on its first draw, and fresh ones each draw spent most of the fuzzing's time validating.
@functools.lru_cache(maxsize=None)
def field_values(field, depth: int):
    if field.type == FD.TYPE_MESSAGE:
        return messages(field.message_type._concrete_class, depth + 1)
    if field.type == FD.TYPE_ENUM:  # proto3 enums are open: unknown numbers arrive too
        return st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(-1, 40)
    return SCALARS[field.type]


@functools.lru_cache(maxsize=None)
def map_values(field, depth: int):
    key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
    return st.dictionaries(field_values(key, depth), field_values(value, depth), max_size=3)


@functools.lru_cache(maxsize=None)
def repeated_values(field, depth: int):
    return st.lists(field_values(field, depth), max_size=4)


@functools.lru_cache(maxsize=None)
@st.composite
def messages(draw, cls, depth: int = 0):
    """A message of type cls with a random subset of its fields set (nested messages depth-limited)."""
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if depth >= MAX_DEPTH and field.type == FD.TYPE_MESSAGE or not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            getattr(msg, field.name).update(draw(map_values(field, depth)))
        elif field.is_repeated:
            values = draw(repeated_values(field, depth))
            target = getattr(msg, field.name)
            if field.type == FD.TYPE_MESSAGE:
                for v in values:
                    target.add().CopyFrom(v)
            else:
                target.extend(values)
        elif field.type == FD.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(draw(field_values(field, depth)))
        else:
            setattr(msg, field.name, draw(field_values(field, depth)))
    return msg


@st.composite
def tensors(draw):
    """Tensors shaped to almost fit their bytes: the decoder's size checks, not just its dtype checks."""
    dtype = draw(st.sampled_from(list(pb.Tensor.DType.values())))
    shape = draw(st.lists(st.integers(-1, 6), max_size=3))
    size = int(np.prod([max(d, 0) for d in shape])) * 4 + draw(st.integers(-4, 4))
    return pb.Tensor(dtype=dtype, shape=shape, data=draw(st.binary(min_size=max(size, 0), max_size=max(size, 0))))


DECODERS = [
    (codec.tensor_from_proto, pb.Tensor), (codec.sampling_from_proto, pb.DraftSampling),
    (codec.proposal_from_proto, pb.Proposal), (codec.prefill_from_proto, pb.PrefillRequest),
    (codec.jit_request_from_proto, pb.JitDraftRequest), (codec.outcome_from_proto, pb.Outcome),
    (codec.tree_from_proto, pb.SpeculationTree), (codec.plan_from_proto, pb.TreePlan),
    (codec.release_from_proto, pb.Release), (codec.prefill_batch_from_proto, pb.PrefillBatch),
    (codec.jit_batch_from_proto, pb.JitDraftBatch), (codec.proposal_batch_from_proto, pb.ProposalBatch),
    (codec.outcome_batch_from_proto, pb.OutcomeBatch), (codec.outcome_rounds_from_proto, pb.OutcomeRounds),
    (codec.tree_batch_from_proto, pb.SpeculationTreeBatch), (codec.plan_batch_from_proto, pb.TreePlanBatch),
    (codec.release_batch_from_proto, pb.ReleaseBatch), (codec.jit_call_from_proto, pb.JitDraftCall),
]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decodes_or_refuses(decode, msg) -> None:
    try:
        decode(msg)
    except codec.CodecError:
        pass


@pytest.mark.parametrize("decode, cls", DECODERS, ids=[d.__name__ for d, _ in DECODERS])
@FUZZ
@given(data=st.data())
def test_any_message_decodes_or_is_refused_with_a_codec_error(decode, cls, data):
    decodes_or_refuses(decode, data.draw(messages(cls)))


@FUZZ
@given(tensor=tensors())
def test_any_tensor_decodes_to_its_shape_or_is_refused(tensor):
    try:
        t = codec.tensor_from_proto(tensor)
    except codec.CodecError:
        return
    assert list(t.shape) == list(tensor.shape)


@st.composite
def sparse_proposals(draw):
    """A tree's columns with a sparse q, near valid: row offsets, ids and values each a little off at times,
    and a vocab_size from tiny to absurd (only claimed: the message carries nnz entries, not V). Most of them
    are distributions drafted from (each row non-empty, summing to 1, its token its first id), so the layout
    is checked past the distribution check too."""
    n, k = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    vocab = draw(st.integers(-1, 8) | st.sampled_from([2 ** 20, 2 ** 40, 2 ** 62]))
    distribution = draw(st.sampled_from([True, True, True, False]))
    counts = draw(st.lists(st.integers(int(distribution), 3), min_size=n * k, max_size=n * k))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    if draw(st.booleans()):
        offsets[draw(st.integers(0, len(offsets) - 1))] += draw(st.sampled_from([-1, 1]))
    nnz = int(sum(counts)) + draw(st.sampled_from([0, 0, 0, -1, 1]))
    ids = draw(st.lists(st.integers(-1, min(max(vocab, 1), 2 ** 31 - 1)), min_size=max(nnz, 0), max_size=max(nnz, 0)))
    if draw(st.booleans()):  # mostly each row's ids ascending, as the encoder writes them
        ids = [i for lo, hi in zip(offsets[:-1], offsets[1:]) for i in sorted(ids[max(lo, 0):max(hi, 0)])]
    values = draw(st.lists(st.floats(0, 1, width=32), min_size=max(nnz, 0), max_size=max(nnz, 0)))
    tokens = torch.ones(n * k, dtype=torch.int32)
    if distribution and nnz == sum(counts) and offsets[-1] == nnz:
        values, tokens = _as_drafted(offsets, ids, draw(st.lists(st.floats(0.01, 1), min_size=nnz, max_size=nnz)))
    tokens = codec.tensor_to_proto(tokens.reshape(n, k))
    return pb.Proposal(tokens=tokens, sparse=pb.SparseProbs(
        vocab_size=vocab, row_offsets=codec.tensor_to_proto(torch.from_numpy(offsets)),
        token_ids=codec.tensor_to_proto(torch.tensor(ids, dtype=torch.int32)),
        probs=codec.tensor_to_proto(torch.tensor(values, dtype=torch.float32))))


def _as_drafted(offsets: np.ndarray, ids: list[int], weights: list[float]) -> tuple[list[float], torch.Tensor]:
    """Each row's weights normalised to a distribution, and each row's token its first id (q > 0 there)."""
    values = np.asarray(weights, dtype=np.float64)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        values[max(lo, 0):max(hi, 0)] /= values[max(lo, 0):max(hi, 0)].sum() or 1.0
    first = [ids[lo] if 0 <= lo < len(ids) else 1 for lo in offsets[:-1]]
    return values.astype(np.float32).tolist(), torch.tensor(first, dtype=torch.int32)


@FUZZ
@given(msg=sparse_proposals())
def test_sparse_probs_are_checked_before_they_are_laid_out(msg):
    """A sparse q is laid out dense ([rows, vocab_size]) on arrival: it decodes to exactly its entries or is
    refused, and a vocab_size the message merely claims never sizes that allocation (2**40: terabytes)."""
    try:
        proposal = codec.proposal_from_proto(msg, ndim=2)
    except codec.CodecError:
        return
    sparse = msg.sparse
    rows = proposal.probs.reshape(-1, sparse.vocab_size)
    offsets = codec.tensor_from_proto(sparse.row_offsets).tolist()
    ids, values = codec.tensor_from_proto(sparse.token_ids), codec.tensor_from_proto(sparse.probs)
    for r in range(len(offsets) - 1):
        lo, hi = offsets[r], offsets[r + 1]
        assert rows[r, ids[lo:hi]].tolist() == values[lo:hi].tolist()
    assert rows.count_nonzero() <= len(ids)


@pytest.mark.parametrize("vocab", [2 ** 40, 2 ** 62])
def test_a_huge_claimed_vocabulary_is_refused_not_allocated(vocab):
    """One row, no entries (nnz 0): every other check passes, only vocab_size is absurd."""
    tokens = codec.tensor_to_proto(torch.tensor([[1]], dtype=torch.int32))
    empty = codec.tensor_to_proto(torch.zeros(0, dtype=torch.int32))
    msg = pb.Proposal(tokens=tokens, sparse=pb.SparseProbs(
        vocab_size=vocab, row_offsets=codec.tensor_to_proto(torch.zeros(2, dtype=torch.int32)), token_ids=empty,
        probs=codec.tensor_to_proto(torch.zeros(0))))
    with pytest.raises(codec.CodecError, match="vocab_size"):
        codec.proposal_from_proto(msg, ndim=2)


# ---- the DraftService, over real gRPC, hosting a real DraftWorker --------------------------------
ANSWERABLE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
              grpc.StatusCode.RESOURCE_EXHAUSTED}
GREEDY = DraftSampling(0.0, 0, 1.0, None)


@pytest.fixture(scope="module")
def service(tiny_checkpoint):
    """A DraftService on loopback over the tiny draft, with sequences 0..3 prefilled and drafted once (the
    random messages draw small ids, so some land on live sequences), and the stub's own ids from 1000 on."""
    path = tiny_checkpoint("draft")
    worker = build_draft_worker(Config(model=path, draft=path, mode="ssd", k=3, fan_out=6, enable_prefix_caching=False))
    server, port = serve_draft(worker, "127.0.0.1", 0)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = saguaro_pb2_grpc.DraftServiceStub(channel)
        for seq_id in range(4):
            stub.Prefill(codec.prefill_batch_to_proto([PrefillRequest(seq_id, [5, 6, 7], GREEDY)]), timeout=10)
            stub.JitDraft(codec.jit_batch_to_proto([JitDraftRequest(seq_id, 0, 0, 7)]), timeout=10)
        yield stub, itertools.count(1000)
    server.stop(None)


def answered_or_refused(call) -> None:
    """call() returns, or fails with a status a peer can act on: never INTERNAL or UNKNOWN (a crash)."""
    try:
        call()
    except grpc.RpcError as err:
        assert err.code() in ANSWERABLE, (err.code(), err.details())


def drain(stub, requests: list) -> None:
    """Read the stream to its end; a draft answered in band with an error must carry a status a peer can act on."""
    for reply in stub.Speculate(iter(requests), timeout=30):
        if reply.WhichOneof("kind") == "jit_draft" and reply.jit_draft.HasField("error"):
            code = STATUS_BY_NUMBER.get(reply.jit_draft.error.code, grpc.StatusCode.UNKNOWN)
            assert code in ANSWERABLE, (code, reply.jit_draft.error.message)


def test_drain_fails_on_a_draft_answered_in_band_with_internal():
    """A worker that crashes in a draft: the stream answers INTERNAL in band (not as the stream's status),
    which the service fuzz test above must see as a failure."""
    class Crashing(ToyWorker):
        def jit_draft(self, reqs):
            raise RuntimeError("a bug")
    server, port = serve_draft(Crashing(), "127.0.0.1", 0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb.JitDraftCall(call_id=1, batch=codec.jit_batch_to_proto([JitDraftRequest(1, 0, 0, 7)]))
            with pytest.raises(AssertionError, match="INTERNAL"):
                answered_or_refused(lambda: drain(saguaro_pb2_grpc.DraftServiceStub(channel),
                                                  [pb.SpeculateRequest(jit_draft=call)]))
    finally:
        server.stop(None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prefills=messages(pb.PrefillBatch), jits=messages(pb.JitDraftBatch), releases=messages(pb.ReleaseBatch),
       stream=st.lists(messages(pb.SpeculateRequest), max_size=3))
def test_the_service_answers_any_message_with_a_status_and_serves_on(service, prefills, jits, releases, stream):
    stub, ids = service
    answered_or_refused(lambda: stub.Prefill(prefills, timeout=30))
    answered_or_refused(lambda: stub.JitDraft(jits, timeout=30))
    answered_or_refused(lambda: drain(stub, stream))
    answered_or_refused(lambda: stub.Release(releases, timeout=30))
    seq_id = next(ids)  # and a well-formed sequence still drafts
    stub.Prefill(codec.prefill_batch_to_proto([PrefillRequest(seq_id, [5, 6, 7], GREEDY)]), timeout=30)
    reply = stub.JitDraft(codec.jit_batch_to_proto([JitDraftRequest(seq_id, 0, 0, 7)]), timeout=30)
    assert codec.proposal_batch_from_proto(reply)[0].tokens.shape == (3,)
