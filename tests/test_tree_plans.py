"""Tree plans: the draft announces the outcomes a tree will answer before it decodes the branches, so a
target whose outcome is not planned misses at once instead of waiting for a tree it cannot use; a draft
told the target has moved on stops the build. A miss is always exact (the fallback's proposals are
verified like any), so these tests check that plans say what the trees hold, that waiting honours
them, and that an abandoned build leaves the draft in step."""
import multiprocessing
import threading
import time

import pytest

from engine_helpers import DEVICE, PROMPTS, assert_greedy_equal, close_pair, hf_greedy, llama_config, save_model
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.draft_backend import TreeInbox
from saguaro_dist.engine.draft_process import Msg, _Child, named_seq_ids
from saguaro_dist.engine.messages import (
    DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Release, SpeculationTree, TreePlan,
)
from saguaro_dist.engine.pipe_wire import send

K = 3
SAMPLED = DraftSampling(0.8, 0, 1.0, 7)
GREEDY = DraftSampling(0.0, 0, 1.0, None)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans_draft")
    save_model(path, llama_config(vocab=64, hidden=32, layers=2), seed=5)
    return str(path)


def started(draft_dir, busy: bool = True, sampling: DraftSampling = SAMPLED):
    # top-F trees: a coupled tree's plan goes out every round (tests/test_coupled_plans.py)
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=8, bonus_draw="top_f"))
    worker.prefill([PrefillRequest(0, [5, 6, 7, 8], sampling), PrefillRequest(1, [9, 3], sampling)])
    worker.jit_draft([JitDraftRequest(0, 0, 0, 7), JitDraftRequest(1, 0, 0, 4)])
    worker.budget.busy = busy  # as after a round whose target waited for its trees
    return worker


def test_plans_announce_exactly_the_outcomes_each_tree_answers(draft_dir):
    worker = started(draft_dir)
    plans = worker.plan_trees()
    trees = worker.finish_trees()
    assert [(p.seq_id, p.round) for p in plans] == [(t.seq_id, t.round) for t in trees]
    for plan, tree in zip(plans, trees):
        assert list(zip(plan.accepted, plan.bonus_tokens)) == tree.keys() and tree.num_branches
        assert all(plan.holds(k, t) for k, t in tree.keys())


def test_a_draft_the_target_does_not_wait_for_announces_nothing(draft_dir):
    worker = started(draft_dir, busy=False)
    assert worker.plan_trees() == []
    assert len(worker.finish_trees()) == 2  # the trees are built all the same


@pytest.mark.parametrize("target_proposed", [False, True], ids=["draft_elsewhere", "target_lookup"])
def test_a_miss_drafted_elsewhere_is_no_slack(draft_dir, target_proposed):
    """A miss the split draft's thread drafted reaches the tree side after that draft: the long gap since the
    build is the target's draft, not this worker's idleness, so plans stay on. A miss the target side
    proposed (n-gram) costs no such draft: the same gap there is slack."""
    worker = started(draft_dir)
    worker.build_trees()
    time.sleep(0.2)  # far longer than the build: slack, were it idle time
    worker.observe([Outcome(0, 0, 1, 11, next_tokens=[2, 3, 4], target_proposed=target_proposed),
                    Outcome(1, 0, 0, 12, next_tokens=[5, 6, 7], target_proposed=target_proposed)])
    assert worker.budget.busy is not target_proposed


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_an_abandoned_build_returns_no_tree_and_the_draft_goes_on_in_step(draft_dir, sampling):
    """After a stopped build the sequences take the target's miss as usual; what the draft proposes next is
    what a draft that finished the useless tree proposes. Sampled builds stop too: a tree draws from its
    round's own generator, so the next tree's seeded draws (tokens and q) and the sequence's own stream
    (its just-in-time drafts') are those of the draft that finished it."""
    stopped, finished = started(draft_dir, sampling=sampling), started(draft_dir, sampling=sampling)
    asked = []
    stopped.plan_trees()
    assert stopped.finish_trees(lambda seq_ids: asked.append(seq_ids) or True) == []
    assert asked == [[0, 1]] and not stopped.seqs[0].branches
    finished.build_trees()
    for worker in (stopped, finished):
        worker.observe([Outcome(0, 0, 1, 11, next_tokens=[2, 3, 4]), Outcome(1, 0, 0, 12, next_tokens=[5, 6, 7])])
    a, b = stopped.build_trees(), finished.build_trees()
    assert [t.keys() for t in a] == [t.keys() for t in b]
    assert [t.proposals.tokens.tolist() for t in a] == [t.proposals.tokens.tolist() for t in b]
    if sampling is SAMPLED:
        assert all(x.proposals.probs.equal(y.proposals.probs) for x, y in zip(a, b))
        for sid in (0, 1):
            assert stopped.seqs[sid].generator.get_state().equal(finished.seqs[sid].generator.get_state())


