"""Review fixes on the gRPC draft wire. A q that is no distribution (negative, non-finite, 0 at the drafted
token, or of mass far from 1) is refused where it is decoded: verification accepts x whenever p(x) >= q(x),
so such a q would emit the drafted token far more often than the target's p says. And a pool reading its
stalled workers' answers in turn waits one draft deadline in all, not one per worker."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from saguaro_dist.distributed import codec, grpc_link
from saguaro_dist.distributed.draft_pool import DraftPool
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.errors import DraftOutOfSync, DraftUnavailable
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest, Proposal, SpeculationTree
from test_grpc_toy_worker import ToyWorker

pytestmark = pytest.mark.timeout(120)
V = 8
GREEDY = DraftSampling(0.0, 0, 1.0, None)
TOP_K = DraftSampling(1.0, 4, 1.0, None)  # the toy worker's q is sparse: 4 ids a row, the drafted one first


def _row(**at) -> list[float]:
    """A q row over V = 8: `rest` spread evenly, then the given entries (at={"x3": -0.4}: q[3] = -0.4)."""
    row = [at.pop("rest", 1.0 / V)] * V
    for key, value in at.items():
        row[int(key[1:])] = value
    return row


BAD_Q = {  # (q rows for tokens [3, 5], the wire form they take)
    "q(x) = 0, sparse": ([[0, 1, 0, 0, 0, 0, 0, 0], _row(x5=1.0, rest=0.0)], "sparse"),
    "q(x) < 0": ([_row(x3=-0.4, rest=0.2), _row()], "dense"),
    "q < 0 off x": ([_row(x0=-0.4, rest=1.4 / 7), _row()], "dense"),
    "NaN": ([_row(x6=float("nan")), _row()], "dense"),
    "inf": ([_row(), _row(x1=float("inf"))], "dense"),
    "mass 0.5": ([_row(rest=0.5 / V), _row()], "dense"),
    "mass 2": ([_row(), _row(rest=2.0 / V)], "dense"),
}


def _roundtrip_proposal(tokens: list[int], q: torch.Tensor) -> Proposal:
    wire = codec.proposal_batch_to_proto([Proposal(torch.tensor(tokens), q)]).SerializeToString()
    return codec.proposal_batch_from_proto(pb.ProposalBatch.FromString(wire))[0]


def _roundtrip_tree(tokens: list[int], q: torch.Tensor) -> SpeculationTree:
    tree = SpeculationTree(7, 0, accepted=[0], bonus_tokens=[1], proposals=Proposal(torch.tensor([tokens]), q[None]))
    wire = codec.tree_batch_to_proto([tree]).SerializeToString()
    return codec.tree_batch_from_proto(pb.SpeculationTreeBatch.FromString(wire))[0]


@pytest.mark.parametrize("case", list(BAD_Q))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("roundtrip", [_roundtrip_proposal, _roundtrip_tree], ids=["jit", "tree"])
def test_a_q_that_is_no_distribution_is_refused_as_it_is_decoded(case, dtype, roundtrip):
    rows, form = BAD_Q[case]
    q = torch.tensor(rows, dtype=dtype)
    assert codec.proposal_to_proto(Proposal(torch.tensor([3, 5]), q)).WhichOneof("probs") == form
    with pytest.raises(codec.CodecError, match="distribution"):
        roundtrip([3, 5], q)


def test_a_drafted_token_outside_q_is_refused():
    with pytest.raises(codec.CodecError, match="vocabulary"):
        _roundtrip_proposal([3, V], torch.full((2, V), 1.0 / V))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("top_k", [0, 40])
def test_an_honest_q_decodes_bit_for_bit_in_every_wire_dtype_and_form(dtype, top_k):
    """A softmax over 32k ids (truncated to its top 40 and renormalised: sparse), rounded to dtype: its mass
    strays from 1 by that rounding alone, which the check allows. Each token drafted is a row's likeliest."""
    gen = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(3, 32000, generator=gen) * 3, -1)
    if top_k:
        top = q.topk(top_k, -1)
        q = torch.zeros_like(q).scatter_(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    q = q.to(dtype)
    tokens = q.float().argmax(-1).tolist()
    for decoded in (_roundtrip_proposal(tokens, q), _roundtrip_tree(tokens, q).proposals):
        assert decoded.probs.dtype == dtype and torch.equal(decoded.probs.reshape(q.shape).view(-1), q.view(-1))


@pytest.mark.parametrize("vocab", [128256, 151936])
def test_a_near_uniform_half_precision_q_over_a_large_vocabulary_decodes(vocab):
    """float16 keeps entries under 6e-5 as subnormals, one step 6e-8 apart: a near-uniform row over 150k ids
    strays from 1 by up to 0.004 by that rounding alone (second-round review; the dtype's eps alone refused it)."""
    q = torch.full((2, vocab), 1.0 / vocab).half()  # (every entry rounded the same way: the row strays the most)
    assert (q.float().sum(-1) - 1).abs().max() > 1e-3  # the case: past the eps tolerance
    tokens = [0, vocab - 1]
    assert torch.equal(_roundtrip_proposal(tokens, q).probs, q)


def test_the_reviewers_case_now_never_reaches_verification():
    """Target p(3) = 0.1; a draft sends x = 3 with q(3) = 0 (sparse) or -0.4 (dense): verification would accept
    it with probability 1. An honest one-hot q on 3 still decodes."""
    for rows in ([[0, 1, 0, 0, 0, 0, 0, 0]], [_row(x3=-0.4, rest=0.2)]):
        with pytest.raises(codec.CodecError):
            _roundtrip_proposal([3], torch.tensor(rows))
    assert _roundtrip_proposal([3], torch.eye(V)[3:4]).probs[0, 3] == 1


# ---- over real gRPC: the target treats such an answer as malformed --------------------------------------------
class ZeroAtDraftedToken(ToyWorker):
    """Answers sequences in `bad` with their q moved off the drafted token (q(x) = 0, still summing to 1)."""

    bad: set[int] = set()

    def jit_draft(self, reqs):
        proposals = super().jit_draft(reqs)
        for r, p in zip(reqs, proposals):
            if r.seq_id in self.bad:
                p.probs[torch.arange(len(p.tokens)), p.tokens] = 0
                p.probs /= p.probs.sum(-1, keepdim=True)
        return proposals


def test_a_draft_answer_with_a_bad_q_is_refused_and_its_sequence_drafted_afresh():
    worker = ZeroAtDraftedToken()
    worker.bad = {2}
    server, port = serve_draft(worker, "127.0.0.1", 0)
    backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)
    try:
        backend.prefill([PrefillRequest(s, [5, 6], TOP_K) for s in (1, 2)])
        with pytest.raises(DraftOutOfSync) as caught:
            backend.jit_draft([JitDraftRequest(s, 0, 0, 9) for s in (1, 2)])
        # one answer for both: both out of step (prefilled again), neither's q reaches verification
        assert sorted(caught.value.seq_ids) == [1, 2] and caught.value.partial == {}
        assert backend.lost([1, 2]) == [1, 2]
    finally:
        backend.close()
        server.stop(None)


