"""The round loop's batched hot paths give what the per-row code they replaced gave, bit for bit: top-F
candidates picked for a whole build at once (engine/draft_trees.py), uniforms drawn into one tensor per
call (spec/sampling.py row_uniforms), and the draft's penalties over a prompt mask kept per sequence
(engine/draft_constraints.py)."""
import torch

from saguaro_dist.engine.draft_constraints import DraftConstraints
from saguaro_dist.engine.draft_state import DraftSeq, fanout_key
from saguaro_dist.engine.draft_trees import TreeBuilding
from saguaro_dist.engine.messages import DraftSampling
from saguaro_dist.engine.sequence import make_generator
from saguaro_dist.spec import ProposalSource, select_branches
from saguaro_dist.spec.penalties import penalize_positions, row_penalties
from saguaro_dist.spec.sampling import row_uniforms

K, V = 2, 7


def seq(i: int, sampling: DraftSampling, committed: list[int], **fields) -> DraftSeq:
    return DraftSeq(i, sampling, make_generator(i, 2), committed=committed, **fields)


def test_top_f_candidates_of_a_batch_are_each_states_own():
    """States of three fan-outs (shards of a cache-parallel tree, a target-proposed speculation) in one call."""
    gen = torch.Generator().manual_seed(0)
    kinds = [dict(), dict(num_shards=2, shard=0), dict(num_shards=2, shard=1), dict(source=ProposalSource.LOOKUP)]
    states = [seq(i, DraftSampling(1.0, 0, 1.0, seed=i), [1, 2], **kinds[i % len(kinds)]) for i in range(13)]
    fanouts = {(1, False): [2, 1, 3], (2, False): [3, 2, 4], (1, True): [1, 1, 1]}
    logits = (torch.randn(len(states), K + 1, V, generator=gen) * 2).round()  # ties: topk must break them alike
    spec = torch.randint(0, V, (len(states), K), generator=gen)
    got = TreeBuilding._top_f_candidates(states, logits, spec, fanouts)
    ranking = logits.float().softmax(-1)
    for i, s in enumerate(states):
        alone = select_branches(ranking[i:i + 1], spec[i:i + 1], fanouts[fanout_key(s)])
        want = list(zip(alone.accepted[0, s.shard::s.num_shards].tolist(), alone.bonus[0, s.shard::s.num_shards].tolist()))
        assert got[i] == want


def test_grouped_row_uniforms_are_each_generators_consecutive_draws():
    """Rows sharing a generator (a tree's branches), interleaved or not: each group's rows take its draws in
    row order, as one torch.rand of the group's rows did."""
    for layout in ([0, 0, 1, 1, 1, 2], [2, 0, 1, 0, 2, 2, 1], [0, 1, 2, 3]):
        def gens():
            made = [torch.Generator().manual_seed(10 + g) for g in range(max(layout) + 1)]
            return [made[g] for g in layout]
        got = row_uniforms(gens(), len(layout), 3)
        want = torch.empty(len(layout), 3, dtype=torch.float64)
        fresh = gens()
        for g in dict.fromkeys(layout):
            rows = [i for i, x in enumerate(layout) if x == g]
            want[rows] = torch.rand((len(rows), 3), generator=fresh[rows[0]], dtype=torch.float64)
        assert torch.equal(got, want), layout


def test_draft_penalties_over_a_kept_prompt_mask():
    """positions() and rows() with the sequence's kept mask, round after round, equal the penalties computed
    from its prompt each time."""
    constraints = DraftConstraints(V)
    sampling = DraftSampling(1.0, 0, 1.0, seed=1, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4)
    s = seq(0, sampling, [1, 2, 5, 3], prompt_len=3, speculation=[3, 4])
    gen = torch.Generator().manual_seed(1)
    for bonus in (6, 2):
        logits = torch.randn(K + 1, V, generator=gen)
        want = penalize_positions(logits, s.committed[:3], s.committed[3:], s.speculation, 0.5, 0.3, 1.4)
        assert torch.equal(constraints.positions(s, logits), want)
        paths = [[4], [0, 1]]
        got = constraints.penalties([s, s], paths)
        ref = row_penalties([s.committed[:3]] * 2, [s.committed[3:] + p for p in paths], [(0.5, 0.3, 1.4)] * 2, V)
        for name in ("in_prompt", "counts", "presence", "frequency", "repetition"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name
        s.commit(1, bonus)  # the output grows; the prompt's mask stays
