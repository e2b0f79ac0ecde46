"""Target -> draft messages of a sequence's earlier life: an Outcome, JitDraftRequest or Release built in one life and
delivered after the sequence's re-prefill (a unary Prefill overtaking the Speculate stream, a split draft's outcome
still unsent, a shard told of a draft after the fact). Each carries its life's generation (stamped by the target's
backend as it goes out), and the draft side drops it (a debug line), leaving the new life undisturbed: no
OutOfOrder, no second re-prefill, no release of the new life. Real DraftWorkers on checkpoints written by
transformers, over real gRPC on loopback, a real child process, and in this process."""
from __future__ import annotations

import logging

import pytest

from engine_helpers import PROMPTS, assert_greedy_equal, close_pair, hf_greedy, wait_for
from saguaro_dist.config import Config
from saguaro_dist.distributed.draft_pool import DraftPool
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.draft_backend import LocalDraftBackend, Lives
from saguaro_dist.engine.draft_process import DraftProcess, named_seq_ids
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Release
from saguaro_dist.engine.split_draft import SplitDraftBackend

pytestmark = pytest.mark.timeout(180)
GREEDY = DraftSampling(0.0, 0, 1.0, None)
AGAIN = PROMPTS[0] + [5, 3, 7]  # the sequence's tokens at its re-prefill: prompt, then earlier output


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("h1_stale_lives_pair"))


@pytest.fixture(scope="module")
def config(pair):
    return Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6, draft_threads=1)


def _again() -> PrefillRequest:
    return PrefillRequest(1, list(AGAIN), GREEDY, prompt_len=len(PROMPTS[0]))


class HeldBack:
    """The Speculate stream to one server held up in transit (a congested connection): what the backend queues on
    it meanwhile reaches the server only at release(), after any unary call made meanwhile (a re-prefill)."""

    def __init__(self, backend: GrpcDraftBackend):
        self.outbox, self.items, self.released = backend._links[0].outbox, [], False
        self._put = self.outbox.put
        self.outbox.put = self._hold

    def _hold(self, item) -> int:
        self.items.append(item)
        return 0  # counted as sent: the backend's hand-off wait returns at once

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        del self.outbox.put
        for item in self.items:
            self._put(item)


def _hit(tree) -> Outcome:
    """The outcome that hits the tree's first branch, naming its tokens (as the target sends a hit)."""
    k, t = tree.accepted[0], tree.bonus_tokens[0]
    return Outcome(tree.seq_id, tree.round, k, t, next_tokens=tree.proposal(0).tokens.tolist(), cache_hit=True)


def _earlier_life_logged(caplog) -> bool:
    return any("of an earlier life" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_late_messages_of_an_earlier_life_over_grpc_leave_the_new_life_be(config, caplog):
    """The backend sends life 1's outcome, next draft and release on the stream, which is held up; the re-prefill
    (unary) reaches the server first. Those three then arrive: the server drops them (the draft answered with no
    tokens), and life 2 drafts, gets its trees and goes on hitting them, its stream never failed."""
    caplog.set_level(logging.DEBUG, logger="saguaro_dist")
    worker = build_draft_worker(config)
    server, port = serve_draft(worker, "127.0.0.1", 0)
    backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=20.0)
    try:
        backend.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        first = backend.jit_draft([JitDraftRequest(1, 0, 0, 5)])[0]
        assert backend.wait_trees([(1, 0)], 30.0)
        held = HeldBack(backend)
        backend.send_outcomes([Outcome(1, 0, 1, 6, next_tokens=[9, 8, 7], target_proposed=True)])
        stale_draft = backend.start_jit_draft([JitDraftRequest(1, 1, 0, 4)])
        backend.release([Release(1)])
        again = _again()
        backend.prefill([again])  # overtakes them
        held.release()
        assert stale_draft.result()[0].tokens.numel() == 0, "a draft of the earlier life was drafted in the new one"
        assert len(first.tokens) == 3
        proposal = backend.jit_draft([JitDraftRequest(1, 0, 0, 8)])[0]  # life 2's first draft: no UnknownSequence
        assert worker.seqs[1].committed == AGAIN + [8]  # nothing of life 1 committed into it
        tree = backend.wait_trees([(1, 0)], 30.0)[1]
        assert tree.generation == again.generation and len(proposal.tokens) == 3
        backend.send_outcomes([_hit(tree)])  # the stale release did not mark it released: this one is observed
        assert backend.wait_trees([(1, 1)], 30.0)[1].generation == again.generation
        assert backend.lost([1]) == [] and not backend._out_of_sync  # no OutOfOrder ended the stream
        assert _earlier_life_logged(caplog)
    finally:
        backend.close()
        server.stop(None)


