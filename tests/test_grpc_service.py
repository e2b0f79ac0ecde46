"""DraftService over real gRPC on 127.0.0.1, hosting ToyWorker (tests/test_grpc_toy_worker.py), a small
real implementation of the DraftWorker interface: calls, pushed trees, and status codes at the edge."""
from __future__ import annotations

import sys

import queue
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from saguaro_dist.distributed import codec
from saguaro_dist.distributed.draft_service import default_bind_host, local_address, serve_draft
from saguaro_dist.distributed.proto import SERVICE_NAME, saguaro_pb2 as pb, saguaro_pb2_grpc
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Release
from test_grpc_toy_worker import K, ToyWorker, expected_branch, toy_probs, toy_tokens

pytestmark = pytest.mark.timeout(60)
GREEDY = DraftSampling(0.0, 0, 1.0, None)
TOP_K = DraftSampling(0.8, 4, 1.0, 7)


class Served:
    def __init__(self, worker=None, **kwargs):
        self.worker = worker or ToyWorker()
        self.server, self.port = serve_draft(self.worker, "127.0.0.1", 0, **kwargs)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = saguaro_pb2_grpc.DraftServiceStub(self.channel)

    def raw(self, method: str):
        """A byte-level caller, to send what the typed stub would refuse to build."""
        return self.channel.unary_unary(f"/{SERVICE_NAME}/{method}")

    def close(self):
        self.channel.close()
        self.server.stop(None)


