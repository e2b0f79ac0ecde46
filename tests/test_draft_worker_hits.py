"""A hit on the draft's own branch skips the glue forward over that branch's tokens: the branch's KV
and logits are adopted, and only x_K runs. The trees must be the ones a full glue would build."""
import pytest
import torch

from engine_helpers import llama_config, save_model
from saguaro_dist.config import Config
from saguaro_dist.distributed.errors import DraftBehind, OutOfOrder
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest

GREEDY = DraftSampling(0.0, 0, 1.0, None)
K = 3


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hits_draft")
    save_model(path, llama_config(vocab=64, hidden=32, layers=2), seed=3)
    return str(path)


def started(draft_dir):
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=8))
    worker.prefill([PrefillRequest(0, [5, 6, 7, 8], GREEDY), PrefillRequest(1, [9, 3], GREEDY)])
    worker.jit_draft([JitDraftRequest(0, 0, 0, 7), JitDraftRequest(1, 0, 0, 4)])
    return worker


def record_extends(worker) -> list[list[int]]:
    """Token counts of every extend call the worker's runner makes from now on."""
    calls, extend = [], worker.runner.extend

    def spy(seq_ids, token_lists, num_logits):
        calls.append([len(t) for t in token_lists])
        return extend(seq_ids, token_lists, num_logits)
    worker.runner.extend = spy
    return calls


def as_dict(trees):
    return {t.seq_id: dict(zip(t.keys(), t.proposals.tokens.tolist())) for t in trees}


def test_hits_adopt_their_branch_and_build_the_trees_a_full_glue_builds(draft_dir):
    adopting, full = started(draft_dir), started(draft_dir)
    extends = record_extends(adopting)
    trees_a, trees_f = adopting.build_trees(), full.build_trees()
    for r in range(6):
        assert as_dict(trees_a) == as_dict(trees_f)
        # sequence 0 hits a different branch each round; sequence 1 alternates hit and a miss's JIT draft
        picks = [t.keys()[(r * 3 + i) % t.num_branches] for i, t in enumerate(trees_a)]
        outcomes = [Outcome(t.seq_id, t.round, *key, None, cache_hit=True) for t, key in zip(trees_a, picks)]
        if r % 2:
            adopting.observe(outcomes[:1]), full.observe(outcomes[:1])
            jit = [JitDraftRequest(1, trees_a[1].round + 1, *picks[1])]
            assert adopting.jit_draft(jit)[0].tokens.tolist() == full.jit_draft(jit)[0].tokens.tolist()
        else:
            adopting.observe(outcomes), full.observe(outcomes)
        for s in full.seqs.values():  # the reference runs the glue over [b, x_1..x_K] every round
            s.hit = None
        trees_a, trees_f = adopting.build_trees(), full.build_trees()
        glue = extends[-1]
        assert glue == ([1, 1] if r % 2 == 0 else [1, K + 1])  # hits run x_K alone; the JIT'd sequence all K+1
    assert as_dict(trees_a) == as_dict(trees_f)
    for sid in (0, 1):
        assert adopting.runner.length(sid) == full.runner.length(sid)


def test_a_branch_built_by_another_shard_is_not_adopted(draft_dir):
    worker = started(draft_dir)
    (tree, _) = worker.build_trees()
    key = tree.keys()[0]
    tokens = worker.seqs[0].branches.pop(key)  # as if another cache-parallel shard had built this branch
    worker.seqs[0].branch_rows.pop(key)
    worker.observe([Outcome(0, tree.round, *key, next_tokens=tokens, cache_hit=True)])
    assert worker.seqs[0].hit is None


