"""Presumed hits: a Verified (k*, t*) on the draft's own branch starts the next tree before the round's
Outcome arrives. The Outcome decides: the same hit releases exactly the tree the plain path builds;
anything else (a late tree, a just-in-time draft) restores the sequence, sampler state included, so
what follows is what the plain path gives."""
import pytest

from engine_helpers import llama_config, save_model
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Release, Verified

K = 3
GREEDY = DraftSampling(0.0, 0, 1.0, None)
SAMPLED = DraftSampling(0.8, 0, 1.0, 11)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("presumed_draft")
    save_model(path, llama_config(vocab=64, hidden=32, layers=2), seed=5)
    return str(path)


def started(draft_dir, sampling):
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=8))
    worker.prefill([PrefillRequest(0, [5, 6, 7, 8], sampling), PrefillRequest(1, [9, 3], sampling)])
    worker.jit_draft([JitDraftRequest(0, 0, 0, 7), JitDraftRequest(1, 0, 0, 4)])
    return worker


def as_dict(trees):
    return {t.seq_id: (t.round, {(b.accepted, b.bonus_token): b.proposal.tokens.tolist() for b in t.branches})
            for t in trees}


def hits(trees, r):
    """Round r's outcome of each tree: a different branch every round."""
    return [Outcome(t.seq_id, t.round, t.branches[(2 * r + i) % len(t.branches)].accepted,
                    t.branches[(2 * r + i) % len(t.branches)].bonus_token, None, cache_hit=True)
            for i, t in enumerate(trees)]


def verified(outcomes):
    return [Verified(o.seq_id, o.round, o.accepted, o.bonus_token) for o in outcomes]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_confirmed_hits_release_the_trees_the_plain_path_builds(draft_dir, sampling):
    presuming, plain = started(draft_dir, sampling), started(draft_dir, sampling)
    trees_p, trees_f = presuming.build_trees(), plain.build_trees()
    for r in range(5):
        assert as_dict(trees_p) == as_dict(trees_f)
        outcomes = hits(trees_p, r)
        presuming.verified(verified(outcomes))
        assert presuming.build_trees() == []  # held until the Outcomes confirm
        presuming.observe(outcomes), plain.observe(outcomes)
        trees_p, trees_f = presuming.build_trees(), plain.build_trees()
    assert as_dict(trees_p) == as_dict(trees_f)
    assert presuming.presumptions == {"confirmed": 10, "discarded": 0}
    assert presuming.stats.hit_rate == plain.stats.hit_rate


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_miss_after_a_presumed_hit_is_the_plain_miss(draft_dir, sampling):
    presuming, plain = started(draft_dir, sampling), started(draft_dir, sampling)
    trees = presuming.build_trees()
    plain.build_trees()
    outcomes = hits(trees, 0)
    presuming.verified(verified(outcomes))
    # sequence 0's tree came too late at the target: a fast-backup miss naming its own tokens;
    # sequence 1's target asked for a just-in-time draft
    late = Outcome(0, outcomes[0].round, outcomes[0].accepted, outcomes[0].bonus_token, [1, 2, 3])
    presuming.observe([late]), plain.observe([late])
    jit = [JitDraftRequest(1, outcomes[1].round + 1, outcomes[1].accepted, outcomes[1].bonus_token)]
    assert presuming.jit_draft(jit)[0].tokens.tolist() == plain.jit_draft(jit)[0].tokens.tolist()
    assert as_dict(presuming.build_trees()) == as_dict(plain.build_trees())
    assert presuming.presumptions == {"confirmed": 0, "discarded": 2}
    for sid in (0, 1):
        assert presuming.runner.length(sid) == plain.runner.length(sid)


def test_only_own_branches_of_the_current_round_are_presumed(draft_dir):
    worker = started(draft_dir, GREEDY)
    (tree, _) = worker.build_trees()
    built = {(b.accepted, b.bonus_token) for b in tree.branches}
    foreign = next((k, t) for k in range(K + 1) for t in range(64) if (k, t) not in built)
    worker.verified([Verified(0, tree.round, *foreign), Verified(0, tree.round + 1, *next(iter(built))),
                     Verified(99, 0, 0, 1)])
    assert worker._presumed == {}


def test_a_released_sequence_drops_its_presumption(draft_dir):
    worker = started(draft_dir, GREEDY)
    trees = worker.build_trees()
    worker.verified(verified(hits(trees, 0)))
    worker.release([Release(0), Release(1)])
    assert worker._presumed == {} and worker.build_trees() == []
