"""Coupled bonus draws through the draft and the target (spec/coupled.py; the statistics are in
tests/test_spec_coupled.py and tests/test_engine_sampling.py): a sampled row's tree draws its candidates
from the guess its plan carries, the plan is announced every round, and the target lays the plan out as
the candidates it draws the bonus against, ignoring a plan that does not fit."""
import itertools
import time

import pytest
import torch

from engine_helpers import llama_config, save_model
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_draft_worker, make_runner
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.engine import Engine
from saguaro_dist.engine.coupling import plan_coupling, plan_fits
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest, TreePlan
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.sampling_params import SamplingParams as Params
from saguaro_dist.spec.stats import Timing

K, VOCAB = 3, 64
SAMPLED = DraftSampling(0.8, 0, 1.0, 7)
GREEDY = DraftSampling(0.0, 0, 1.0, None)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("coupled_draft")
    save_model(path, llama_config(vocab=VOCAB, hidden=32, layers=2), seed=5)
    return str(path)


def planned(draft_dir, bonus_draw="coupled", sampling=(SAMPLED, GREEDY)):
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=8, bonus_draw=bonus_draw))
    worker.prefill([PrefillRequest(i, [5, 6, 7, 8 + i], s) for i, s in enumerate(sampling)])
    worker.jit_draft([JitDraftRequest(i, 0, 0, 7) for i in range(len(sampling))])
    worker.budget.busy = False  # a target that has not waited: only coupled plans are announced
    return worker, worker.plan_trees(), worker.finish_trees()


def test_a_sampled_row_announces_its_guess_and_draws_its_candidates_from_it(draft_dir):
    _, plans, trees = planned(draft_dir)
    assert [p.seq_id for p in plans] == [0]  # the greedy row keeps top-F, unannounced while the target waits not
    plan, tree = plans[0], trees[0]
    assert plan.guess_ids.shape == plan.guess_probs.shape and plan.guess_ids.shape[0] == K + 1
    assert torch.allclose(plan.guess_probs.sum(-1), torch.ones(K + 1))
    assert list(zip(plan.accepted, plan.bonus_tokens)) == tree.keys()
    for k, t in tree.keys():  # each candidate is in its outcome's guess, with probability > 0
        support = dict(zip(plan.guess_ids[k].tolist(), plan.guess_probs[k].tolist()))
        assert support.get(t, 0.0) > 0


def test_candidates_are_reproducible_and_top_f_plans_carry_no_guess(draft_dir):
    first, second = planned(draft_dir)[1], planned(draft_dir)[1]
    assert first[0].bonus_tokens == second[0].bonus_tokens
    assert torch.equal(first[0].guess_ids, second[0].guess_ids)
    assert planned(draft_dir, bonus_draw="top_f")[1] == []  # top-F: no plan while the target does not wait


def _seq(seq_id: int, seed: int = 0) -> Sequence:
    return Sequence(seq_id, str(seq_id), [1, 2, 3], Params(temperature=1.0, seed=seed))


def _plan(seq_id, accepted, bonus, positions=K + 1):
    ids = torch.arange(4).repeat(positions, 1)
    return TreePlan(seq_id, 0, accepted, bonus, guess_ids=ids, guess_probs=torch.full((positions, 4), 0.25))


def test_the_target_lays_candidates_out_per_outcome_in_draw_order():
    seqs = [_seq(0), _seq(1), _seq(2)]
    plans = {0: _plan(0, [0, 0, 3], [2, 1, 3]), 2: _plan(2, [1], [0], positions=K)}
    c = plan_coupling(seqs, plans, K, VOCAB, "cpu")
    assert c.candidates.shape == (3, K + 1, 2)
    assert c.candidates[0, 0].tolist() == [2, 1] and c.candidates[0, 3].tolist() == [3, -1]
    assert (c.candidates[1] == -1).all() and (c.guess_probs[1] == 0).all()  # no plan: drawn as without coupling
    assert c.candidates[2, 1].tolist() == [0, -1] and (c.guess_probs[2, K] == 0).all()  # a tree without k = K
    assert c.guess_ids[0, 0].tolist() == [0, 1, 2, 3] and torch.allclose(c.guess_probs[0, 0], torch.full((4,), 0.25))
    again = plan_coupling(seqs, plans, K, VOCAB, "cpu")
    assert torch.equal(c.uniforms, again.uniforms)  # the row's own stream: reproducible


