"""Lives of a sequence on the draft side: a re-prefill restarts its rounds at 0, so a tree (or plan) of its
earlier life carries the same (seq_id, round) as the new life's. Each PrefillRequest is a new life with its own
generation, which the draft stamps on the life's trees and plans; the target drops another life's, whatever
order they arrive in. Over real gRPC on loopback with a real draft worker, and on the in-process inbox. Also
a key a second worker repeats: a pool worker taken back under its index."""
from __future__ import annotations

import threading

import pytest
import torch

from engine_helpers import PROMPTS, close_pair, wait_for
from saguaro_dist.config import Config
from saguaro_dist.distributed import codec
from saguaro_dist.distributed.draft_pool import DraftPool
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.errors import DraftUnavailable
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.draft_backend import TreeInbox
from saguaro_dist.engine.messages import (
    DraftSampling, JitDraftRequest, PrefillRequest, Proposal, SpeculationTree, TreePlan,
)

pytestmark = pytest.mark.timeout(180)
GREEDY = DraftSampling(0.0, 0, 1.0, None)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    pair = close_pair(tmp_path_factory.mktemp("tree_generations_pair"))
    return Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6, draft_threads=1)


def _late_reader(backend: GrpcDraftBackend):
    """Make the backend's stream reader late with the first tree batch it reads: it holds the batch until
    `go` is set, then stores it and sets `stored`. (A reader thread that lost the GIL or its CPU between
    reading a pushed tree and storing it, while the engine's thread re-prefilled the sequence.)"""
    held, go, stored = threading.Event(), threading.Event(), threading.Event()
    store = backend._store

    def late_store(link, msg):
        late = msg.WhichOneof("kind") == "trees" and not held.is_set()
        if late:
            held.set()
            go.wait(30)
        store(link, msg)
        if late:
            stored.set()
    backend._store = late_store  # the reader looks it up for every message
    return held, go, stored


def test_a_tree_pushed_before_a_re_prefill_and_read_after_it_is_dropped(config):
    """The server pushes round 0's tree of the sequence's first life; the target's reader reads it only after
    the re-prefill has returned (its drop of the earlier life's trees already done). The new life's round 0
    must not take it: the tree's generation names the earlier life. The new life's own tree still lands."""
    server, port = serve_draft(build_draft_worker(config), "127.0.0.1", 0)
    backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)
    held, go, stored = _late_reader(backend)
    try:
        backend.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        backend.jit_draft([JitDraftRequest(1, 0, 0, 5)])  # the server builds round 0's tree and pushes it
        wait_for(held.is_set)  # read off the stream, not stored yet
        again = PrefillRequest(1, PROMPTS[0] + [5, 3, 7], GREEDY, prompt_len=len(PROMPTS[0]))
        backend.prefill([again])
        go.set()
        wait_for(stored.is_set)
        assert backend.wait_trees([(1, 0)], 0.0) == {}, "the earlier life's tree answered the new life's round 0"
        backend.jit_draft([JitDraftRequest(1, 0, 0, 8)])
        tree = backend.wait_trees([(1, 0)], 30.0)[1]
        assert tree.generation == again.generation
    finally:
        go.set()
        backend.close()
        server.stop(None)


def test_a_worker_taken_back_starts_its_late_tree_count_afresh(config):
    """Another key a second life repeats: the pool's worker index. A worker with one late tree wait is marked
    dead by a missed draft deadline and taken back (a new backend under the same index). Its count of late
    waits was the old backend's: kept, the first late wait of the new one marked it dead again."""
    slow = build_draft_worker(config)
    resume = threading.Event()
    drafting = slow.jit_draft
    slow.jit_draft = lambda reqs: resume.wait(30) and drafting(reqs)
    server, port = serve_draft(slow, "127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    revive = lambda i: GrpcDraftBackend([address], deadline_s=10.0)  # noqa: E731 - it answers where it was
    pool = DraftPool([GrpcDraftBackend([address], deadline_s=0.5)], max_batch_size=4, revive=revive)
    try:
        pool.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        assert pool.wait_trees([(1, 0)], 0.05) == {} and pool.late_waits == [1]  # no tree was asked for
        with pytest.raises(DraftUnavailable):
            pool.jit_draft([JitDraftRequest(1, 0, 0, 5)])  # the deadline passes: marked dead
        resume.set()
        wait_for(lambda: pool.accepting() and pool.workers() == (1, 1))
        pool.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        assert pool.wait_trees([(1, 0)], 0.05) == {}
        assert pool.workers() == (1, 1), "one late wait marked the worker taken back dead"
    finally:
        resume.set()
        pool.close()
        server.stop(None)


def _tree(seq_id: int, round: int, generation: int) -> SpeculationTree:
    return SpeculationTree(seq_id, round, [0], [5], Proposal(torch.tensor([[1, 2, 3]]), None), generation=generation)


def test_the_inbox_drops_what_another_life_sends_after_the_prefill():
    """The one-host inbox (in-process and pipe drafts): a tree or plan of the earlier life put after the new
    life began is dropped; the new life's are kept, and so are those that carry no life (0: a draft that keeps
    none) and those of sequences without a life here."""
    inbox = TreeInbox()
    first, second = PrefillRequest(1, [5], GREEDY), PrefillRequest(1, [5, 6], GREEDY)
    inbox.begin([first])
    inbox.put([_tree(1, 0, first.generation)])
    inbox.begin([second])
    assert inbox.take([(1, 0)], 0.0) == {}  # what was here of the earlier life went at the new life's begin
    inbox.put([_tree(1, 0, first.generation)])
    inbox.put_plans([TreePlan(1, 0, [0], [5], generation=first.generation)])
    assert inbox.plans([(1, 0)], 0.0) == {} and inbox.take([(1, 0)], 0.0) == {}
    inbox.put_plans([TreePlan(1, 0, [0], [5], generation=second.generation)])
    assert set(inbox.plans([(1, 0)], 0.0)) == {1}
    inbox.put([_tree(1, 0, second.generation), _tree(2, 0, 0)])
    inbox.put([_tree(1, 1, 0)])
    assert set(inbox.take([(1, 0), (2, 0)], 0.0)) == {1, 2}
    assert set(inbox.take([(1, 1)], 0.0)) == {1}


def test_every_prefill_request_is_a_new_life():
    a, b = PrefillRequest(1, [5], GREEDY), PrefillRequest(1, [5], GREEDY)
    assert 0 < a.generation != b.generation
    assert PrefillRequest(1, [5], GREEDY, generation=a.generation).generation == a.generation


def test_the_generation_survives_the_codec():
    prefill = PrefillRequest(3, [1, 2, 3], GREEDY, 1, 2, prompt_len=2)
    assert codec.prefill_from_proto(codec.prefill_to_proto(prefill)) == prefill
    tree = codec.tree_from_proto(codec.tree_to_proto(_tree(3, 4, prefill.generation)))
    assert (tree.seq_id, tree.round, tree.generation) == (3, 4, prefill.generation)
    assert codec.tree_from_proto(codec.tree_to_proto(SpeculationTree(3, 4, generation=2**64 - 1))).generation == 2**64 - 1
    plan = codec.plan_from_proto(codec.plan_to_proto(TreePlan(3, 4, [0], [5], generation=prefill.generation)))
    assert (plan.seq_id, plan.round, plan.generation) == (3, 4, prefill.generation)
    concat = SpeculationTree.concat([_tree(3, 4, 9), _tree(3, 4, 9)])
    assert concat.generation == 9 and concat.num_branches == 2
