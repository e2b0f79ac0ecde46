"""The split draft on Ray's side: just-in-time drafts on a local copy, trees from a DraftService over
real gRPC on loopback (a real DraftWorker on a checkpoint written by transformers behind it)."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest

from engine_helpers import PROMPTS, close_pair, wait_for
from saguaro_dist.config import Config
from saguaro_dist.distributed.draft_pool import LATE_TREE_WAITS_BEFORE_DEAD, DraftPool, revival_delay_s
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.errors import DraftUnavailable
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
from saguaro_dist.engine.split_draft import SplitDraftBackend

pytestmark = pytest.mark.timeout(120)
GREEDY = DraftSampling(0.0, 0, 1.0, None)
SAMPLED = DraftSampling(0.8, 0, 1.0, 7)


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


def test_without_a_live_worker_the_copy_drafts_alone_then_the_revived_worker_builds_the_trees(config):
    """The pool's only server dies: a re-prefill leaves the sequence to the local copy, which drafts
    (SD's rounds, no fast backup); once the pool revives the worker (at a new address, as Ray restarts
    an actor), the sequence is lost again, prefilled on both halves, and its trees come from the new one."""
    first, port = serve_draft(build_draft_worker(config), "127.0.0.1", 0)
    comeback = {}
    revived = threading.Event()

    def revive(i: int) -> GrpcDraftBackend:
        assert revived.wait(60), "the test never revived the worker"
        comeback["server"], new_port = serve_draft(build_draft_worker(config), "127.0.0.1", 0)
        return GrpcDraftBackend([f"127.0.0.1:{new_port}"], deadline_s=10.0)

    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)], max_batch_size=4, revive=revive)
    split = SplitDraftBackend(LocalDraftBackend(build_draft_worker(config)), pool)
    tokens = PROMPTS[0] + [5, 9]
    again = [PrefillRequest(1, tokens[:-1], GREEDY, prompt_len=len(PROMPTS[0]))]
    try:
        split.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        first.stop(None).wait()
        wait_for(lambda: split.trees.lost([1]))
        with pytest.raises(DraftUnavailable):
            split.jit_draft([JitDraftRequest(1, 1, 0, 5, skip_tree=True)])
        split.prefill(again)  # the engine's re-prefill: no live worker, so the local copy holds it alone
        assert not split.trees.accepting() and split.workers() == (0, 1)
        seen_all = LocalDraftBackend(build_draft_worker(config))
        seen_all.prefill(again)
        for r, bonus in enumerate((tokens[-1], 11, 3)):  # drafted here, rounds with and without a tree wanted
            _draft_both(split, seen_all, [JitDraftRequest(1, r, r % 2, bonus, skip_tree=r == 1)])
            split.send_outcomes([])
            seen_all.send_outcomes([])
        assert split.wait_trees([(1, 2)], 0.5) == {}  # no tree side holds it: nothing to wait for
        revived.set()
        wait_for(split.trees.accepting)
        assert split.workers() == (1, 1)
        with pytest.raises(DraftUnavailable) as info:  # the tree side takes sequences again: rejoin it
            split.jit_draft([JitDraftRequest(1, 3, 0, 7)])
        assert info.value.seq_ids == [1]
        split.prefill(again)
        seen_all.close()
        seen_all = LocalDraftBackend(build_draft_worker(config))  # fresh as the revived worker (its fan-out statistics)
        seen_all.prefill(again)
        assert split.trees.lost([1]) == []
        _draft_both(split, seen_all, [JitDraftRequest(1, 0, 0, tokens[-1])])
        split.send_outcomes([])
        seen_all.send_outcomes([])
        got, want = split.wait_trees([(1, 0)], 30.0)[1], seen_all.wait_trees([(1, 0)], 30.0)[1]
        assert got.proposals.tokens.tolist() == want.proposals.tokens.tolist()
        seen_all.close()
    finally:
        split.close()
        if "server" in comeback:
            comeback["server"].stop(None)


def test_a_worker_that_only_missed_a_deadline_is_taken_back_without_what_it_held(config):
    """A draft worker too slow for the deadline is marked dead, though its process lives on (on Ray the
    actor then answers at its old address). The pool takes it back once it answers: having released there
    the sequences it held (they moved on), so it holds only what the engine prefills on it again."""
    worker = build_draft_worker(config)
    resume = threading.Event()
    drafting = worker.jit_draft
    worker.jit_draft = lambda reqs: resume.wait(30) and drafting(reqs)  # a stall: the server's loop stops in it
    server, port = serve_draft(worker, "127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    revive = lambda i: GrpcDraftBackend([address], deadline_s=10.0)  # noqa: E731 - it answers where it was
    pool = DraftPool([GrpcDraftBackend([address], deadline_s=0.5)], max_batch_size=4, revive=revive)
    try:
        pool.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        assert 1 in worker.seqs
        with pytest.raises(DraftUnavailable):  # no answer within the deadline
            pool.jit_draft([JitDraftRequest(1, 0, 0, 5)])
        assert pool.workers() == (0, 1)
        resume.set()  # the stall ends
        wait_for(pool.accepting)
        assert pool.workers() == (1, 1) and pool.revivals == [1]
        assert 1 not in worker.seqs and pool.lost([1]) == [1]  # released there: the engine prefills it again
        pool.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        fresh = LocalDraftBackend(build_draft_worker(config))
        fresh.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        reqs = [JitDraftRequest(1, 0, 0, 5, skip_tree=True)]
        assert pool.jit_draft(reqs)[0].tokens.tolist() == fresh.jit_draft(reqs)[0].tokens.tolist()
        fresh.close()
    finally:
        resume.set()
        pool.close()
        server.stop(None)


def test_the_pool_backs_off_from_a_worker_it_keeps_taking_back():
    assert [revival_delay_s(n) for n in range(8)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


@contextlib.contextmanager
def _stalled_tree_side(config, sampling: DraftSampling):
    """(split, pool, resume): sequence 1 drafted here in time for round 0, while the served worker, which is to
    build its tree, stalls in plan_trees (its server's loop stops in it) until resume is set."""
    worker = build_draft_worker(config)
    resume = threading.Event()
    planning = worker.plan_trees
    worker.plan_trees = lambda: resume.wait(30) and planning()
    server, port = serve_draft(worker, "127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    revive = lambda i: GrpcDraftBackend([address], deadline_s=10.0)  # noqa: E731 - it answers where it was
    pool = DraftPool([GrpcDraftBackend([address], deadline_s=10.0)], max_batch_size=4, revive=revive)
    split = SplitDraftBackend(LocalDraftBackend(build_draft_worker(config)), pool)
    try:
        split.prefill([PrefillRequest(1, PROMPTS[0], sampling)])
        split.jit_draft([JitDraftRequest(1, 0, 0, 5)])  # drafted here, in time
        split.send_outcomes([])
        yield split, pool, resume
        assert 1 not in worker.seqs  # taken back: released there, the engine prefills it again
    finally:
        resume.set()
        split.close()
        server.stop(None)


def _marked_dead_then_taken_back(split, pool, resume) -> None:
    assert pool.workers() == (0, 1) and split.trees.lost([1]) == [1]
    assert split.wait_trees([(1, 0)], 5.0) == {}  # a dead worker's trees are not waited for
    with pytest.raises(DraftUnavailable):  # the engine prefills it again: here alone, until the worker is back
        split.jit_draft([JitDraftRequest(1, 1, 0, 5)])
    resume.set()  # the stall ends
    wait_for(pool.accepting)
    assert pool.workers() == (1, 1) and pool.revivals == [1]


def test_a_worker_whose_trees_stay_late_is_marked_dead_and_taken_back(config):
    """The split's just-in-time drafts are made here, so a stalled tree side misses no draft deadline: only
    its trees are late. After LATE_TREE_WAITS_BEFORE_DEAD waits in a row that each reach the timeout with no
    tree, the pool marks it dead (not every later round pays the timeout); once it answers, it is taken back."""
    with _stalled_tree_side(config, GREEDY) as (split, pool, resume):
        for late in range(LATE_TREE_WAITS_BEFORE_DEAD):
            assert pool.workers() == (1, 1)
            assert split.wait_trees([(1, 0)], 0.2) == {}
        _marked_dead_then_taken_back(split, pool, resume)


def test_a_sampled_round_whose_plans_stay_late_waits_one_timeout_and_counts_once(config):
    """A sampled row waits for its tree's plan after the verify (coupled bonus draws), then for the tree. A
    stalled worker's plan wait that runs out counts as its late wait, and the same round's tree wait takes what
    is there instead of a second whole timeout: one timeout a round, and dead after as many rounds as trees."""
    with _stalled_tree_side(config, SAMPLED) as (split, pool, resume):
        for late in range(LATE_TREE_WAITS_BEFORE_DEAD):
            assert pool.workers() == (1, 1)
            assert split.wait_plans([(1, 0)], 1.0) == {}
            start = time.monotonic()
            assert split.wait_trees([(1, 0)], 5.0) == {}
            assert time.monotonic() - start < 2.5  # not a second timeout (5 s); half of it is room for a loaded box
        _marked_dead_then_taken_back(split, pool, resume)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_peer_built_on_another_vocabulary_costs_misses_never_tokens(config, tmp_path, caplog, temperature):
    """A draft actor started on another model (128 token ids against the target's 96): what it proposes
    does not fit what the target verifies (ids past its vocabulary, a q over 128). Each such speculation is
    refused (a miss, the fast backup, a fresh prefill), said once, and the output is still the target's;
    it used to fail the engine step of every request in flight."""
    from dataclasses import replace

    from engine_helpers import assert_greedy_equal, hf_greedy, llama_config, save_model
    from saguaro_dist.engine.build import eos_ids, make_runner
    from saguaro_dist.engine.engine import Engine
    from saguaro_dist.engine.sequence import Sequence
    from saguaro_dist.sampling_params import SamplingParams
    save_model(tmp_path / "other", llama_config(128, 32, 1), seed=9)
    other = replace(config, draft=str(tmp_path / "other"))
    server, port = serve_draft(build_draft_worker(other), "127.0.0.1", 0)
    mine = replace(config, tree_policy="always", fallback="neural")
    runner = make_runner(mine.model, mine)
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)], max_batch_size=4)  # as rank 0 holds it
    engine = Engine(mine, runner, pool, None, eos_ids(runner, None))
    params = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=3)
    seqs = [Sequence(i, str(i), prompt, params) for i, prompt in enumerate(PROMPTS[:2])]
    try:
        for s in seqs:
            engine.add(s)
        with caplog.at_level("ERROR", logger="saguaro_dist.engine.sd_loop"):
            while engine.has_work():
                engine.step()
    finally:
        engine.close()
        server.stop(None)
    assert all(len(s.output_token_ids) == 16 and max(s.output_token_ids) < 96 for s in seqs)
    assert sum("another model or config" in r.message for r in caplog.records) == 1  # said once, not every round
    if temperature == 0:
        from transformers import LlamaForCausalLM
        model = LlamaForCausalLM.from_pretrained(config.model)
        for s in seqs:
            assert_greedy_equal(s.output_token_ids, hf_greedy(model, s.prompt_token_ids, 16), s.prompt_token_ids, model)