class StreamClient:
    """An open Speculate call: send outcomes / JITs / releases, read pushed trees and JIT answers."""

    def __init__(self, stub):
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.received: queue.SimpleQueue = queue.SimpleQueue()
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.Speculate(iter(self.requests.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def send(self, outcomes):
        self.requests.put(pb.SpeculateRequest(outcomes=codec.outcome_batch_to_proto(outcomes)))

    def jit(self, call_id, reqs):
        self.requests.put(pb.SpeculateRequest(jit_draft=pb.JitDraftCall(call_id=call_id, batch=codec.jit_batch_to_proto(reqs))))

    def answer(self, timeout=5.0) -> pb.JitDraftResult:
        return self.answers.get(timeout=timeout)

    def get(self, timeout=5.0):
        item = self.received.get(timeout=timeout)
        if isinstance(item, grpc.RpcError):
            raise item
        return codec.tree_batch_from_proto(item.trees)

    def _read(self):
        try:
            for msg in self.call:
                if msg.WhichOneof("kind") == "jit_draft":
                    self.answers.put(msg.jit_draft)
                else:
                    self.received.put(msg)
        except grpc.RpcError as err:
            self.received.put(err)

    def close(self):
        self.requests.put(None)
        self.call.cancel()


@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


def _prefill(stub, seq_id, prompt=(5, 6), sampling=GREEDY):
    stub.Prefill(codec.prefill_batch_to_proto([PrefillRequest(seq_id, list(prompt), sampling)]), timeout=5)


def _jit(stub, seq_id, round_, accepted=0, bonus=9):
    reply = stub.JitDraft(codec.jit_batch_to_proto([JitDraftRequest(seq_id, round_, accepted, bonus)]), timeout=5)
    return codec.proposal_batch_from_proto(reply)


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


def test_prefill_jit_then_trees_pushed_on_the_stream(served):
    stream = StreamClient(served.stub)
    _prefill(served.stub, 1, sampling=TOP_K)
    (proposal,) = _jit(served.stub, 1, 0)
    assert proposal.tokens.tolist() == toy_tokens([5, 6, 9]) and proposal.probs is not None
    (tree,) = stream.get()  # built after the JIT, pushed without being asked
    assert (tree.seq_id, tree.round, tree.num_branches) == (1, 0, K + 1)
    bonus, tokens = expected_branch([5, 6, 9], proposal.tokens.tolist(), 1)
    assert (tree.bonus_tokens[1], tree.proposal(1).tokens.tolist()) == (bonus, tokens)
    assert torch.equal(tree.proposal(1).probs, toy_probs(TOP_K, tokens))  # sparse top-k, exact over the wire
    stream.send([Outcome(1, 0, 1, bonus, None)])  # a hit: the draft continues with the cached branch
    (nxt,) = stream.get()
    assert (nxt.seq_id, nxt.round) == (1, 1)
    stream.close()


def test_trees_built_before_any_stream_wait_for_one(served):
    _prefill(served.stub, 1)
    _jit(served.stub, 1, 0)
    stream = StreamClient(served.stub)  # opened after the JIT: the pending tree is delivered
    (tree,) = stream.get()
    assert tree.round == 0 and tree.proposals.probs is None
    stream.close()


def test_health_service_reports_serving(served):
    health = health_pb2_grpc.HealthStub(served.channel)
    for name in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_malformed_requests_get_invalid_argument(served):
    assert _code(lambda: served.raw("Prefill")(b"\xff\xff\xff\xff", timeout=5)) is grpc.StatusCode.INVALID_ARGUMENT
    no_sampling = pb.PrefillBatch(requests=[pb.PrefillRequest(seq_id=1, prompt_token_ids=[1])])
    assert _code(lambda: served.stub.Prefill(no_sampling, timeout=5)) is grpc.StatusCode.INVALID_ARGUMENT
    zero_penalty = pb.PrefillBatch(requests=[pb.PrefillRequest(seq_id=1, prompt_token_ids=[1], sampling=pb.DraftSampling(
        temperature=1.0, top_p=1.0, repetition_penalty=0.0))])
    assert _code(lambda: served.stub.Prefill(zero_penalty, timeout=5)) is grpc.StatusCode.INVALID_ARGUMENT
    huge_bias = pb.PrefillBatch(requests=[pb.PrefillRequest(seq_id=1, prompt_token_ids=[1], sampling=pb.DraftSampling(
        temperature=1.0, top_p=1.0, logit_bias={3: 1e9}))])
    assert _code(lambda: served.stub.Prefill(huge_bias, timeout=5)) is grpc.StatusCode.INVALID_ARGUMENT
    past_prompt = pb.PrefillBatch(requests=[pb.PrefillRequest(seq_id=1, prompt_token_ids=[1], prompt_len=2,
                                                              sampling=pb.DraftSampling(temperature=1.0, top_p=1.0))])
    assert _code(lambda: served.stub.Prefill(past_prompt, timeout=5)) is grpc.StatusCode.INVALID_ARGUMENT
    negative = pb.JitDraftBatch(requests=[pb.JitDraftRequest(seq_id=1, round=-4)])
    assert _code(lambda: served.stub.JitDraft(negative, timeout=5)) is grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: _prefill(served.stub, 2, prompt=())) is grpc.StatusCode.INVALID_ARGUMENT  # worker's ValueError
    _prefill(served.stub, 1)  # still serving
    assert _jit(served.stub, 1, 0)[0].tokens.tolist() == toy_tokens([5, 6, 9])


def test_unknown_sequence_and_out_of_order_get_their_codes(served):
    assert _code(lambda: _jit(served.stub, 42, 0)) is grpc.StatusCode.NOT_FOUND
    _prefill(served.stub, 1)
    assert _code(lambda: _prefill(served.stub, 1)) is grpc.StatusCode.FAILED_PRECONDITION  # already prefilled
    _jit(served.stub, 1, 0)
    assert _code(lambda: _jit(served.stub, 1, 5)) is grpc.StatusCode.FAILED_PRECONDITION  # skips rounds
    assert _jit(served.stub, 1, 1)[0].tokens.shape == (K,)  # the right round still works
    served.stub.Release(codec.release_batch_to_proto([Release(1), Release(77)]), timeout=5)
    assert _code(lambda: _jit(served.stub, 1, 2)) is grpc.StatusCode.NOT_FOUND


def test_a_jit_that_overtakes_its_outcome_waits_for_the_stream(served):
    # The target streams round 0's outcome, then asks round 1's JIT as a unary call a verify later;
    # on a busy host the JIT can arrive first. It must wait for the outcome, not fail the engine.
    stream = StreamClient(served.stub)
    _prefill(served.stub, 1)
    (proposal,) = _jit(served.stub, 1, 0)
    stream.get()
    calls = served.worker.calls

    def send_once_refused():  # made to happen: round 2's JIT first (refused, it waits), then round 0's outcome
        deadline = time.monotonic() + 30
        while calls.count("jit_draft") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        stream.send([Outcome(1, 0, 0, 9, toy_tokens([5, 6, 9, 9]))])
    late = threading.Thread(target=send_once_refused)
    late.start()
    (nxt,) = _jit(served.stub, 1, 2)
    late.join()
    assert nxt.tokens.shape == (K,)
    assert calls.count("jit_draft") == 3  # round 0's, round 2's refused before the outcome, its retry
    assert calls.index("observe") < len(calls) - 1 - calls[::-1].index("jit_draft")
    stream.close()


@pytest.mark.parametrize("bad, code", [
    (b"\xff\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT),
    (b"", grpc.StatusCode.INVALID_ARGUMENT),  # a SpeculateRequest that carries nothing
    ([Outcome(42, 0, 0, 1, None)], grpc.StatusCode.NOT_FOUND),
    ([Outcome(1, 3, 0, 1, None)], grpc.StatusCode.FAILED_PRECONDITION),
    (pb.SpeculateRequest(catch_up=codec.outcome_rounds_to_proto([[Outcome(1, 0, 0, 3, [1, 2, 3])]])).SerializeToString(),
     grpc.StatusCode.INVALID_ARGUMENT),  # an outcome caught up on must want no tree
    (pb.SpeculateRequest(catch_up=codec.outcome_rounds_to_proto([[Outcome(42, 0, 0, 3, [1, 2, 3], skip_tree=True)]]))
     .SerializeToString(), grpc.StatusCode.NOT_FOUND),
])
def test_bad_outcomes_end_the_stream_with_a_status_and_the_server_lives_on(served, bad, code):
    _prefill(served.stub, 1)
    _jit(served.stub, 1, 0)
    raw = served.channel.stream_stream(f"/{SERVICE_NAME}/Speculate")  # bytes in, bytes out
    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = raw(iter(requests.get, None))
    requests.put(bad if isinstance(bad, bytes)
                 else pb.SpeculateRequest(outcomes=codec.outcome_batch_to_proto(bad)).SerializeToString())
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:  # the tree pending from the JIT may come first
            pass
    assert info.value.code() is code
    stream = StreamClient(served.stub)  # a new stream works
    stream.send([Outcome(1, 0, 0, 3, [1, 2, 3])])
    assert stream.get()[0].round == 1
    stream.close()


def test_oversized_messages_get_resource_exhausted():
    s = Served(max_message_bytes=64 * 1024)
    try:
        big = codec.prefill_batch_to_proto([PrefillRequest(1, list(range(100_000, 140_000)), GREEDY)])
        assert big.ByteSize() > 64 * 1024
        assert _code(lambda: s.stub.Prefill(big, timeout=5)) is grpc.StatusCode.RESOURCE_EXHAUSTED
        stream = StreamClient(s.stub)
        stream.send([Outcome(1, 0, 0, 1, list(range(100_000, 140_000)))])
        assert _code(stream.get) is grpc.StatusCode.RESOURCE_EXHAUSTED
        _prefill(s.stub, 1)  # still serving
    finally:
        s.close()


class BrokenWorker(ToyWorker):
    def jit_draft(self, reqs):
        raise RuntimeError("boom")


def test_a_failing_worker_gets_internal_and_the_server_lives_on():
    s = Served(BrokenWorker())
    try:
        _prefill(s.stub, 1)
        assert _code(lambda: _jit(s.stub, 1, 0)) is grpc.StatusCode.INTERNAL
        _prefill(s.stub, 2)
    finally:
        s.close()


def test_binds_loopback_without_ray_never_all_interfaces(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)  # as in a process that never started Ray
    assert default_bind_host() == "127.0.0.1"
    server, port = serve_draft(ToyWorker(), port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=5)
    finally:
        server.stop(None)


@pytest.mark.skipif(sys.platform != "linux", reason="abstract unix sockets are Linux's")
def test_serves_a_local_socket_too_and_it_goes_with_the_server():
    local = local_address()
    server, port = serve_draft(ToyWorker(), "127.0.0.1", 0, local=local)
    try:
        for address in (local, f"127.0.0.1:{port}"):
            with grpc.insecure_channel(address) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None).wait(10)
    with grpc.insecure_channel(local) as ch:  # nothing listens there any more
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(ch).result(timeout=0.5)


def test_a_client_dials_the_local_socket_only_on_the_draft_s_node():
    from saguaro_dist.distributed.actors import DraftEndpoint
    endpoint = DraftEndpoint("node-a", "10.0.0.5:4000", "unix-abstract:saguaro-draft-1")
    assert endpoint.for_client_on("node-a") == "unix-abstract:saguaro-draft-1"
    assert endpoint.for_client_on("node-b") == "10.0.0.5:4000"
    assert DraftEndpoint("node-a", "10.0.0.5:4000", None).for_client_on("node-a") == "10.0.0.5:4000"


def test_binds_the_node_address_under_ray(ray_cluster):
    import ray
    host = default_bind_host()
    assert host == ray.util.get_node_ip_address() and host != "0.0.0.0"


def test_jit_drafts_on_the_stream_are_answered_in_band_and_leave_it_up(served):
    """On the stream a JIT is answered with its call id, its tree follows, and a refused one (unknown
    sequence, a round the draft is not at, a malformed request) gets its status without ending the
    stream: the outcome sent after it is still observed."""
    stream = StreamClient(served.stub)
    _prefill(served.stub, 1, sampling=TOP_K)
    stream.jit(7, [JitDraftRequest(1, 0, 0, 9)])
    answer = stream.answer()
    (proposal,) = codec.proposal_batch_from_proto(answer.proposals)
    assert answer.call_id == 7 and proposal.tokens.tolist() == toy_tokens([5, 6, 9])
    assert stream.get()[0].round == 0  # the tree that follows the JIT, on this stream
    stream.jit(8, [JitDraftRequest(42, 0, 0, 9)])
    stream.jit(9, [JitDraftRequest(1, 5, 0, 9)])
    stream.requests.put(pb.SpeculateRequest(jit_draft=pb.JitDraftCall(call_id=10)))  # no batch
    codes = {a.call_id: a.error.code for a in (stream.answer() for _ in range(3))}
    assert codes == {8: grpc.StatusCode.NOT_FOUND.value[0], 9: grpc.StatusCode.FAILED_PRECONDITION.value[0],
                     10: grpc.StatusCode.INVALID_ARGUMENT.value[0]}
    stream.send([Outcome(1, 0, 0, 3, [1, 2, 3])])
    assert stream.get()[0].round == 1
    stream.requests.put(pb.SpeculateRequest(releases=codec.release_batch_to_proto([Release(1)])))
    stream.jit(11, [JitDraftRequest(1, 2, 0, 9)])  # behind the release on the same stream
    assert stream.answer().error.code == grpc.StatusCode.NOT_FOUND.value[0]
    stream.close()


def test_tree_batches_are_split_under_the_size_limit_and_an_oversized_tree_is_dropped():
    from saguaro_dist.distributed.draft_service import DraftServicer
    from saguaro_dist.engine.messages import Proposal, SpeculationTree

    def tree(seq_id: int, vocab: int) -> SpeculationTree:  # one dense [K, vocab] q: ~4 * K * vocab bytes
        return SpeculationTree.from_rows(seq_id, 0, [(0, 1, Proposal(torch.arange(K), torch.full((K, vocab), 1.0 / vocab)))])
    servicer = DraftServicer(worker=None, max_message_bytes=4 * K * 300)
    replies = servicer._encode_trees([tree(1, 100), tree(2, 100), tree(3, 1000), tree(4, 100), tree(5, 100)])
    assert [[t.seq_id for t in r.trees.trees] for r in replies] == [[1, 2], [4, 5]]  # 3 is over the limit alone
    assert all(r.ByteSize() <= servicer.max_message_bytes for r in replies)


def test_the_service_loop_polls_for_spin_s_after_a_message_then_idles():
    """draft_spin_s: after each message the loop keeps polling (a self-rescheduling callback) instead of
    blocking, so its vCPU does not halt between rounds; after spin_s it stops and the loop blocks."""
    import asyncio
    from saguaro_dist.distributed.draft_service import DraftServicer

    async def run():
        servicer, calls = DraftServicer(worker=None), []
        spin = servicer._spin
        servicer._spin = lambda: (calls.append(time.perf_counter()), spin())
        # Counts, not rates: each poll yields the CPU, and on a loaded box (CI's 2 cores under xdist) a
        # yield can cost a whole time slice: 20 ms once held only 10 polls.
        servicer.spin_s = 0.2
        servicer._keep_polling()
        await asyncio.sleep(0.1)
        assert len(calls) > 2                        # polling again and again while the spin lasts
        await asyncio.sleep(0.3)                     # the spin ends at 0.2 s; a loaded box's slice late, at most
        stopped = len(calls)
        await asyncio.sleep(0.1)
        assert len(calls) == stopped and calls[-1] - calls[0] < 0.45  # then no more callbacks: it blocks
        servicer.spin_s, calls[:] = 0.0, []
        servicer._keep_polling()
        await asyncio.sleep(0.02)
        assert calls == []                           # 0 turns the spin off
    asyncio.run(run())


def test_the_loop_spins_only_after_requests_the_target_follows_up_within_a_round(monkeypatch):
    """Outcomes and just-in-time drafts: the target's next request comes within a round, so the loop
    spins. A release (or a catch-up) may be followed by nothing for long: a spin there only took a vCPU
    from the target's verify."""
    from saguaro_dist.distributed.draft_service import DraftServicer
    spins = []
    monkeypatch.setattr(DraftServicer, "_keep_polling", lambda self: spins.append(1))
    served = Served()
    try:
        stream = StreamClient(served.stub)
        _prefill(served.stub, 1)
        _prefill(served.stub, 2)
        stream.requests.put(pb.SpeculateRequest(releases=codec.release_batch_to_proto([Release(2)])))
        stream.send([Outcome(1, 0, 0, 3, [1, 2, 3])])  # behind the release on the stream
        assert stream.get()[0].round == 1 and _soon(lambda: len(spins) == 1)  # the spin follows the last reply
        stream.jit(7, [JitDraftRequest(1, 2, 0, 9)])
        assert stream.answer().call_id == 7 and stream.get()[0].round == 2 and _soon(lambda: len(spins) == 2)
        time.sleep(0.05)
        assert len(spins) == 2
        stream.close()
    finally:
        served.close()


def _soon(check, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
