"""A just-in-time answer over the server's message limit crosses the Speculate stream in parts (JitDraftResult.
parts_after) that the target joins, every q bit for bit: refused every round, a config whose dense answer passes
gRPC's 2 GiB ceiling (batch 512, K 8, a 256k vocabulary) could never draft. A small limit stands in for the ceiling.
A limit that cannot hold one row is refused at start-up. Real DraftWorkers and engines over real gRPC on loopback."""
from __future__ import annotations

import logging

import grpc
import pytest
import torch

from engine_helpers import PROMPTS, assert_greedy_equal, close_pair, hf_greedy
from saguaro_dist import SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.distributed import codec
from saguaro_dist.distributed.draft_pool import DraftPool
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.distributed.proto import saguaro_pb2 as pb, saguaro_pb2_grpc
from saguaro_dist.engine.build import build_draft_worker, make_runner
from saguaro_dist.engine.engine import Engine
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
from saguaro_dist.engine.sequence import Sequence

pytestmark = pytest.mark.timeout(300)
LIMIT = 4096  # a sampled row here is ~1.2 kB (K 3 x V 96 float32): about three rows a part
ROWS = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("jit_parts_pair"))


@pytest.fixture(scope="module")
def config(pair):
    return Config(model=pair["target"], draft=pair["close"], mode="sd", k=3, max_batch_size=16, draft_threads=1)


def sampled(seed: int) -> DraftSampling:
    return DraftSampling(1.0, 0, 1.0, seed)


def prefills(first: int) -> list[PrefillRequest]:
    return [PrefillRequest(first + i, PROMPTS[i % len(PROMPTS)], sampled(i)) for i in range(ROWS)]


def jits(first: int) -> list[JitDraftRequest]:
    return [JitDraftRequest(first + i, 0, 0, 7, skip_tree=True) for i in range(ROWS)]


def assert_bit_identical(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g.tokens, w.tokens)
        assert g.probs.dtype is w.probs.dtype is torch.float32
        assert g.probs.numpy().tobytes() == w.probs.numpy().tobytes()


def test_an_answer_over_the_limit_crosses_the_stream_in_parts_joined_bit_for_bit(config):
    """Ten sampled rows (~12 kB) under a 4 kB limit: parts counting down to 0, each under the limit, and the
    target's join equals what the same worker drafts in process, q bit for bit (before: RESOURCE_EXHAUSTED)."""
    reference = build_draft_worker(config)
    server, port = serve_draft(build_draft_worker(config), "127.0.0.1", 0, max_message_bytes=LIMIT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=30.0)
    try:
        stub = saguaro_pb2_grpc.DraftServiceStub(channel)
        stub.Prefill(codec.prefill_batch_to_proto(prefills(0)), timeout=30)
        reference.prefill(prefills(0) + prefills(100))
        call = pb.JitDraftCall(call_id=7, batch=codec.jit_batch_to_proto(jits(0)))
        replies = list(stub.Speculate(iter([pb.SpeculateRequest(jit_draft=call)]), timeout=30))
        parts = [r.jit_draft for r in replies if r.WhichOneof("kind") == "jit_draft"]
        assert len(parts) > 1 and all(r.ByteSize() <= LIMIT for r in replies)
        assert [p.parts_after for p in parts] == list(range(len(parts) - 1, -1, -1))
        assert {p.call_id for p in parts} == {7} and not any(p.HasField("error") for p in parts)
        joined = [q for p in parts for q in codec.proposal_batch_from_proto(p.proposals)]
        assert_bit_identical(joined, reference.jit_draft(jits(0)))

        backend.prefill(prefills(100))  # the target's own join (Link.answer)
        assert_bit_identical(backend.jit_draft(jits(100)), reference.jit_draft(jits(100)))
    finally:
        backend.close()
        channel.close()
        server.stop(None)


def test_a_limit_that_cannot_hold_one_row_is_refused_at_start_up(config):
    """Before: the server started, and every sampled draft was refused, round after round."""
    with pytest.raises(ValueError, match="cannot hold one sampled just-in-time row"):
        serve_draft(build_draft_worker(config), "127.0.0.1", 0, max_message_bytes=1024)


def run_engine(config, address: str, params: list[SamplingParams]) -> list[list[int]]:
    engine = Engine(config, make_runner(config.model, config),
                    DraftPool([GrpcDraftBackend([address], deadline_s=30.0)], max_batch_size=16), None, set())
    try:
        seqs = [Sequence(i, f"r{i}", PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params)]
        for seq in seqs:
            engine.add(seq)
        for _ in range(200):
            if all(s.finished for s in seqs):
                break
            engine.step()
        assert all(s.finished for s in seqs)
        return [list(s.output_token_ids) for s in seqs]
    finally:
        engine.close()


def test_an_engine_drafting_over_parts_stays_exact(config, pair, caplog):
    """A batch of greedy and seeded sampled requests, every round drafted just in time (sd) by a server whose
    answers go in parts: greedy equals HF's, sampled equals the same engine's over a server that sends each
    answer whole (the same q, so the same accept / reject decisions)."""
    caplog.set_level(logging.DEBUG, logger="saguaro_dist.distributed.message_limits")
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3 + \
             [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=12, ignore_eos=True) for i in range(7)]
    outs = {}
    for limit in (LIMIT, None):
        server, port = serve_draft(build_draft_worker(config), "127.0.0.1", 0, max_message_bytes=limit)
        try:
            outs[limit] = run_engine(config, f"127.0.0.1:{port}", params)
        finally:
            server.stop(None)
    assert any("parts under" in r.getMessage() for r in caplog.records)  # answers went in parts
    assert not any("out of step" in r.getMessage() for r in caplog.records)  # before: refused, re-prefilled, again
    assert outs[LIMIT] == outs[None]
    for i in range(3):
        prompt = PROMPTS[i % len(PROMPTS)]
        assert_greedy_equal(outs[LIMIT][i], hf_greedy(pair["model"], prompt, 12), prompt, pair["model"])


def test_parts_out_of_order_or_missing_are_refused_as_malformed():
    from saguaro_dist.distributed.grpc_link import Link
    part = pb.JitDraftResult(call_id=1, proposals=pb.ProposalBatch())
    with pytest.raises(codec.CodecError, match="parts after"):
        Link._proposals([pb.JitDraftResult(call_id=1, parts_after=2), part], [])  # the middle part is missing
    assert Link._proposals([pb.JitDraftResult(call_id=1, parts_after=1), part], []) == []
