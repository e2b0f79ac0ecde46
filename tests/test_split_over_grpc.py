"""The split draft on Ray's side: just-in-time drafts on a local copy, trees from a DraftService over
real gRPC on loopback (a real DraftWorker on a checkpoint written by transformers behind it)."""
from __future__ import annotations

import time

import pytest

from engine_helpers import PROMPTS, close_pair
from saguaro_dist.config import Config
from saguaro_dist.distributed.draft_pool import DraftPool
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.errors import DraftUnavailable
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest, Release
from saguaro_dist.engine.split_draft import SplitDraftBackend

pytestmark = pytest.mark.timeout(120)
GREEDY = DraftSampling(0.0, 0, 1.0, None)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    pair = close_pair(tmp_path_factory.mktemp("split_grpc_pair"))
    return Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6)


@pytest.fixture
def served(config):
    """(split over one served draft, a local draft that sees every round, the server)."""
    server, port = serve_draft(build_draft_worker(config), "127.0.0.1", 0)
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)], max_batch_size=4)
    split = SplitDraftBackend(LocalDraftBackend(build_draft_worker(config)), pool)
    seen_all = LocalDraftBackend(build_draft_worker(config))
    prefill = [PrefillRequest(1, PROMPTS[0], GREEDY)]
    split.prefill(prefill)
    seen_all.prefill(prefill)
    yield split, seen_all, server
    split.close()
    seen_all.close()
    server.stop(None)


def _draft_both(split, seen_all, reqs) -> None:
    assert split.jit_draft(reqs)[0].tokens.tolist() == seen_all.jit_draft(reqs)[0].tokens.tolist()


def test_rounds_without_trees_go_to_the_pool_as_one_catch_up_before_the_next_that_wants_one(served):
    split, seen_all, _ = served
    outbox = lambda: split.trees.backends[0]._links[0].outbox  # noqa: E731 (re-read: a reopened stream has a new one)
    queued = outbox().queued
    bonus = 5
    for r in range(6):
        _draft_both(split, seen_all, [JitDraftRequest(1, r, r % 3, bonus, skip_tree=True)])
        bonus = (bonus * 7 + 3) % 64
    assert outbox().queued == queued  # drafted here, nothing sent: the draft actor's core left alone
    _draft_both(split, seen_all, [JitDraftRequest(1, 6, 1, bonus)])
    split.send_outcomes([])
    seen_all.send_outcomes([])
    assert outbox().queued == queued + 2  # one catch_up with the six rounds, then this round's outcome
    got, want = split.wait_trees([(1, 6)], 30.0)[1], seen_all.wait_trees([(1, 6)], 30.0)[1]
    assert got.proposals.tokens.tolist() == want.proposals.tokens.tolist()
    assert (got.accepted, got.bonus_tokens) == (want.accepted, want.bonus_tokens)


def test_a_dead_draft_server_makes_its_sequences_lost_so_the_engine_prefills_them_again(served):
    split, seen_all, server = served
    _draft_both(split, seen_all, [JitDraftRequest(1, 0, 0, 5)])
    assert split.trees.lost([1]) == []
    server.stop(None).wait()
    deadline = time.monotonic() + 10.0
    while not split.trees.lost([1]) and time.monotonic() < deadline:  # the stream's reader finds it dead
        time.sleep(0.01)
    with pytest.raises(DraftUnavailable) as info:  # the local copy could draft, but the pool no longer follows
        split.jit_draft([JitDraftRequest(1, 1, 0, 5, skip_tree=True)])
    assert info.value.seq_ids == [1]
