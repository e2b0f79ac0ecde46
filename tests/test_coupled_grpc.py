"""Coupled bonus draws over gRPC (spec/coupled.py; the one-host path is in tests/test_coupled_plans.py): a
coupled tree's plan carries the draft's guess across the codec bit for bit, the DraftService pushes it even
with plans otherwise unannounced, and the target side's wait_plans (GrpcDraftBackend, DraftPool) finds it
and keeps it for the tree. The exactness of the whole path on Ray is in tests/test_distributed_sampling.py."""
from __future__ import annotations

import time

import pytest
import torch

from engine_helpers import llama_config, save_model
from saguaro_dist.config import Config
from saguaro_dist.distributed import codec
from saguaro_dist.distributed.draft_pool import DraftPool
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest, TreePlan

pytestmark = pytest.mark.timeout(120)
K, VOCAB = 3, 64
SAMPLED = DraftSampling(0.8, 0, 1.0, 7)
GREEDY = DraftSampling(0.0, 0, 1.0, None)


def _wire(msg):
    """Through real bytes, as on the network."""
    return type(msg).FromString(msg.SerializeToString())


def _guess(positions: int = K + 1, kept: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(positions, VOCAB, generator=g), -1)
    top = probs.topk(kept, dim=-1)  # the draft's order: likeliest first, not by id
    return top.indices, top.values / top.values.sum(-1, keepdim=True)


def _assert_plans_equal(a: TreePlan, b: TreePlan) -> None:
    assert (a.seq_id, a.round, a.accepted, a.bonus_tokens) == (b.seq_id, b.round, b.accepted, b.bonus_tokens)
    assert b.guess_ids.dtype == torch.int64 and torch.equal(a.guess_ids, b.guess_ids)
    assert b.guess_probs.dtype == a.guess_probs.dtype
    assert torch.equal(a.guess_probs.view(torch.int32), b.guess_probs.view(torch.int32))  # bit for bit


# ---- the codec ------------------------------------------------------------------------------------
def test_a_plan_with_a_guess_round_trips_exactly():
    ids, probs = _guess()
    plans = [TreePlan(1, 4, [0, 0, 3], [ids[0, 2].item(), ids[0, 0].item(), ids[3, 1].item()], ids, probs),
             TreePlan(2, 0, [1], [9])]  # no guess: top-F, as before
    back = codec.plan_batch_from_proto(_wire(codec.plan_batch_to_proto(plans)))
    _assert_plans_equal(plans[0], back[0])
    assert back[1] == plans[1] and back[1].guess_ids is None and back[1].guess_probs is None
    msg = codec.plan_to_proto(plans[0])
    assert msg.guess_ids.dtype == pb.Tensor.INT32  # token ids as int32 on the wire, as a proposal's


def test_a_tree_without_k_equal_to_k_and_an_empty_guess_row_round_trip():
    ids, probs = _guess(positions=K)
    probs[1] = 0.0  # q_k held only x_k: no candidate can be drawn there
    plan = TreePlan(3, 2, [0], [ids[0, 0].item()], ids, probs)
    _assert_plans_equal(plan, codec.plan_from_proto(_wire(codec.plan_to_proto(plan))))


@pytest.mark.parametrize("ids, probs", [
    (torch.zeros(4, 5, dtype=torch.int64), None),                        # ids without probs
    (None, torch.zeros(4, 5)),                                           # probs without ids
    (torch.zeros(4, 5, dtype=torch.int64), torch.zeros(4, 6)),           # shapes differ
    (torch.zeros(5, dtype=torch.int64), torch.zeros(5)),                 # not [P, M]
], ids=["ids_only", "probs_only", "shapes_differ", "one_dimensional"])
def test_a_malformed_guess_is_not_sent(ids, probs):
    with pytest.raises(codec.CodecError):
        codec.plan_to_proto(TreePlan(1, 0, [0], [1], ids, probs))


