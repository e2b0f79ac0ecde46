"""The real draft worker adapts its fan-out budget: smaller trees while outcomes are already waiting
when a build ends (the draft is on the critical path), the configured tree otherwise."""
import pytest

import saguaro_dist.spec.budget as budget_module
from engine_helpers import llama_config, save_model
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest

GREEDY = DraftSampling(0.0, 0, 1.0, None)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("budget_draft")
    save_model(path, llama_config(vocab=64, hidden=32, layers=1), seed=0)
    return str(path)


def started_worker(draft_dir, **settings):
    settings = {"adaptive_fan_out": True, **settings}
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="ssd", k=3, fan_out=16, **settings))
    worker.prefill([PrefillRequest(0, [5, 6, 7], GREEDY)])
    worker.jit_draft([JitDraftRequest(0, 0, 0, 7)])
    return worker


def hit_outcome(tree, round_: int) -> Outcome:
    return Outcome(0, round_, tree.accepted[0], tree.bonus_tokens[0], next_tokens=None, cache_hit=True)


class SteppedClock:
    """The budget controller's perf_counter, moved only by the test: the idle gap between a build and
    its outcomes is then exactly what the test says, and a scheduler hiccup on a busy box (two test
    workers on two cores) never reads as the draft idling. The builds themselves are timed for real."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def clock(monkeypatch) -> SteppedClock:
    stepped = SteppedClock()
    monkeypatch.setattr(budget_module, "time", stepped)
    return stepped


def run_rounds(worker, rounds: int, idle_s: float, target_wait_s: float = 0.0) -> list[int]:
    """Budgets (branches per tree) of consecutive rounds whose outcomes come idle_s after each build,
    each reporting that the target waited target_wait_s for that tree."""
    budgets = []
    for r in range(rounds):
        tree = worker.build_trees()[0]
        budgets.append(tree.num_branches)
        budget_module.time.now += idle_s  # the SteppedClock the autouse fixture put there
        outcome = hit_outcome(tree, r)
        outcome.tree_wait_s = target_wait_s
        worker.observe([outcome])
    return budgets


def test_budget_shrinks_while_outcomes_wait_then_stays_at_one_branch_per_position(draft_dir):
    worker = started_worker(draft_dir)
    budgets = run_rounds(worker, rounds=20, idle_s=0.0)  # 6 shrinks reach the floor
    assert worker.budget.scale == pytest.approx(4 / 16)  # the floor: K + 1 = 4 branches, one per position
    assert budgets[0] == 16 and budgets[-1] == 4, budgets


def test_budget_holds_when_the_draft_idles_or_adaptation_is_off(draft_dir):
    assert set(run_rounds(started_worker(draft_dir), rounds=4, idle_s=0.2)) == {16}
    assert set(run_rounds(started_worker(draft_dir, adaptive_fan_out=False), rounds=4, idle_s=0.0)) == {16}


def test_budget_shrinks_when_the_target_reports_waiting_though_the_draft_idled(draft_dir):
    # Over gRPC an outcome arrives a link round trip after the build: idle time the target spent waiting.
    budgets = run_rounds(started_worker(draft_dir), rounds=3, idle_s=0.2, target_wait_s=10.0)
    assert budgets[0] == 16 and budgets[1] < 16 and budgets[2] < budgets[1], budgets


def test_a_miss_reaching_the_draft_as_a_jit_request_feeds_its_statistics(draft_dir):
    """Misses arrive as just-in-time requests, not outcomes; they must count, or the fitted fan-out sees
    only hits (and the shards of one sequence, which learn of the miss differently, drift apart)."""
    worker = started_worker(draft_dir)
    worker.build_trees()
    worker.jit_draft([JitDraftRequest(0, 1, 0, 63)])  # the round-0 speculation's outcome was not cached
    assert worker.stats.hit_rate == 0.0
    tree = worker.build_trees()[0]
    worker.observe([hit_outcome(tree, 1)])
    assert worker.stats.hit_rate == pytest.approx(1 / (1 + 0.99))  # one hit after one (decayed) miss


def test_skip_tree_builds_nothing_and_records_no_lookup(draft_dir):
    """The tree gate's just-in-time rounds: the draft builds no tree and counts no cache lookup."""
    worker = started_worker(draft_dir, adaptive_fan_out=False)
    tree = worker.build_trees()[0]
    worker.observe([Outcome(0, 0, tree.accepted[0], tree.bonus_tokens[0],
                            next_tokens=None, cache_hit=True, skip_tree=True)])
    assert worker.build_trees() == []
    lookups = worker.stats._hits.count
    worker.jit_draft([JitDraftRequest(0, 2, 0, 5, skip_tree=False)])  # no tree was built for round 1
    assert worker.stats._hits.count == lookups  # untouched: nothing was looked up
    assert len(worker.build_trees()) == 1


def test_trees_after_target_proposals_fan_out_from_how_those_fare(draft_dir):
    """n-gram proposals the target side verifies (a long match: accepted whole, round after round) are
    modelled apart from the draft's own: its acceptance estimate is untouched by them, and a tree built
    after one puts more branches at k = K than a tree after the draft's own speculation."""
    worker = started_worker(draft_dir, adaptive_fan_out=False)
    worker.build_trees()  # round 0 verifies the draft's speculation: k* = 0, the target proposes next
    worker.observe([Outcome(0, 0, 0, 9, next_tokens=[11, 12, 13], target_proposed=True)])
    own_accept = worker.stats.accept_rate
    for r in range(1, 30):
        worker.build_trees()
        worker.observe([Outcome(0, r, 3, 9, next_tokens=[11, 12, 13], target_proposed=True)])
    assert worker.stats.accept_rate == own_accept
    assert worker.target_proposed.outcome_probs[3] > 0.7
    after_lookup = worker.build_trees()[0]
    worker.jit_draft([JitDraftRequest(0, 31, 3, 9)])
    after_draft = worker.build_trees()[0]
    assert after_lookup.accepted.count(3) > after_draft.accepted.count(3), (after_lookup.accepted, after_draft.accepted)


def test_another_shards_just_in_time_draft_is_the_drafts_own(draft_dir):
    """A cache-parallel shard learns shard 0's just-in-time draft as an outcome naming its tokens: that
    is the draft's proposal (it feeds the draft's acceptance), not the target side's."""
    worker = started_worker(draft_dir, adaptive_fan_out=False)
    worker.build_trees()
    worker.observe([Outcome(0, 0, 1, 9, next_tokens=[11, 12, 13])])
    worker.build_trees()
    worker.observe([Outcome(0, 1, 3, 9, next_tokens=[11, 12, 13])])
    assert worker.target_proposed._outcomes[3].count == 0
    assert worker.stats._outcomes[3].count > 0