# ---- deadlines: one for the whole pool ---------------------------------------------------------------------------
class Stalling(ToyWorker):
    """Drafts only once `go` is set (the test sets it when done: the server's threads end at once)."""

    def __init__(self, go: threading.Event):
        super().__init__()
        self.go = go

    def jit_draft(self, reqs):
        self.go.wait(30)
        return super().jit_draft(reqs)


class TimedFuture(Future):
    """A just-in-time answer that records each wait on it: (the timeout it was given, when it ended)."""

    waits: list[tuple[float, float]] = []

    def result(self, timeout=None):
        try:
            return super().result(timeout)
        finally:
            if timeout is not None:
                TimedFuture.waits.append((timeout, time.monotonic()))


def test_a_pool_of_stalled_workers_waits_one_deadline_in_all(monkeypatch):
    """Each wait is given at most what is left of one deadline taken when the drafts went out: once the first
    worker's wait has run it out, the others' get nothing (they used to get deadline_s each, in turn)."""
    deadline_s, go = 0.5, threading.Event()
    workers = [Stalling(go) for _ in range(3)]
    servers = [serve_draft(w, "127.0.0.1", 0) for w in workers]
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=deadline_s) for _, port in servers],
                     max_batch_size=3)
    monkeypatch.setattr(grpc_link, "Future", TimedFuture)
    monkeypatch.setattr(TimedFuture, "waits", [])
    try:
        pool.prefill([PrefillRequest(s, [5, 6], GREEDY) for s in (1, 2, 3)])
        assert sorted(g[0] for g in pool.groups.values()) == [0, 1, 2]  # one sequence a worker
        pending = pool.start_jit_draft([JitDraftRequest(s, 0, 0, 9) for s in (1, 2, 3)])
        sent = time.monotonic()  # every deadline was taken before this
        with pytest.raises(DraftUnavailable) as caught:
            pending.result()
        assert sorted(caught.value.seq_ids) == [1, 2, 3]
        waits = TimedFuture.waits
        assert len(waits) == 3
        began = [sent] + [ended for _, ended in waits[:-1]]  # each wait began after the one before it ended
        # (a wait that began past the deadline is given 0: on a loaded box the first may end late)
        assert all(timeout <= max(0.0, sent + deadline_s - start) + 1e-6
                   for (timeout, _), start in zip(waits, began)), waits
    finally:
        go.set()
        pool.close()
        for server, _ in servers:
            server.stop(None)