def test_a_jit_ahead_of_the_observed_outcomes_is_draft_behind_a_stale_one_out_of_order(draft_dir):
    worker = started(draft_dir)  # both sequences at round 0
    with pytest.raises(DraftBehind):  # round 1's outcome not seen yet: over gRPC it may be in flight
        worker.jit_draft([JitDraftRequest(0, 2, 0, 7)])
    with pytest.raises(OutOfOrder) as stale:
        worker.jit_draft([JitDraftRequest(0, 0, 0, 7)])
    assert not isinstance(stale.value, DraftBehind)
    assert worker.jit_draft([JitDraftRequest(0, 1, 0, 7)])[0].tokens.shape == (K,)  # nothing was changed


def test_a_sequence_with_no_speculation_yet_takes_round_0_only(draft_dir):
    """Round 1 on a sequence whose first draft this worker never made nor learned (the split draft's other
    half made it) committed the bonus after a speculation it did not hold: a wrong context, silently."""
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=8))
    worker.prefill([PrefillRequest(0, [5, 6, 7, 8], DraftSampling(0.0, 0, 1.0, None))])
    with pytest.raises(OutOfOrder, match="no speculation yet"):
        worker.jit_draft([JitDraftRequest(0, 1, 0, 7)])
    assert worker.jit_draft([JitDraftRequest(0, 0, 0, 7)])[0].tokens.shape == (K,)


def jit_proposal(draft_dir, mode: str, saguaro_c: float, min_p: float = 0.0):
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode=mode, k=K, fan_out=8, saguaro_c=saguaro_c))
    worker.prefill([PrefillRequest(0, [5, 6, 7, 8], DraftSampling(1.0, 0, 1.0, 11, min_p=min_p))])
    return worker.jit_draft([JitDraftRequest(0, 0, 0, 7)])[0]


def test_the_draft_samples_under_the_requests_min_p(draft_dir):
    """Told min_p, the draft proposes from its own min-p'd distribution (q is what it drew from, and its
    support is what the target can accept): every kept token within min_p of the row's likeliest."""
    plain, truncated = jit_proposal(draft_dir, "sd", 1.0), jit_proposal(draft_dir, "sd", 1.0, min_p=0.5)
    assert bool((plain.probs > 0).all())
    kept = truncated.probs > 0
    assert bool(kept.any(dim=-1).all()) and int(kept.sum()) < kept.numel() // 2
    q = truncated.probs.gather(-1, truncated.tokens[:, None])
    assert bool((q > 0).all())  # each proposed token is inside its own row's support


@pytest.mark.parametrize("mode, biased", [("sd", False), ("ssd", True)])
def test_saguaro_sampling_biases_the_draft_only_where_a_cache_can_use_it(draft_dir, mode, biased):
    """sigma_{F,C} moves draft mass off the cached bonus candidates to raise SSD's hit rate; SD has no
    cache, so there it would only cost acceptance: its draft samples the plain distribution."""
    plain, scaled = jit_proposal(draft_dir, mode, 1.0), jit_proposal(draft_dir, mode, 0.3)
    assert torch.equal(plain.probs, scaled.probs) is not biased


def separate_catch_up(worker):
    """The reference: committed tokens the KV lacks run in a forward of their own, before the next one."""
    cut_back = worker._cut_back

    def run_first(states):
        lacking = {s.seq_id: m for s, m in zip(states, cut_back(states)) if m}
        if lacking:
            worker.runner.extend(list(lacking), list(lacking.values()), [1] * len(lacking))
        return [[] for _ in states]
    worker._cut_back = run_first
    return worker


