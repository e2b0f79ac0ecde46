"""The draft protocol's edge after a review: a refused call changes nothing (duplicate sequences in a batch, a
draft past max_model_len, an answer too large to send), an empty prefill is answered, a sparse q of no tokens
decodes or is refused as a codec error, a reply the target fails to take in marks its server dead (it once ended
the reader, every later draft there waiting out its deadline), and the message limit is sized from the config.
A real DraftWorker behind a real DraftService on loopback."""
from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from saguaro_dist.config import Config
from saguaro_dist.distributed import codec
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.errors import DraftOutOfSync
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.distributed.proto import saguaro_pb2 as pb, saguaro_pb2_grpc
from saguaro_dist.distributed.tensor_codec import INT32, array_to_proto, tensor_to_proto
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest

GREEDY = DraftSampling(0.0, 0, 1.0, None)
SAMPLED = DraftSampling(1.0, 0, 1.0, 1)
BIG_VOCAB = 151936  # Qwen2's


class Served:
    """A DraftWorker served on loopback, and a stub to it."""

    def __init__(self, path, mode: str = "ssd", k: int = 3, max_batch_size: int = 8, **serve_kwargs):
        self.worker = build_draft_worker(Config(model=path, draft=path, mode=mode, k=k, fan_out=6,
                                                max_batch_size=max_batch_size, enable_prefix_caching=False))
        self.server, self.port = serve_draft(self.worker, "127.0.0.1", 0, **serve_kwargs)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = saguaro_pb2_grpc.DraftServiceStub(self.channel)

    def prefill(self, reqs):
        self.stub.Prefill(codec.prefill_batch_to_proto(reqs), timeout=30)

    def jit(self, reqs):
        return codec.proposal_batch_from_proto(self.stub.JitDraft(codec.jit_batch_to_proto(reqs), timeout=30))

    def stream(self, requests: list[pb.SpeculateRequest]) -> list[str]:
        """Send the requests on one Speculate stream; the kinds of its replies (raises the stream's failure)."""
        return [m.WhichOneof("kind") for m in self.stub.Speculate(iter(requests), timeout=30)]

    def state(self, seq_id: int):
        s = self.worker.seqs[seq_id]
        return list(s.committed), s.round, list(s.speculation), self.worker.runner.length(seq_id)

    def close(self):
        self.channel.close()
        self.server.stop(None)


@pytest.fixture
def served(tiny_checkpoint):
    s = Served(tiny_checkpoint("draft"))
    yield s
    s.close()