def test_late_messages_of_an_earlier_life_reach_neither_half_of_a_split_draft(config, caplog):
    """The split draft keeps a just-in-time draft's outcome until the round's outcomes go (it tells the child
    both in one message). Re-prefilled in between, that outcome of life 1 went with life 2's: the child committed
    the earlier life's tokens into the new one and built its tree for another round. And late messages of life 1
    that do reach the child (an outcome, a draft, a release) are dropped there: life 2 goes on."""
    caplog.set_level(logging.DEBUG, logger="saguaro_dist")
    split = SplitDraftBackend(LocalDraftBackend(build_draft_worker(config)), DraftProcess(config))
    try:
        life1 = PrefillRequest(1, PROMPTS[0], GREEDY)
        split.prefill([life1])
        split.jit_draft([JitDraftRequest(1, 0, 0, 5)])  # its outcome waits for the round's outcomes
        again = _again()
        split.prefill([again])
        split.jit_draft([JitDraftRequest(1, 0, 0, 8)])
        split.send_outcomes([])
        tree = split.wait_trees([(1, 0)], 30.0).get(1)
        assert tree is not None and tree.generation == again.generation, "life 2's round 0 got no tree"
        process = split.trees  # late arrivals of life 1 at the child
        process.send_outcomes([Outcome(1, 0, 0, 5, next_tokens=[9, 8, 7], generation=life1.generation)])
        assert process.start_jit_draft([JitDraftRequest(1, 1, 0, 4, generation=life1.generation)]).result()[0] \
            .tokens.numel() == 0
        process._post("release", [Release(1, generation=life1.generation)])
        split.send_outcomes([_hit(tree)])
        nxt = split.wait_trees([(1, 1)], 30.0).get(1)
        assert nxt is not None and nxt.generation == again.generation
        assert split.lost([1]) == []
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "failed" in r.getMessage()]
    finally:
        split.close()


def test_late_messages_of_an_earlier_life_in_process_leave_the_new_life_be(config, caplog):
    """The in-process worker (the thread executor's): an outcome, a draft and a release of life 1 after life 2's
    prefill change nothing of life 2; generation 0 (a peer that keeps no lives) is the current life's."""
    caplog.set_level(logging.DEBUG, logger="saguaro_dist.engine.draft_worker")
    worker = build_draft_worker(config)
    life1, again = PrefillRequest(1, PROMPTS[0], GREEDY), _again()
    worker.prefill([life1])
    worker.jit_draft([JitDraftRequest(1, 0, 0, 5)])
    worker.prefill([again])
    stale = life1.generation
    worker.observe([Outcome(1, 0, 0, 5, next_tokens=[9, 8, 7], generation=stale)])
    answers = worker.jit_draft([JitDraftRequest(1, 0, 0, 5, generation=stale), JitDraftRequest(1, 0, 0, 8)])
    assert answers[0].tokens.numel() == 0 and len(answers[1].tokens) == 3  # a batch of both: the current drafted
    worker.release([Release(1, generation=stale)])
    assert worker.seqs[1].committed == AGAIN + [8] and worker.lives.of(1) == again.generation
    assert _earlier_life_logged(caplog)
    worker.release([Release(1)])  # no life named: whatever life it is in
    assert 1 not in worker.seqs


def test_the_in_process_backend_stamps_what_goes_out_with_the_life_it_prefilled(config):
    backend = LocalDraftBackend(build_draft_worker(config))
    try:
        life = PrefillRequest(1, PROMPTS[0], GREEDY)
        backend.prefill([life])
        req, named = JitDraftRequest(1, 0, 0, 5), JitDraftRequest(1, 0, 0, 5, generation=3)
        stamped = backend.inbox.stamp([req, named])
        assert [r.generation for r in stamped] == [life.generation, 3]  # one already stamped keeps its life
        assert req.generation == 0  # a copy went out: the caller's message may go to another draft side as built
        assert len(backend.jit_draft([JitDraftRequest(1, 0, 0, 5)])[0].tokens) == 3
    finally:
        backend.close()


def test_lives_stamp_only_what_names_no_life():
    lives = Lives()
    prefill = PrefillRequest(1, [5], GREEDY)
    lives.begin([prefill])
    outcome, release, other = Outcome(1, 0, 0, 5, None), Release(1, generation=2), Release(9)
    stamped = lives.stamp([outcome, release, other])
    assert [m.generation for m in stamped] == [prefill.generation, 2, 0]
    assert stamped[0] == Outcome(1, 0, 0, 5, None, generation=prefill.generation) and outcome.generation == 0
    assert lives.stale(release) and not lives.stale(outcome) and not lives.stale(Release(1)) and not lives.stale(other)


