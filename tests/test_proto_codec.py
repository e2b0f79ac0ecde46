"""codec: every message dataclass survives dataclass -> proto -> bytes -> proto -> dataclass exactly."""
from __future__ import annotations

import math

import pytest
import numpy as np
import torch

from saguaro_dist.distributed import codec
from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.engine.messages import (
    DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Proposal, Release, ResetPrefixCache, SpeculationTree, TreePlan,
)


def _wire(msg):
    """Through real bytes, as on the network."""
    return type(msg).FromString(msg.SerializeToString())


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare floats bit for bit (torch.equal would call -0.0 == 0.0 and NaN != NaN)."""
    return t.view(_SAME_WIDTH_INT[t.element_size()])


def _assert_proposal_equal(a: Proposal, b: Proposal) -> None:
    assert b.tokens.dtype == torch.int64 and torch.equal(a.tokens, b.tokens)
    if a.probs is None:
        assert b.probs is None
    else:
        assert b.probs.dtype == a.probs.dtype and torch.equal(_bits(a.probs), _bits(b.probs))


def _roundtrip_proposal(p: Proposal) -> tuple[Proposal, str | None]:
    msg = _wire(codec.proposal_to_proto(p))
    return codec.proposal_from_proto(msg), msg.WhichOneof("probs")


def _top_k_probs(k: int, vocab: int, support: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k, vocab, generator=g)
    keep = logits.topk(support, dim=-1).indices
    probs = torch.zeros(k, vocab)
    probs.scatter_(1, keep, torch.softmax(logits.gather(1, keep), -1))
    return probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                   torch.int32, torch.int8, torch.uint8, torch.bool])
def test_tensor_round_trip_bit_exact(dtype):
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(3, 5, generator=g) * 100).to(dtype)
    back = codec.tensor_from_proto(_wire(codec.tensor_to_proto(t)))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_tensor_special_floats_and_shapes():
    t = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-45, 3.4028234663852886e38])
    back = codec.tensor_from_proto(codec.tensor_to_proto(t))
    assert torch.equal(back.view(torch.int32), t.view(torch.int32))  # -0.0 and denormals bit for bit
    assert torch.isnan(codec.tensor_from_proto(codec.tensor_to_proto(torch.tensor([math.nan])))).all()
    assert codec.tensor_from_proto(codec.tensor_to_proto(torch.tensor(7))).shape == ()
    assert codec.tensor_from_proto(codec.tensor_to_proto(torch.zeros(0, 4))).shape == (0, 4)
    assert torch.equal(codec.tensor_from_proto(codec.tensor_to_proto(torch.arange(12).reshape(3, 4).t())),
                       torch.arange(12).reshape(3, 4).t())  # non-contiguous input


def test_tensor_bytes_are_little_endian():
    msg = codec.tensor_to_proto(torch.tensor([1], dtype=torch.int32))
    assert msg.data == b"\x01\x00\x00\x00" and msg.dtype == pb.Tensor.INT32 and list(msg.shape) == [1]


def test_big_endian_elements_go_out_little_endian():
    native_be = np.array([1, 256], dtype=">i4")  # what a big-endian host holds
    assert native_be.tobytes() == b"\0\0\0\x01\0\0\x01\0"
    assert codec.little_endian(native_be).tobytes() == b"\x01\0\0\0\0\x01\0\0"


def test_greedy_proposal_sends_no_probs():
    p = Proposal(torch.tensor([5, 9, 2]), None)
    back, kind = _roundtrip_proposal(p)
    assert kind is None
    _assert_proposal_equal(p, back)


def test_truncated_proposal_travels_sparse_and_exact():
    probs = _top_k_probs(4, 32000, support=20)
    p = Proposal(probs.argmax(-1), probs)  # tokens drawn from q: q > 0 there (decoding refuses q(x) = 0)
    msg = codec.proposal_to_proto(p)
    back, kind = _roundtrip_proposal(p)
    assert kind == "sparse"
    _assert_proposal_equal(p, back)
    assert msg.ByteSize() < 4 * 20 * 8 + 200  # ids + probs of the support, not K x V


def test_full_support_proposal_travels_dense_and_exact():
    p = Proposal(torch.tensor([1, 2]), torch.softmax(torch.randn(2, 100), -1))
    back, kind = _roundtrip_proposal(p)
    assert kind == "dense"
    _assert_proposal_equal(p, back)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sparse_keeps_other_dtypes_and_refuses_an_empty_row(dtype):
    probs = torch.zeros(3, 50, dtype=dtype)
    probs[0, 3], probs[0, 8], probs[1, 0], probs[2, 49] = 0.25, 0.75, 1.0, 1.0
    p = Proposal(torch.tensor([3, 0, 49]), probs)
    back, kind = _roundtrip_proposal(p)
    assert kind == "sparse" and back.probs.dtype == dtype
    _assert_proposal_equal(p, back)
    probs[1, 0] = 0  # a row of no mass: no token was drawn from it
    with pytest.raises(codec.CodecError, match="distribution"):
        _roundtrip_proposal(p)


def test_bfloat16_dense_probs_cross_bit_for_bit():
    p = Proposal(torch.tensor([1, 2]), torch.softmax(torch.randn(2, 40), -1).to(torch.bfloat16))
    back, kind = _roundtrip_proposal(p)
    assert kind == "dense" and torch.equal(back.probs.view(torch.int16), p.probs.view(torch.int16))


def test_sampling_and_messages_round_trip():
    s = DraftSampling(temperature=0.7000000000000001, top_k=0, top_p=0.95, seed=2 ** 62)
    assert codec.sampling_from_proto(_wire(codec.sampling_to_proto(s))) == s
    assert codec.reset_prefix_cache_from_proto(_wire(codec.reset_prefix_cache_to_proto(ResetPrefixCache()))) == ResetPrefixCache()
    truncated = DraftSampling(0.8, 0, 1.0, None, min_p=0.05)
    assert codec.sampling_from_proto(_wire(codec.sampling_to_proto(truncated))) == truncated
    s0 = DraftSampling(0.0, 5, 1.0, None)
    assert codec.sampling_from_proto(_wire(codec.sampling_to_proto(s0))) == s0
    for seed in (0, -3):
        s1 = DraftSampling(1.0, 0, 1.0, seed)
        assert codec.sampling_from_proto(_wire(codec.sampling_to_proto(s1))).seed == seed  # 0 is not None
    penalized = DraftSampling(0.0, 0, 1.0, None, presence_penalty=-0.5, frequency_penalty=1.25, repetition_penalty=1.1)
    assert codec.sampling_from_proto(_wire(codec.sampling_to_proto(penalized))) == penalized
    biased = DraftSampling(0.5, 0, 1.0, 3, logit_bias={5: 2.5, 1: -100}, allowed_token_ids=[9, 1, 5],
                           grammar='start: "yes" | "no"')
    assert codec.sampling_from_proto(_wire(codec.sampling_to_proto(biased))) == biased
    cases = [
        (PrefillRequest(7, [1, 2, 3], s), codec.prefill_to_proto, codec.prefill_from_proto),
        (PrefillRequest(7, [1, 2, 3], s, 1, 2, prompt_len=2), codec.prefill_to_proto, codec.prefill_from_proto),
        (JitDraftRequest(7, 3, 2, 99), codec.jit_request_to_proto, codec.jit_request_from_proto),
        (JitDraftRequest(7, 3, 2, 99, skip_tree=True), codec.jit_request_to_proto, codec.jit_request_from_proto),
        (Outcome(7, 3, 2, 99, [1], cache_hit=True, skip_tree=True, tree_wait_s=0.00125, target_proposed=True), codec.outcome_to_proto,
         codec.outcome_from_proto),
        (Outcome(7, 3, 2, 99, None), codec.outcome_to_proto, codec.outcome_from_proto),
        (Outcome(7, 3, 0, 99, []), codec.outcome_to_proto, codec.outcome_from_proto),
        (Outcome(-7, 0, 4, 0, [4, 5, 6]), codec.outcome_to_proto, codec.outcome_from_proto),
        (Release(2 ** 40), codec.release_to_proto, codec.release_from_proto),
        # the life each target -> draft message is of (PrefillRequest.generation; uint64 on the wire)
        (JitDraftRequest(7, 3, 2, 99, generation=2 ** 64 - 1), codec.jit_request_to_proto, codec.jit_request_from_proto),
        (Outcome(7, 3, 2, 99, None, generation=12), codec.outcome_to_proto, codec.outcome_from_proto),
        (Release(7, generation=5), codec.release_to_proto, codec.release_from_proto),
    ]
    for obj, to_proto, from_proto in cases:
        assert from_proto(_wire(to_proto(obj))) == obj


def _tree(q: str, n: int = 3, k: int = 2, vocab: int = 1000) -> SpeculationTree:
    g = torch.Generator().manual_seed(n)
    probs = {"greedy": lambda i: None, "top-k": lambda i: _top_k_probs(k, vocab, 3, seed=i),
             "dense": lambda i: torch.softmax(torch.randn(k, vocab, generator=g), -1)}[q]
    rows = [(i, probs(i)) for i in range(n)]  # a sampled row's tokens drawn from its q: q > 0 there
    return SpeculationTree.from_rows(5, 9, [(i, 11 + i, Proposal(torch.randint(0, vocab, (k,), generator=g) if q is None
                                                                 else torch.multinomial(q.float(), 1, generator=g)[:, 0], q))
                                            for i, q in rows], build_s=0.0123)


@pytest.mark.parametrize("q,form", [("greedy", None), ("top-k", "sparse"), ("dense", "dense")])
def test_a_tree_round_trips_bit_exact_as_columns(q, form):
    tree = _tree(q)
    msg = _wire(codec.tree_to_proto(tree))
    assert msg.proposals.tokens.shape == [3, 2] and msg.proposals.WhichOneof("probs") == form  # one tensor each
    back = codec.tree_from_proto(msg)
    assert (back.seq_id, back.round, back.keys(), back.build_s) == (5, 9, [(0, 11), (1, 12), (2, 13)], 0.0123)
    _assert_proposal_equal(tree.proposals, back.proposals)
    empty = codec.tree_from_proto(_wire(codec.tree_to_proto(SpeculationTree(5, 9))))
    assert empty == SpeculationTree(5, 9)


def test_a_tree_made_from_one_hot_and_explicit_q_rows_holds_the_one_hot_q():
    """The one-hot q is what None means: the verifier sees the same distribution."""
    rows = _tree("dense").rows()
    one_hot = Proposal(rows[1][2].tokens, None)
    tree = SpeculationTree.from_rows(5, 9, [rows[0], (1, 12, one_hot), rows[2]])
    back = codec.tree_from_proto(_wire(codec.tree_to_proto(tree)))
    assert torch.equal(back.proposal(1).probs, torch.nn.functional.one_hot(one_hot.tokens, 1000).float())
    for i in (0, 2):
        _assert_proposal_equal(rows[i][2], back.proposal(i))


def test_batches_round_trip():
    trees = [_tree("greedy"), _tree("top-k", n=2)]
    back = codec.tree_batch_from_proto(_wire(codec.tree_batch_to_proto(trees)))
    assert [t.num_branches for t in back] == [3, 2]
    outcomes = [Outcome(1, 0, 0, 3, None), Outcome(2, 4, 1, 5, [7])]
    assert codec.outcome_batch_from_proto(_wire(codec.outcome_batch_to_proto(outcomes))) == outcomes
    proposals = [p for t in trees for _, _, p in t.rows()]
    props = codec.proposal_batch_from_proto(_wire(codec.proposal_batch_to_proto(proposals)))
    assert len(props) == 5
    for a, b in zip(proposals, props):
        _assert_proposal_equal(a, b)
    assert codec.release_batch_from_proto(_wire(codec.release_batch_to_proto([Release(1)]))) == [Release(1)]
    plans = [TreePlan(1, 4, [0, 0, 2], [5, 9, 3]), TreePlan(2, 0)]  # a tree may hold no branch
    assert codec.plan_batch_from_proto(_wire(codec.plan_batch_to_proto(plans))) == plans


def test_malformed_plans_raise_codec_error():
    _bad(lambda: codec.plan_to_proto(TreePlan(1, 0, [0, 1], [5])))  # columns of unequal length
    for bad in (pb.TreePlan(seq_id=1, accepted=[0], bonus_tokens=[5, 6]), pb.TreePlan(seq_id=1, accepted=[-1], bonus_tokens=[5]),
                pb.TreePlan(seq_id=1, accepted=[0], bonus_tokens=[-5]), pb.TreePlan(seq_id=1, round=-1)):
        _bad(lambda: codec.plan_from_proto(bad))


def test_malformed_trees_raise_codec_error():
    good = codec.tree_to_proto(_tree("top-k"))
    for mutate in (lambda m: m.ClearField("proposals"),                                   # branches without tokens
                   lambda m: m.bonus_tokens.append(3),                                    # columns of unequal length
                   lambda m: m.accepted.__setitem__(0, -1),                               # a negative k
                   lambda m: setattr(m, "build_s", float("nan")),                         # not a duration
                   lambda m: m.proposals.tokens.CopyFrom(codec.tensor_to_proto(torch.tensor([1, 2, 3], dtype=torch.int32))),
                   lambda m: m.proposals.tokens.CopyFrom(codec.tensor_to_proto(torch.ones(2, 2, dtype=torch.int32))),
                   lambda m: m.proposals.sparse.row_offsets.CopyFrom(codec.tensor_to_proto(torch.tensor([0, 3], dtype=torch.int32)))):
        bad = pb.SpeculationTree()
        bad.CopyFrom(good)
        mutate(bad)
        _bad(lambda: codec.tree_from_proto(bad))
    for broken in (lambda t: t.accepted.append(4),                      # more outcomes than token rows
                   lambda t: setattr(t, "proposals", None),              # branches without proposals
                   lambda t: setattr(t.proposals, "tokens", t.proposals.tokens[0])):  # not [N, K]
        tree = _tree("greedy")
        broken(tree)
        _bad(lambda: codec.tree_to_proto(tree))
    with pytest.raises(ValueError, match="K tokens"):  # rows of a tree must have one K
        SpeculationTree.from_rows(5, 9, [(0, 1, Proposal(torch.tensor([1, 2]), None)), (1, 2, Proposal(torch.tensor([1]), None))])


def _bad(msg_factory):
    with pytest.raises(codec.CodecError):
        msg_factory()


def test_malformed_messages_raise_codec_error():
    t = codec.tensor_to_proto(torch.ones(2, 3))
    short = pb.Tensor(dtype=t.dtype, shape=t.shape, data=t.data[:-1])
    _bad(lambda: codec.tensor_from_proto(short))
    _bad(lambda: codec.tensor_from_proto(pb.Tensor(dtype=0, shape=[1], data=b"\0" * 4)))
    _bad(lambda: codec.tensor_from_proto(pb.Tensor(dtype=pb.Tensor.INT32, shape=[-1], data=b"")))
    _bad(lambda: codec.prefill_from_proto(pb.PrefillRequest(seq_id=1, prompt_token_ids=[1])))  # no sampling
    for prompt_len in (-1, 2):  # more prompt than tokens sent
        _bad(lambda: codec.prefill_from_proto(pb.PrefillRequest(seq_id=1, prompt_token_ids=[1], prompt_len=prompt_len,
                                                                sampling=pb.DraftSampling(temperature=1.0, top_p=1.0))))
    _bad(lambda: codec.outcome_from_proto(pb.Outcome(seq_id=1, round=-1)))
    for wait in (-0.001, float("nan"), float("inf")):
        _bad(lambda: codec.outcome_from_proto(pb.Outcome(seq_id=1, tree_wait_s=wait)))
    _bad(lambda: codec.jit_request_from_proto(pb.JitDraftRequest(seq_id=1, accepted=-2)))
    _bad(lambda: codec.proposal_from_proto(pb.Proposal()))  # no tokens
    _bad(lambda: codec.sampling_to_proto(DraftSampling(1.0, 0, 1.0, 2 ** 64)))
    for bad in (dict(repetition_penalty=0.0), dict(repetition_penalty=float("nan")), dict(presence_penalty=2.5),
                dict(frequency_penalty=float("inf")), dict(logit_bias={3: 101.0}), dict(logit_bias={-3: 1.0}),
                dict(logit_bias={3: float("nan")}), dict(allowed_token_ids=[-1]), dict(min_p=1.5),
                dict(min_p=float("nan"))):  # they would poison the draft's logits
        _bad(lambda: codec.sampling_from_proto(pb.DraftSampling(temperature=1.0, top_p=1.0, **bad)))


def test_malformed_sparse_probs_raise_codec_error():
    good = codec.proposal_to_proto(Proposal(torch.tensor([1, 2]), _top_k_probs(2, 100, 3)))
    assert good.WhichOneof("probs") == "sparse"
    for mutate in (lambda m: setattr(m.sparse, "vocab_size", 2),                       # ids out of range
                   lambda m: m.sparse.row_offsets.CopyFrom(codec.tensor_to_proto(torch.tensor([0, 4, 3], dtype=torch.int32))),
                   lambda m: m.sparse.probs.CopyFrom(codec.tensor_to_proto(torch.ones(5))),
                   lambda m: m.tokens.CopyFrom(codec.tensor_to_proto(torch.tensor([1, 2, 3], dtype=torch.int32)))):
        bad = pb.Proposal()
        bad.CopyFrom(good)
        mutate(bad)
        _bad(lambda: codec.proposal_from_proto(bad))