def refused(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def outcomes(batch) -> pb.SpeculateRequest:
    return pb.SpeculateRequest(outcomes=codec.outcome_batch_to_proto(batch))


def test_an_empty_prefill_is_answered_like_the_other_empty_batches(served):
    served.prefill([])
    assert served.worker.seqs == {}


def test_a_duplicate_outcome_is_refused_before_either_commits(served):
    served.prefill([PrefillRequest(3, [5, 6, 7], GREEDY)])
    served.jit([JitDraftRequest(3, 0, 0, 7, skip_tree=True)])
    before = served.state(3)
    twice = [Outcome(3, 0, 1, 9, [1, 2, 3]), Outcome(3, 0, 1, 9, [1, 2, 3])]
    code, details = refused(lambda: served.stream([outcomes(twice)]))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "more than once" in details
    assert served.state(3) == before
    served.stream([outcomes(twice[:1])])  # the outcome itself is taken
    assert served.state(3)[1] == 1


def test_a_catch_up_with_a_duplicate_in_any_round_observes_no_round(served):
    served.prefill([PrefillRequest(3, [5, 6, 7], GREEDY)])
    served.jit([JitDraftRequest(3, 0, 0, 7, skip_tree=True)])
    before = served.state(3)
    rounds = [[Outcome(3, 0, 1, 9, [1, 2, 3], skip_tree=True)],
              [Outcome(3, 1, 0, 4, [4, 5, 6], skip_tree=True), Outcome(3, 1, 0, 4, [4, 5, 6], skip_tree=True)]]
    code, _ = refused(lambda: served.stream([pb.SpeculateRequest(catch_up=codec.outcome_rounds_to_proto(rounds))]))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert served.state(3) == before


def test_a_duplicate_just_in_time_draft_is_refused_and_changes_nothing(served):
    served.prefill([PrefillRequest(2, [5, 6, 7], GREEDY)])
    served.jit([JitDraftRequest(2, 0, 0, 7, skip_tree=True)])
    before = served.state(2)
    twice = [JitDraftRequest(2, 1, 0, 9, skip_tree=True)] * 2
    code, details = refused(lambda: served.jit(twice))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "more than once" in details
    assert served.state(2) == before
    served.jit(twice[:1])  # the same round asked once is served
    assert served.state(2)[0] == before[0] + [9]


def test_a_draft_past_max_model_len_is_refused_before_any_sequence_of_its_batch_commits(served):
    max_len = served.worker.runner.max_positions  # max_model_len and the draft's position slack
    served.prefill([PrefillRequest(1, [5] * (max_len - 6), GREEDY), PrefillRequest(2, [5, 6, 7], GREEDY)])
    served.jit([JitDraftRequest(1, 0, 0, 7, skip_tree=True), JitDraftRequest(2, 0, 0, 7, skip_tree=True)])
    before = served.state(1), served.state(2)
    batch = [JitDraftRequest(1, 1, 3, 8, skip_tree=True), JitDraftRequest(2, 1, 1, 8, skip_tree=True)]
    code, details = refused(lambda: served.jit(batch))  # 1 would need max_len - 5 + 3 + K positions
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len" in details and "malformed" not in details
    assert (served.state(1), served.state(2)) == before
    served.jit(batch[1:])  # the target drops sequence 1 and asks again for 2: the same round, served
    assert served.state(2)[:2] == (before[1][0] + [7, 8], 1)


def sparse_probs(vocab: int, offsets, ids, probs) -> pb.SparseProbs:
    return pb.SparseProbs(vocab_size=vocab, row_offsets=array_to_proto(np.array(offsets, np.int32), INT32),
                          token_ids=array_to_proto(np.array(ids, np.int32), INT32),
                          probs=tensor_to_proto(torch.tensor(probs, dtype=torch.float32)))


def no_tokens(shape) -> pb.Proposal:
    return pb.Proposal(tokens=array_to_proto(np.zeros(shape, np.int32), INT32), sparse=sparse_probs(64, [0], [], []))


def test_a_sparse_q_of_no_tokens_decodes_or_is_refused_as_a_codec_error():
    (proposal,) = codec.proposal_batch_from_proto(pb.ProposalBatch(proposals=[no_tokens((0,))]))
    assert proposal.tokens.numel() == 0 and tuple(proposal.probs.shape) == (0, 64)
    tree = pb.SpeculationTree(seq_id=1, round=0, accepted=[1], bonus_tokens=[2], proposals=no_tokens((0, 3)))
    with pytest.raises(codec.CodecError):
        codec.tree_batch_from_proto(pb.SpeculationTreeBatch(trees=[tree]))


@pytest.fixture
def backend_to(tiny_checkpoint):
    made = []

    def make(deadline_s: float = 3.0, **serve_kwargs):
        s = Served(tiny_checkpoint("draft"), **serve_kwargs)
        b = GrpcDraftBackend([f"127.0.0.1:{s.port}"], deadline_s=deadline_s)
        made.append((s, b))
        return s, b
    yield make
    for s, b in made:
        b.close()
        s.close()


def failing_once(real, exc: Exception):
    calls = []

    def decode(*args):
        calls.append(1)
        if len(calls) == 1:
            raise exc
        return real(*args)
    return decode


def test_an_answer_the_target_fails_to_decode_fails_its_draft_at_once(backend_to, monkeypatch):
    """A decoder failing otherwise than with CodecError (a bug) fails that draft as out of sync, not the reader."""
    s, b = backend_to()
    b.prefill([PrefillRequest(1, [5, 6, 7], GREEDY)])
    monkeypatch.setattr(codec, "proposal_batch_from_proto",
                        failing_once(codec.proposal_batch_from_proto, RuntimeError("decoder bug")))
    with pytest.raises(DraftOutOfSync):  # before: no answer, DraftUnavailable once the deadline passed
        b.jit_draft([JitDraftRequest(1, 0, 0, 7, skip_tree=True)])
    assert b._links[0].reader.is_alive()


def test_a_pushed_batch_the_target_fails_to_take_in_marks_the_server_dead_and_it_comes_back(backend_to, monkeypatch):
    s, b = backend_to()
    link = b._links[0]
    b.prefill([PrefillRequest(1, [5, 6, 7], GREEDY)])
    monkeypatch.setattr(codec, "tree_batch_from_proto",
                        failing_once(codec.tree_batch_from_proto, RuntimeError("decoder bug")))
    old_reader = link.reader
    b.jit_draft([JitDraftRequest(1, 0, 0, 7)])  # its tree follows on the stream: the reader fails on it
    old_reader.join(timeout=10)
    assert not old_reader.is_alive()
    end = time.monotonic() + 20
    while not (link.alive and link.reader is not old_reader and link.reader.is_alive()) and time.monotonic() < end:
        time.sleep(0.05)
    assert link.alive and link.reader.is_alive()  # revived, with a reader: before, alive and never read again
    b.prefill([PrefillRequest(2, [5, 6, 7], GREEDY)])
    (proposal,) = b.jit_draft([JitDraftRequest(2, 0, 0, 7, skip_tree=True)])
    assert proposal.tokens.numel() == 3


def test_the_message_limit_grows_with_the_vocabulary_up_to_grpcs_ceiling():
    from saguaro_dist.distributed.message_limits import (DEFAULT_MAX_MESSAGE_BYTES, GRPC_MAX_MESSAGE_BYTES,
                                                         max_message_bytes)
    assert max_message_bytes(8, 3, 12, 64) == DEFAULT_MAX_MESSAGE_BYTES
    limit = max_message_bytes(64, 3, 12, BIG_VOCAB)
    assert limit >= 64 * 3 * BIG_VOCAB * 4 > DEFAULT_MAX_MESSAGE_BYTES  # a full batch's dense just-in-time answer
    assert limit >= 2 * 12 * 4 * BIG_VOCAB * 4  # a tree batch
    assert max_message_bytes(256, 8, 48, 262144) == GRPC_MAX_MESSAGE_BYTES
    assert max_message_bytes(1024, 1, 1, 64, max_model_len=131072) >= 1024 * 131072 * 4  # a batch of long prompts


def test_a_unary_answer_over_the_limit_is_refused_before_the_worker_drafts(backend_to):
    """Sampled rows answer a dense q each: four of them could pass a 4 kB limit. A unary call (one message) is
    refused before the worker commits anything (before: the retry was a round behind); on the stream the answer
    may go in parts (tests/test_jit_parts.py), so the same draft is served there."""
    s, b = backend_to(mode="sd", max_message_bytes=4096)
    b.prefill([PrefillRequest(i, [5, 6, 7], SAMPLED) for i in range(4)])
    before = [s.state(i) for i in range(4)]
    reqs = [JitDraftRequest(i, 0, 0, 7) for i in range(4)]
    code, details = refused(lambda: s.jit(reqs))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "refused before drafting" in details
    assert [s.state(i) for i in range(4)] == before
    proposals = b.jit_draft(reqs)
    assert all(p.tokens.numel() == 3 and p.probs is not None for p in proposals)


@pytest.fixture(scope="module")
def big_vocab_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt_big_vocab")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=BIG_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                 tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                                 pad_token_id=None)).save_pretrained(path)
    return path


def test_a_just_in_time_answer_over_64_mib_reaches_the_target(big_vocab_checkpoint):
    """15 sampled rows of K = 8 over V = 151936: a 73 MB dense answer, past the old fixed 64 MiB limit; the limit
    sized from the config lets it through, q still float32."""
    s = Served(big_vocab_checkpoint, mode="sd", k=8, max_batch_size=16)
    b = GrpcDraftBackend([f"127.0.0.1:{s.port}"], deadline_s=60.0)
    try:
        b.prefill([PrefillRequest(i, [5, 6, 7], SAMPLED) for i in range(15)])
        proposals = b.jit_draft([JitDraftRequest(i, 0, 0, 7) for i in range(15)])
        assert sum(p.probs.numel() * p.probs.element_size() for p in proposals) > 64 * 1024 * 1024
        assert all(p.probs.dtype is torch.float32 and tuple(p.probs.shape) == (8, BIG_VOCAB) for p in proposals)
    finally:
        b.close()
        s.close()