def test_a_tree_draws_from_its_rounds_own_seeded_stream(draft_dir):
    """Two drafts seeded alike build the same sampled tree, and a tree's draws leave the sequence's own
    stream (its just-in-time drafts') untouched."""
    one, two = started(draft_dir), started(draft_dir)
    before = one.seqs[0].generator.get_state()
    a, b = one.build_trees(), two.build_trees()
    assert [t.proposals.tokens.tolist() for t in a] == [t.proposals.tokens.tolist() for t in b]
    assert one.seqs[0].generator.get_state().equal(before)


def test_the_inbox_does_not_wait_for_a_tree_whose_plan_lacks_the_outcome():
    inbox = TreeInbox()
    inbox.put_plans([TreePlan(1, 4, [0, 1], [5, 6])])
    start = time.monotonic()
    assert inbox.take([(1, 4)], 5.0, {1: (0, 9)}) == {}
    assert time.monotonic() - start < 1.0


def test_the_inbox_waits_for_a_planned_outcome_and_returns_its_tree():
    inbox, tree = TreeInbox(), SpeculationTree(1, 4)
    inbox.put_plans([TreePlan(1, 4, [0, 1], [5, 6])])
    threading.Timer(0.1, inbox.put, ([tree],)).start()
    assert inbox.take([(1, 4)], 5.0, {1: (1, 6)}) == {1: tree}


def test_without_outcomes_the_inbox_waits_for_the_tree_as_before():
    inbox = TreeInbox()
    inbox.put_plans([TreePlan(1, 4, [0], [5])])
    start = time.monotonic()
    assert inbox.take([(1, 4)], 0.2) == {}
    assert time.monotonic() - start >= 0.2


def test_a_round_whose_plans_ran_out_does_not_wait_again_for_its_trees():
    """A draft sends a round's plans before its trees: plans that did not come by the plan wait's deadline
    mean a stalled draft, and the round's tree wait takes what is there instead of a second timeout. The
    next round waits as before; a plan wait without a timeout marks nothing."""
    inbox = TreeInbox()
    assert inbox.plans([(1, 4)], 0.1) == {}
    start = time.monotonic()
    assert inbox.take([(1, 4)], 5.0) == {}
    assert time.monotonic() - start < 1.0
    start = time.monotonic()
    assert inbox.take([(1, 5)], 0.2) == {}
    assert time.monotonic() - start >= 0.2
    assert inbox.plans([(1, 6)], 0.0) == {}
    assert not inbox.late_plans([(1, 6)])


def test_plans_in_time_leave_the_tree_wait_as_it_was():
    inbox, tree = TreeInbox(), SpeculationTree(1, 4)
    inbox.put_plans([TreePlan(1, 4, [0], [5])])
    assert set(inbox.plans([(1, 4)], 0.1)) == {1}
    threading.Timer(0.1, inbox.put, ([tree],)).start()
    assert inbox.take([(1, 4)], 5.0) == {1: tree}


def test_plans_of_past_rounds_and_of_released_sequences_are_dropped():
    inbox = TreeInbox()
    inbox.put_plans([TreePlan(1, 3, [0], [5]), TreePlan(2, 3, [0], [5])])
    inbox.take([(1, 4)], 0.0, {1: (0, 5)})
    inbox.forget([2])
    assert not inbox.has([(1, 3)], {1: (0, 9)}) and not inbox.has([(2, 3)], {2: (0, 9)})