@pytest.mark.parametrize("plan", [
    TreePlan(0, 0, [0], [1]),                                                    # no guess (top-F)
    _plan(0, [0], [1], positions=K + 2),                                         # another K
    TreePlan(0, 0, [0], [1], guess_ids=torch.full((K + 1, 4), VOCAB), guess_probs=torch.ones(K + 1, 4)),  # ids past V
    _plan(0, [K + 1], [1]),                                                      # a position past K
    _plan(0, [0], [VOCAB]),                                                      # a candidate past V
    _plan(0, [], []),                                                            # no candidate
], ids=["top_f", "other_k", "ids_past_vocab", "position_past_k", "candidate_past_vocab", "empty"])
def test_a_plan_that_does_not_fit_is_left_out(plan):
    assert not plan_fits(plan, K, VOCAB)
    assert plan_coupling([_seq(0)], {0: plan}, K, VOCAB, "cpu") is None


def test_an_unknown_bonus_draw_is_refused():
    with pytest.raises(ValueError, match="bonus_draw"):
        Config(model="m", draft="d", bonus_draw="sometimes")


def test_seeded_sampling_is_reproducible_with_coupled_draws(tmp_path):
    """On the README's fixed path (fan-out list, trees every round, glue always, neural fallback)."""
    save_model(tmp_path / "t", llama_config(vocab=VOCAB, hidden=32, layers=2), seed=1)
    save_model(tmp_path / "d", llama_config(vocab=VOCAB, hidden=32, layers=1), seed=2)
    params = SamplingParams(temperature=0.9, max_tokens=24, seed=11, ignore_eos=True)
    runs = []
    for _ in range(2):
        # A tree later than tree_timeout_s is a miss, which draws otherwise: the timeout is far past a CI stall.
        with LLM(model=str(tmp_path / "t"), draft=str(tmp_path / "d"), mode="ssd", k=K, fan_out=[3, 2, 2, 1],
                 tree_policy="always", hit_glue="always", fallback="neural", bonus_draw="coupled", draft_executor="thread",
                 tree_timeout_s=60.0) as llm:
            runs.append(llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=params))
            assert llm.metrics.coupled_draws > 0
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


def run_slow_planner(tmp_path, plan_delay_s: float, max_tokens: int, plans_delayed: int | None = None,
                     **config) -> Engine:
    """One sampled sequence through SSD (trees every round) whose draft thread sleeps plan_delay_s before each
    of its first `plans_delayed` plans (None: every plan); returns the closed engine, its metrics and stats read after."""
    save_model(tmp_path / "t", llama_config(vocab=VOCAB, hidden=32, layers=2), seed=1)
    save_model(tmp_path / "d", llama_config(vocab=VOCAB, hidden=32, layers=1), seed=2)
    config = Config(model=str(tmp_path / "t"), draft=str(tmp_path / "d"), mode="ssd", k=K, tree_policy="always",
                    fallback="neural", draft_executor="thread", **config)
    worker = build_draft_worker(config)
    planning = worker.plan_trees
    delays = itertools.repeat(plan_delay_s, plans_delayed) if plans_delayed is not None else itertools.repeat(plan_delay_s)
    worker.plan_trees = lambda: time.sleep(next(delays, 0.0)) or planning()
    engine = Engine(config, make_runner(config.model, config), LocalDraftBackend(worker), None, set())
    try:
        engine.add(Sequence(0, "0", [1, 2, 3], Params(temperature=0.9, max_tokens=max_tokens, seed=3, ignore_eos=True)))
        while engine.running or engine.waiting or engine.prefilling:
            engine.step()
    finally:
        engine.close()
    return engine


def test_the_wait_for_plans_counts_in_the_round_cost(tmp_path):
    """A sampled tree round waits for its plan after the verify, then for its tree: both are the round's wait on
    the draft side, which the fallback choice weighs as Theorem 7's round cost (SpecStats.round_cost). A draft
    that takes 30 ms to plan makes the target wait there, not for the tree."""
    engine = run_slow_planner(tmp_path, 0.03, max_tokens=12)
    assert engine.metrics.coupled_draws > 0 and engine.metrics.plan_wait_s > 0.02
    assert engine.loop.stats.time(Timing.TREE_WAIT) > 0.015  # the tree itself came ~at once after its plan


def test_a_round_whose_plans_ran_out_counts_its_trees_late(tmp_path):
    """A draft that plans slower than tree_timeout_s: the plan wait runs out and the round takes its tree
    without waiting again (TreeInbox.late_plans). It still waited the timeout out once, so its missing trees
    count as late (metrics.late_trees, the once-a-minute warning about a stalled draft side)."""
    # The first plan 60x the timeout (a verify on a loaded box took longer than a 0.5 s delay: no wait, no late
    # tree); the later plans at once, so the test stays short.
    engine = run_slow_planner(tmp_path, 3.0, max_tokens=6, plans_delayed=1, tree_timeout_s=0.05)
    assert engine.metrics.plan_wait_s >= 0.05 and engine.metrics.late_trees > 0