def test_an_earlier_lifes_messages_move_no_child_off_the_new_lifes_tree():
    """The draft child stops a tree build once the messages read since name every sequence being built (the target
    moved on); a late message of an earlier life names none."""
    lives = Lives()
    prefill = PrefillRequest(1, [5], GREEDY)
    lives.begin([prefill])
    stale = [Outcome(1, 0, 0, 5, None, generation=prefill.generation + 1)]
    assert named_seq_ids(("post", "send_outcomes", stale), lives.stale) == set()
    assert named_seq_ids(("post", "catch_up", [stale]), lives.stale) == set()
    assert named_seq_ids(("post", "release", [Release(1, generation=prefill.generation)]), lives.stale) == {1}
    assert named_seq_ids(("post", "send_outcomes", stale)) == {1}  # no lives given: as before


def test_a_shard_told_of_an_earlier_lifes_draft_drops_it(config):
    """Cache-parallel: shard 0 drafts, and the pool tells shard 1 the tokens as an outcome once the draft is taken.
    Taken after the sequence's re-prefill, that outcome is of life 1 and reached shard 1 in life 2: the shards'
    copies of the sequence parted (shard 1 committed life 1's tokens), and their slices of one tree with them."""
    built = [build_draft_worker(config) for _ in range(2)]
    servers = [serve_draft(w, "127.0.0.1", 0) for w in built]
    pool = DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=20.0) for _, port in servers], max_batch_size=1)
    try:
        pool.prefill([PrefillRequest(1, PROMPTS[0], GREEDY)])
        assert len(pool.groups[1]) == 2  # one sequence on both workers: two shards
        pending = pool.start_jit_draft([JitDraftRequest(1, 0, 0, 5)])
        wait_for(lambda: not pool.backends[pool.groups[1][0]]._links[0].calls)  # shard 0 has answered it
        again = _again()
        pool.prefill([again])
        pending.result()  # the pool tells shard 1 now: an outcome of life 1
        pool.jit_draft([JitDraftRequest(1, 0, 0, 8)])
        tree = pool.wait_trees([(1, 0)], 30.0)[1]
        shard0, shard1 = (built[i].seqs[1] for i in pool.groups[1])
        assert shard1.committed == shard0.committed == AGAIN + [8]
        assert tree.generation == again.generation and pool.lost([1]) == []
    finally:
        pool.close()
        for server, _ in servers:
            server.stop(None)


class _HoldAcrossRePrefill:
    """The first draft asked of the server from round 2 on fails (INTERNAL): the engine gives the sequence the fast
    backup, whose outcome goes on the stream, then prefills it again (unary). The stream is held up from that
    failure until the re-prefill has returned, so the outcome of the earlier life reaches the server after it."""

    def __init__(self, worker, backend: GrpcDraftBackend):
        self.backend, self.held, self.prefills = backend, None, 0
        self._draft, worker.jit_draft = worker.jit_draft, self._failing_once
        self._start = backend.start_prefill
        backend.start_prefill = self._start_prefill

    def _failing_once(self, reqs):
        if self.held is None and any(r.round >= 2 for r in reqs):
            self.held = HeldBack(self.backend)
            raise RuntimeError("a draft that failed once")
        return self._draft(reqs)

    def _start_prefill(self, reqs):
        self.prefills += 1
        pending = self._start(reqs)
        held, result = self.held, pending.result

        def then_release():
            try:
                return result()
            finally:
                if held is not None and held.items:
                    held.release()
        pending.result = then_release
        return pending


def test_greedy_output_equals_plain_decoding_when_a_late_outcome_follows_a_re_prefill(pair):
    """End to end (Engine, DraftPool over real gRPC): a late outcome of the earlier life after a re-prefill is
    dropped at the server: one re-prefill, not a failed stream and another; the tokens are plain decoding's."""
    from saguaro_dist.engine.build import make_runner
    from saguaro_dist.engine.engine import Engine
    from saguaro_dist.engine.sequence import Sequence
    from saguaro_dist.sampling_params import SamplingParams
    # A tree as small as it gets and the draft's backup: a miss every few rounds, each asking for a draft.
    config = Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=4, fallback="neural",
                    draft_threads=1)
    worker = build_draft_worker(config)
    server, port = serve_draft(worker, "127.0.0.1", 0)
    backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=20.0)
    hold = _HoldAcrossRePrefill(worker, backend)
    engine = Engine(config, make_runner(config.model, config), DraftPool([backend], max_batch_size=1), None, set())
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        engine.add(Sequence(0, "0", list(PROMPTS[0]), params))
        (seq,) = engine.waiting
        while engine.running or engine.waiting or engine.prefilling:
            assert all(u.error is None for u in engine.step())
        assert_greedy_equal(seq.output_token_ids, hf_greedy(pair["model"], PROMPTS[0], 16), PROMPTS[0], pair["model"])
        assert hold.held is not None and hold.held.released and [m.WhichOneof("kind") for m in hold.held.items] == \
            ["outcomes"], "the path was not taken: no outcome held over a re-prefill"
        assert hold.prefills == 2, f"{hold.prefills - 1} re-prefills: the late outcome failed the new life's stream"
    finally:
        engine.close()
        server.stop(None)