def _tensor(values, dtype) -> pb.Tensor:
    return codec.tensor_to_proto(torch.tensor(values, dtype=dtype))


_IDS, _PROBS = [[1, 2], [3, 4]], [[0.5, 0.5], [1.0, 0.0]]


@pytest.mark.parametrize("ids, probs", [
    (_tensor(_IDS, torch.int32), None),                                       # ids without probs
    (None, _tensor(_PROBS, torch.float32)),                                   # probs without ids
    (_tensor([[1, 2, 3], [3, 4, 5]], torch.int32), _tensor(_PROBS, torch.float32)),  # shapes differ
    (_tensor([1, 2], torch.int32), _tensor([0.5, 0.5], torch.float32)),      # 1-D
    (_tensor([[[1, 2]]], torch.int32), _tensor([[[0.5, 0.5]]], torch.float32)),  # 3-D
    (_tensor([[1, -2], [3, 4]], torch.int32), _tensor(_PROBS, torch.float32)),  # a negative token id
    (_tensor(_PROBS, torch.float32), _tensor(_PROBS, torch.float32)),         # float ids
    (_tensor(_IDS, torch.int32), _tensor(_IDS, torch.int64)),                 # integer probs
    (_tensor(_IDS, torch.int32), _tensor([[0.5, -0.5], [1.0, 0.0]], torch.float32)),  # negative mass
    (_tensor(_IDS, torch.int32), _tensor([[0.5, float("nan")], [1.0, 0.0]], torch.float32)),  # not a number
    (_tensor(_IDS, torch.int32), _tensor([[0.5, float("inf")], [1.0, 0.0]], torch.float32)),  # infinite
    (_tensor(_IDS, torch.int32), pb.Tensor(dtype=pb.Tensor.FLOAT32, shape=[2, 2], data=b"\0" * 12)),  # short data
], ids=["ids_only", "probs_only", "shapes_differ", "one_dimensional", "three_dimensional", "negative_id",
        "float_ids", "integer_probs", "negative_probs", "nan_probs", "inf_probs", "short_data"])
def test_a_malformed_guess_is_refused_at_the_edge(ids, probs):
    msg = pb.TreePlan(seq_id=1, round=0, accepted=[0], bonus_tokens=[1])
    if ids is not None:
        msg.guess_ids.CopyFrom(ids)
    if probs is not None:
        msg.guess_probs.CopyFrom(probs)
    with pytest.raises(codec.CodecError):
        codec.plan_from_proto(_wire(msg))


# ---- a real DraftService on loopback ----------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("coupled_grpc_draft")
    save_model(path, llama_config(vocab=VOCAB, hidden=32, layers=2), seed=5)
    return str(path)


def _served(draft_dir, bonus_draw: str = "coupled"):
    """A real DraftWorker behind a DraftService (plans not announced: the default), and the plans it made."""
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=8, bonus_draw=bonus_draw))
    made, plan_trees = [], worker.plan_trees

    def recorded() -> list[TreePlan]:
        plans = plan_trees()
        made.extend(plans)
        return plans
    worker.plan_trees = recorded
    server, port = serve_draft(worker, "127.0.0.1", 0)
    return server, f"127.0.0.1:{port}", made


@pytest.fixture
def served(draft_dir):
    server, address, made = _served(draft_dir)
    backend = GrpcDraftBackend([address], deadline_s=10.0)
    yield backend, made
    backend.close()
    server.stop(None)


def _start(backend, sampling: dict[int, DraftSampling]) -> None:
    backend.prefill([PrefillRequest(sid, [5, 6, 7, 8 + sid], s) for sid, s in sampling.items()])
    backend.jit_draft([JitDraftRequest(sid, 0, 0, 7) for sid in sampling])