def test_the_child_reads_ahead_during_a_build_and_runs_what_it_read_in_order():
    """_superseded reads what the parent sent since the build began (a real pipe), says whether it names
    every sequence being built, and leaves those messages for serve() to run first, in order."""
    rx, parent_tx = multiprocessing.Pipe(duplex=False)
    child = _Child(worker=None, rx=rx, tx=None)
    send(parent_tx, Msg.POST, "send_outcomes", [Outcome(1, 0, 0, 5, next_tokens=[1, 2])])
    time.sleep(0.05)
    assert not child._superseded([1, 2])
    send(parent_tx, Msg.CALL, 7, "jit_draft", [JitDraftRequest(2, 1, 0, 5)])
    time.sleep(0.05)
    assert child._superseded([1, 2])
    assert [m[0] for m in child.backlog] == [Msg.POST, Msg.CALL]
    assert child._next_message()[:2] == (Msg.POST, "send_outcomes")


@pytest.mark.parametrize("msg, ids", [
    ((Msg.POST, "release", [Release(3)]), {3}),
    ((Msg.POST, "catch_up", [[Outcome(1, 0, 0, 5, None)], [Outcome(2, 0, 0, 5, None)]]), {1, 2}),
    ((Msg.CALL, 1, "prefill", [PrefillRequest(4, [1], SAMPLED)]), {4}),
    ((Msg.POST, "reset_prefix_cache", None), set()),
])
def test_named_seq_ids(msg, ids):
    assert named_seq_ids(msg) == ids


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("plans_pair"))


@pytest.mark.parametrize("executor", ["process", "split", "thread"])
def test_greedy_output_is_the_targets_with_plans_announced(pair, executor, monkeypatch):
    """A draft whose trees outlast the verify (a close draft's K x B branch steps against one target
    forward) announces its plans; misses then go on without their trees, and greedy output is unchanged."""
    received, put_plans = [], TreeInbox.put_plans
    monkeypatch.setattr(TreeInbox, "put_plans", lambda self, plans: (received.extend(plans), put_plans(self, plans)))
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = [hf_greedy(pair["model"], p, params.max_tokens) for p in PROMPTS]
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=24, max_batch_size=4,
             draft_executor=executor, tree_policy="always", fallback="fast") as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        assert llm.metrics.cache_misses > 0
    for prompt, out, ref in zip(PROMPTS, outs, want):
        assert_greedy_equal(out.token_ids, ref, prompt, pair["model"])
    assert received, "no plan was announced: the trees never made the target wait?"


@pytest.mark.parametrize("announce", [True, False])
def test_plans_cross_grpc_ahead_of_their_trees_and_spare_a_miss_the_wait(pair, announce):
    """A real DraftWorker behind a real DraftService on loopback, its branch decode held back until the test
    lets it go. With plans announced (serve_draft's announce_plans, off by default) the target side learns
    them first, misses at once where its outcome is not planned, and still waits for (and gets) a tree that
    holds its outcome; without them it waits for every tree, as before plans."""
    config = Config(model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=6)
    worker = build_draft_worker(config)
    worker.budget.busy = True
    finish, let_go = worker.finish_trees, threading.Event()
    worker.finish_trees = lambda *args: (let_go.wait(30), finish(*args))[1]
    server, port = serve_draft(worker, "127.0.0.1", 0, announce_plans=announce)
    backend = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)
    # Announced, the miss returns with the trees still held: the timer only bounds a wait that wrongly lasts
    # (5 s, far past a stall). Unannounced, the wait lasts until the timer lets the trees go.
    timer = threading.Timer(5.0 if announce else 1.0, let_go.set)
    try:
        backend.prefill([PrefillRequest(sid, PROMPTS[sid], GREEDY) for sid in (1, 2)])
        backend.jit_draft([JitDraftRequest(sid, 0, 0, PROMPTS[sid][-1]) for sid in (1, 2)])
        timer.start()
        unplanned = backend.wait_trees([(1, 0)], 10.0, {1: (0, config.k + 10**6)})
        assert let_go.is_set() is not announce and (unplanned == {}) is announce
        let_go.set()
        if announce:  # a planned outcome: its tree is waited for, and holds what the plan said
            plan = backend._plans[(2, 0)]
            tree = backend.wait_trees([(2, 0)], 10.0, {2: (plan.accepted[0], plan.bonus_tokens[0])})[2]
            assert tree.keys() == list(zip(plan.accepted, plan.bonus_tokens))
        else:
            assert not backend._plans and backend.wait_trees([(2, 0)], 10.0)[2].num_branches
    finally:
        timer.cancel()
        let_go.set()
        backend.close()
        server.stop(None)