def test_committed_tokens_the_kv_lacks_run_in_the_next_forward(draft_dir):
    """x_K after a fully accepted round, and every token of rounds without a tree (the draft only
    observed them), run ahead of the next forward's own tokens, in that forward: the same proposals and
    trees as running them first, one forward fewer."""
    merged, reference = started(draft_dir), separate_catch_up(started(draft_dir))
    extends = record_extends(merged)
    jit = [JitDraftRequest(0, 1, K, 9)]  # all K accepted: x_K was drawn, never run
    assert merged.jit_draft(jit)[0].tokens.tolist() == reference.jit_draft(jit)[0].tokens.tolist()
    assert extends == [[2]] + [[1]] * (K - 1)
    for r, skip in ((1, True), (2, True), (3, False)):  # two rounds without trees, then one with
        outcome = [Outcome(0, r, K, 11 + r, next_tokens=[20 + r, 21, 22][:K], skip_tree=skip)]
        merged.observe(outcome), reference.observe(outcome)
    extends.clear()
    assert as_dict(merged.build_trees()) == as_dict(reference.build_trees())
    # x_K and bonus of round 1, round 2's K + 1, round 3's K, then b, x_1..x_K: 3K + 4 tokens in one forward
    # (sequence 1's glue, K + 1 tokens, beside it)
    assert extends == [[3 * K + 4, K + 1]]  # the branches then run through branch_start and branch_step
    assert merged.runner.length(0) == reference.runner.length(0)


def test_a_re_prefill_keeps_the_prompt_apart_from_earlier_output(draft_dir):
    # presence/frequency penalties count output tokens only: a sequence re-prefilled with its output
    # (after its worker died) must not count that output as prompt.
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=8))
    penalized = DraftSampling(0.0, 0, 1.0, None, presence_penalty=1.5, frequency_penalty=0.5)
    worker.prefill([PrefillRequest(0, [5, 6, 7, 8, 9, 9], penalized, prompt_len=4), PrefillRequest(1, [9, 3], penalized)])
    assert (worker.seqs[0].prompt_len, worker.seqs[1].prompt_len) == (4, 2)
    for bad in (-1, 7):
        with pytest.raises(ValueError, match="prompt_len"):
            worker.prefill([PrefillRequest(2, [5, 6, 7, 8, 9, 9], penalized, prompt_len=bad)])
    assert 2 not in worker.seqs  # nothing half-admitted


def test_proposal_top_k_keeps_the_trees_q_to_k_tokens_and_it_travels_sparse(draft_dir):
    from saguaro_dist.distributed import codec
    sampled = DraftSampling(1.0, 0, 1.0, 7)
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=8, proposal_top_k=3))
    worker.prefill([PrefillRequest(0, [5, 6, 7, 8], sampled)])
    jit = worker.jit_draft([JitDraftRequest(0, 0, 0, 7)])[0]
    (tree,) = worker.build_trees()
    for q in (jit.probs, tree.proposals.probs):
        support = (q > 0).sum(-1)
        assert support.max() <= 3 and support.min() >= 1 and torch.allclose(q.sum(-1), torch.ones(q.shape[:-1]))
    assert codec.tree_to_proto(tree).proposals.WhichOneof("probs") == "sparse"


def test_a_round_of_n_gram_proposals_alone_may_send_1_to_3k_tokens_a_tree_speculation_k(draft_dir):
    """engine/lookup_rounds.py: a target-proposed speculation that wants no tree is 1..3K tokens, and its
    outcome commits however many of them were accepted; any other speculation is K tokens (trees are built K
    deep), and a refused one changes nothing."""
    worker = started(draft_dir)
    long = list(range(20, 20 + 3 * K))
    for bad in (Outcome(0, 0, 1, 11, next_tokens=long, skip_tree=False, target_proposed=True),  # wants a tree
                Outcome(0, 0, 1, 11, next_tokens=long, skip_tree=True),  # the draft's own
                Outcome(0, 0, 1, 11, next_tokens=long + [30], skip_tree=True, target_proposed=True)):  # past 3K
        with pytest.raises(ValueError, match="1..3K only"):
            worker.observe([bad])
    worker.observe([Outcome(0, 0, 1, 11, next_tokens=long, skip_tree=True, target_proposed=True)])
    committed = worker.seqs[0].committed
    worker.observe([Outcome(0, 1, 2 * K + 1, 12, next_tokens=[40], skip_tree=True, target_proposed=True)])
    assert worker.seqs[0].committed == committed + long[:2 * K + 1] + [12]
    assert worker.jit_draft([JitDraftRequest(0, 3, 0, 13)])[0].tokens.shape == (K,)
