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


# ---- second-round review (session 90): the edges of the same three paths ----------------------------------

def _old_row_uniforms(gens: list, n: int, m: int) -> torch.Tensor:
    """row_uniforms before the change, for CPU (or None) generators: one torch.rand per generator object, in
    order of first appearance, its rows taking consecutive draws."""
    groups: dict[int, tuple] = {}
    for i, g in enumerate(gens):
        groups.setdefault(id(g), (g, []))[1].append(i)
    out = torch.empty(n, m, dtype=torch.float64)
    for g, rows in groups.values():
        out[rows] = torch.rand((len(rows), m), generator=g, dtype=torch.float64)
    return out


def test_row_uniforms_leave_every_generator_where_torch_rand_did():
    """Every path of row_uniforms (one shared generator, one per row, groups, groups with a None among them)
    and widths 0, 1 and 3: the numbers torch.rand drew, and the next draw of each generator the same after."""
    layouts = ([0, 0, 0], [0, 1, 2, 3], [2, 0, 1, 0, 2], [0, None, 1, None, 0], [None, None], [1, 0])
    for layout in layouts:
        for m in (0, 1, 3):
            def gens():
                made = {g: torch.Generator().manual_seed(100 + g) for g in set(layout) if g is not None}
                return [None if g is None else made[g] for g in layout]
            new, old = gens(), gens()
            torch.manual_seed(7)  # the default generator's rows (None) draw from the same place both times
            got = row_uniforms(new, len(layout), m)
            after_new = torch.rand(2, dtype=torch.float64)
            torch.manual_seed(7)
            want = _old_row_uniforms(old, len(layout), m)
            after_old = torch.rand(2, dtype=torch.float64)
            assert torch.equal(got, want), (layout, m)
            assert torch.equal(after_new, after_old), (layout, m)
            for a, b in zip(new, old):
                if a is not None:
                    assert torch.equal(torch.rand(4, generator=a, dtype=torch.float64),
                                       torch.rand(4, generator=b, dtype=torch.float64)), (layout, m)


def test_uniform_into_a_row_view_is_torch_rand_out():
    """The coupled paths' in-place draw into a row of a batch tensor (coupling.py, _sampled_candidates'
    [R, M] rows): torch.rand(out=row)'s numbers, the rows around it untouched, the stream where it was left."""
    for shape in ((3, 5), (4, 2, 3), (2, 0)):
        new, old = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
        g_new, g_old = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        new[1].uniform_(generator=g_new)
        torch.rand(old[1].shape, generator=g_old, dtype=torch.float64, out=old[1])
        assert torch.equal(new, old), shape
        assert torch.equal(torch.rand(3, generator=g_new), torch.rand(3, generator=g_old)), shape


def _alone(states, logits, spec, fanouts):
    ranking = logits.float().softmax(-1)
    out = []
    for i, s in enumerate(states):
        chosen = select_branches(ranking[i:i + 1], spec[i:i + 1], fanouts[fanout_key(s)])
        out.append(list(zip(chosen.accepted[0, s.shard::s.num_shards].tolist(),
                            chosen.bonus[0, s.shard::s.num_shards].tolist())))
    return out


def test_top_f_candidates_single_state_one_key_three_shards_and_no_full_acceptance():
    """The batched pick against the per-state one: a single state, a batch of one fan-out (no row copy), three
    shards of one tree interleaved with unsharded states, fan-outs with F_k = 0, and [P, K, V] logits (x_K not
    run: the trees that skip k = K)."""
    gen = torch.Generator().manual_seed(5)
    sampling = DraftSampling(0.0, 0, 1.0, seed=None)
    cases = [
        ([dict()], {(1, False): [1, 0, 2]}),
        ([dict()] * 5, {(1, False): [2, 2, 2]}),
        ([dict(num_shards=3, shard=j % 3) if j % 2 else dict() for j in range(9)],
         {(1, False): [0, 3, 1], (3, False): [3, 0, 6]}),
        ([dict(source=ProposalSource.LOOKUP), dict(), dict(source=ProposalSource.LOOKUP)],
         {(1, True): [0, 0, 1], (1, False): [1, 1, 0]}),
    ]
    for kinds, fanouts in cases:
        states = [seq(i, sampling, [1, 2], **kind) for i, kind in enumerate(kinds)]
        for positions in (K + 1, K):
            fans = fanouts if positions == K + 1 else {key: [f[0], f[1] + f[2]] for key, f in fanouts.items()}
            logits = (torch.randn(len(states), positions, V, generator=gen) * 2).round()  # ties
            spec = torch.randint(0, V, (len(states), K), generator=gen)
            got = TreeBuilding._top_f_candidates(states, logits, spec, fans)
            assert got == _alone(states, logits, spec, fans), (kinds, positions)


def test_kept_prompt_mask_across_widths_and_ids_past_the_vocabulary():
    """positions() over logits wider than the vocabulary (a padded head) between rows() at the vocabulary's
    width, a prompt holding ids past the narrower one: each call gets the mask of its own width, built from
    the prompt as penalize_positions / row_penalties build it."""
    constraints = DraftConstraints(V)
    sampling = DraftSampling(1.0, 0, 1.0, seed=1, presence_penalty=0.2, repetition_penalty=1.7)
    s = seq(0, sampling, [1, 8, 5, 3], prompt_len=3, speculation=[3, 4])  # 8: past V, inside the padded width
    gen = torch.Generator().manual_seed(2)
    for width in (V + 3, V, V + 3):
        logits = torch.randn(K + 1, width, generator=gen)
        want = penalize_positions(logits, s.committed[:3], s.committed[3:], s.speculation, 0.2, 0.0, 1.7)
        assert torch.equal(constraints.positions(s, logits), want), width
        got = constraints.penalties([s], [[2]])
        ref = row_penalties([s.committed[:3]], [s.committed[3:] + [2]], [(0.2, 0.0, 1.7)], V)
        assert torch.equal(got.in_prompt, ref.in_prompt) and torch.equal(got.counts, ref.counts), width