# ---- an engine over a draft server that lies about q ------------------------------------------------------------
FORCED = 0  # the token the lying draft proposes K times a round


def _lying(jit_draft, vocab: int):
    """jit_draft, its proposals replaced by FORCED K times with a dense q negative there (and summing to 1):
    verification would accept FORCED wherever the target gives it any probability."""
    def draft(reqs):
        proposals = jit_draft(reqs)
        out = []
        for p in proposals:
            q = torch.full((len(p.tokens), vocab), 1.4 / (vocab - 1))
            q[:, FORCED] = -0.4
            out.append(Proposal(torch.full_like(p.tokens, FORCED), q))
        return out
    return draft


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_that_sends_a_q_that_is_no_distribution_costs_fallbacks_never_tokens(tiny_llama_pair, temperature):
    """Every just-in-time answer is refused as malformed (a fallback each, then a fresh prefill), and the
    tokens are the target's: greedy ones equal to transformers', sampled ones not the draft's forced token
    (it used to be accepted at every position: 3 in 4 tokens)."""
    from engine_helpers import assert_greedy_equal, hf_greedy
    from saguaro_dist.config import Config
    from saguaro_dist.engine.build import build_draft_worker, eos_ids, make_runner
    from saguaro_dist.engine.engine import Engine
    from saguaro_dist.engine.sequence import Sequence
    from saguaro_dist.sampling_params import SamplingParams
    target, draft = tiny_llama_pair
    config = Config(model=target, draft=draft, mode="sd", k=3)
    worker = build_draft_worker(config)
    runner = make_runner(config.model, config)
    worker.jit_draft = _lying(worker.jit_draft, runner.vocab_size)
    server, port = serve_draft(worker, "127.0.0.1", 0)
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)], max_batch_size=4)
    engine = Engine(config, runner, pool, None, eos_ids(runner, None))
    params = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=3)
    seqs = [Sequence(i, str(i), prompt, params) for i, prompt in enumerate([[5, 9, 2, 7], [1, 2, 3]])]
    try:
        for s in seqs:
            engine.add(s)
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
        server.stop(None)
    tokens = [t for s in seqs for t in s.output_token_ids]
    assert len(tokens) == 32
    if temperature == 0:
        from transformers import LlamaForCausalLM
        model = LlamaForCausalLM.from_pretrained(target)
        for s in seqs:
            assert_greedy_equal(s.output_token_ids, hf_greedy(model, s.prompt_token_ids, 16), s.prompt_token_ids, model)
    else:
        assert tokens.count(FORCED) < len(tokens) // 4, tokens
    assert sum(engine.metrics.fallbacks.values()) >= len(seqs)  # refused, and counted