def test_a_coupled_plan_crosses_grpc_unannounced_and_stays_for_its_tree(served):
    backend, made = served
    _start(backend, {0: SAMPLED, 1: GREEDY})
    plans = backend.wait_plans([(0, 0), (1, 0)], 10.0)
    assert list(plans) == [0]  # the greedy row keeps top-F: its tree came unannounced, and settles it
    sent = [p for p in made if p.seq_id == 0]
    assert len(sent) == 1 and sent[0].guess_ids is not None
    _assert_plans_equal(sent[0], plans[0])
    assert plans[0].guess_ids.shape == (K + 1, VOCAB)  # M = min(GUESS_TOP, V)
    again = backend.wait_plans([(0, 0)], 0.0)  # kept: wait_trees settles the round
    _assert_plans_equal(sent[0], again[0])
    tree = backend.wait_trees([(0, 0)], 10.0, {0: (plans[0].accepted[0], plans[0].bonus_tokens[0])})[0]
    assert tree.keys() == list(zip(plans[0].accepted, plans[0].bonus_tokens))
    assert backend.wait_plans([(0, 0)], 0.0) == {}  # settled with its tree


def test_wait_plans_waits_only_for_what_can_come(served):
    backend, _ = served
    _start(backend, {0: SAMPLED})
    # "At once" is under half the 5 s a wrong wait would take: room for a loaded CI box to stall.
    start = time.monotonic()
    assert backend.wait_plans([(7, 0)], 5.0) == {}  # never prefilled here: not waited for
    assert time.monotonic() - start < 2.5
    start = time.monotonic()
    assert backend.wait_plans([(0, 5)], 0.3) == {}  # a round that never comes: to the deadline
    assert 0.25 <= time.monotonic() - start < 2.5
    backend._out_of_sync.add(0)  # as after a lost stream: nothing of its will come
    start = time.monotonic()
    assert backend.wait_plans([(0, 5)], 5.0) == {}
    assert time.monotonic() - start < 2.5
    backend.close()
    start = time.monotonic()
    assert backend.wait_plans([(0, 6)], 5.0) == {}  # closed: no waiting
    assert time.monotonic() - start < 2.5


def test_a_top_f_server_pushes_no_plan_while_the_target_does_not_wait(draft_dir):
    server, address, _ = _served(draft_dir, bonus_draw="top_f")
    backend = GrpcDraftBackend([address], deadline_s=10.0)
    try:
        _start(backend, {0: SAMPLED})
        assert backend.wait_plans([(0, 0)], 10.0) == {} and backend.wait_trees([(0, 0)], 10.0)
        assert not backend._plans
    finally:
        backend.close()
        server.stop(None)


def test_the_draft_pool_asks_each_sequences_worker_and_skips_split_sequences(draft_dir):
    served = [_served(draft_dir) for _ in range(2)]
    pool = DraftPool([GrpcDraftBackend([address], deadline_s=10.0) for _, address, _ in served], max_batch_size=4)
    split = DraftPool([GrpcDraftBackend([address], deadline_s=10.0) for _, address, _ in served], max_batch_size=1)
    try:
        _start(pool, {0: SAMPLED, 1: SAMPLED})
        assert sorted(len(pool.groups[s]) for s in (0, 1)) == [1, 1] and pool.groups[0] != pool.groups[1]
        plans = pool.wait_plans([(0, 0), (1, 0), (9, 0)], 10.0)
        assert sorted(plans) == [0, 1]
        for sid, plan in plans.items():
            made = served[pool.groups[sid][0]][2]
            _assert_plans_equal(next(p for p in made if p.seq_id == sid), plan)
        _start(split, {2: SAMPLED})  # the only sequence: a shard on each worker, so no coupling
        assert len(split.groups[2]) == 2
        start = time.monotonic()
        assert split.wait_plans([(2, 0)], 5.0) == {}
        assert time.monotonic() - start < 2.5  # not waited for: under half the 5 s (room for a loaded box)
        assert all(p.guess_ids is None for _, _, made in served for p in made if p.seq_id == 2)
    finally:
        pool.close()
        split.close()
        for server, _, _ in served:
            server.stop(None)
