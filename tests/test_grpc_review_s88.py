"""Review s88 of the draft protocol's edges. A Prefill whose sampling leaves no token to generate is refused
at Prefill (INVALID_ARGUMENT), as the target refuses the request (was: accepted, then NaN q or a barred token
drafted). A tensor of zero elements but huge or too many dimensions is a CodecError (was numpy's ValueError,
which made the whole stream UNREADABLE instead of costing one tree batch). Real gRPC on loopback, ToyWorker
inside (tests/test_grpc_toy_worker.py)."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from saguaro_dist.distributed import codec
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.distributed.proto import saguaro_pb2 as pb, saguaro_pb2_grpc
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest
from saguaro_dist.sampling_params import SamplingParams, check_against_model
from test_grpc_toy_worker import K, ToyWorker, expected_branch

pytestmark = pytest.mark.timeout(60)
T = pb.Tensor
NOTHING_LEFT = [  # (allowed_token_ids, bad_words, min_tokens, end_token_ids)
    ((7,), (), 5, (7,)),           # the only allowed token is an end min_tokens holds back
    ((7, 9), (), 1, (7, 9, 11)),
    ((7,), ((7,),), 0, ()),        # the only allowed token is a one-token bad word
]
SOMETHING_LEFT = [
    ((7, 8), (), 5, (7,)),         # 8 is left
    ((7,), (), 0, (7,)),           # min_tokens 0 holds nothing back
    ((7,), ((7, 8),), 0, ()),      # a two-token bad word bars 8 after 7 only
    (None, ((7,),), 5, (1, 2, 3)),
]


def _sampling(allowed, bad_words, min_tokens, ends, temperature=1.0):
    return DraftSampling(temperature, 0, 1.0, None, allowed_token_ids=allowed, bad_words=bad_words,
                         min_tokens=min_tokens, end_token_ids=ends)


@pytest.mark.parametrize("case", NOTHING_LEFT)
def test_draft_sampling_with_nothing_left_to_generate_is_refused_as_the_target_refuses_it(case):
    allowed, bad_words, min_tokens, ends = case
    with pytest.raises(ValueError, match="nothing could be generated") as draft_side:
        _sampling(*case)
    params = SamplingParams(allowed_token_ids=allowed, min_tokens=min_tokens, stop_token_ids=ends,
                            _bad_words_token_ids=bad_words or None)
    with pytest.raises(ValueError) as target_side:
        check_against_model(params, 64, frozenset())
    assert str(draft_side.value) == str(target_side.value)


@pytest.mark.parametrize("case", SOMETHING_LEFT)
def test_draft_sampling_with_a_token_left_is_kept(case):
    assert _sampling(*case, temperature=0.0).min_tokens == case[2]


@pytest.fixture(scope="module")
def server():
    worker = ToyWorker()
    srv, port = serve_draft(worker, "127.0.0.1", 0)
    yield worker, port
    srv.stop(None)


def test_the_draft_server_answers_invalid_argument_at_prefill(server):
    worker, port = server
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = saguaro_pb2_grpc.DraftServiceStub(channel)
        sampling = pb.DraftSampling(temperature=1.0, top_p=1.0, allowed_token_ids=[7], min_tokens=5, end_token_ids=[7])
        batch = pb.PrefillBatch(requests=[pb.PrefillRequest(seq_id=880, prompt_token_ids=[1, 2, 3], sampling=sampling)])
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(batch, timeout=10)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "nothing could be generated" in err.value.details()
        assert 880 not in worker.seqs
        sampling.allowed_token_ids.append(8)  # a token left: accepted
        stub.Prefill(pb.PrefillBatch(requests=[pb.PrefillRequest(seq_id=881, prompt_token_ids=[1, 2, 3],
                                                                 sampling=sampling)]), timeout=10)
        assert 881 in worker.seqs


@pytest.mark.parametrize("shape", [[0, 2 ** 62], [2 ** 62, 0], [0, 2 ** 31 - 1, 2 ** 31 - 1], [0] * 70, [1, 0, 2 ** 40]])
def test_a_zero_size_tensor_of_huge_or_too_many_dimensions_is_a_codec_error(shape):
    with pytest.raises(codec.CodecError):
        codec.tensor_from_proto(T(dtype=T.FLOAT32, shape=shape, data=b""))


@pytest.mark.parametrize("shape", [[0], [0, 64], [3, 0, 262144], [2, 3]])
def test_tensors_of_real_shapes_still_decode(shape):
    t = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    assert torch.equal(codec.tensor_from_proto(codec.tensor_to_proto(t)), t)


def _huge_empty_tree_batch() -> pb.SpeculateReply:
    q = T(dtype=T.FLOAT32, shape=[0, 2 ** 62], data=b"")
    tree = pb.SpeculationTree(seq_id=1, round=0, accepted=[0], bonus_tokens=[5],
                              proposals=pb.Proposal(tokens=T(dtype=T.INT32, shape=[1, K], data=bytes(4 * K)), dense=q))
    return pb.SpeculateReply(trees=pb.SpeculationTreeBatch(trees=[tree]))


def test_a_tree_batch_with_a_huge_empty_tensor_costs_that_batch_not_the_stream(server):
    _, port = server
    backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)
    store = backend._store

    def store_a_bad_batch_first(link, msg):  # as if the server had pushed it right before its real trees
        if msg.WhichOneof("kind") == "trees":
            store(link, _huge_empty_tree_batch())
        store(link, msg)
    backend._store = store_a_bad_batch_first  # the reader looks it up for every message
    try:
        backend.prefill([PrefillRequest(1, [5, 6], DraftSampling(0.0, 0, 1.0, None))])
        spec = backend.jit_draft([JitDraftRequest(1, 0, 0, 9)])[0].tokens.tolist()
        assert sorted(backend.wait_trees([(1, 0)], 10.0)) == [1]
        bonus, _ = expected_branch([5, 6, 9], spec, 2)
        backend.send_outcomes([Outcome(1, 0, 2, bonus, None)])
        assert sorted(backend.wait_trees([(1, 1)], 10.0)) == [1], "the stream died with the bad batch"
    finally:
        backend.close()


def test_a_sparse_proposal_claiming_a_huge_vocabulary_with_no_rows_is_a_codec_error():
    """k = 0 rows lay out 0 bytes whatever vocab_size claims, so the byte check passed and np.zeros((0, 2**62))
    raised a plain ValueError, which marks the whole stream unreadable (a reviewer's tensor_edges.py)."""
    import numpy as np
    from saguaro_dist.distributed.proposal_codec import _check_sparse
    from saguaro_dist.distributed.wire_checks import CodecError
    empty = np.zeros(0, dtype=np.int64)
    with pytest.raises(CodecError, match="vocab_size"):
        _check_sparse(np.zeros(1, dtype=np.int64), empty, empty.astype(np.float32), 0, 2 ** 62)
