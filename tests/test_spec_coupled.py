"""Coupled bonus draws (spec/coupled.py): the bonus still follows its distribution exactly, and lands on a
candidate as often as the draft's guess overlaps it; a coupling without the residual step is caught."""
import pytest
import scipy.stats
import torch

from saguaro_dist.spec.coupled import bonus_guess, coupled_bonus, draw_candidates
from saguaro_dist.spec.sampling import sample_with_uniforms

torch.set_num_threads(1)

V = 6
N = 65536
ALPHA = 1e-3


def _dist(gen, zeros=()):
    p = torch.rand(V, generator=gen, dtype=torch.float64) ** 2
    p[list(zeros)] = 0.0
    return p / p.sum()


def _draws(r, g, f, gen):
    """N bonus tokens drawn against F candidates, and the candidates."""
    cands = draw_candidates(g.expand(N, V), f, torch.rand(N, V, generator=gen, dtype=torch.float64))
    u = torch.rand(N, f + 1, generator=gen, dtype=torch.float64)
    return coupled_bonus(r.expand(N, V), g.expand(N, V), cands, u), cands


def _pvalue(tokens, probs):
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    keep = probs > 0
    return scipy.stats.chisquare(counts[keep].numpy(), (probs[keep] * N).numpy()).pvalue


@pytest.mark.parametrize("f", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_coupled_bonus_follows_the_residual_exactly(f, seed):
    gen = torch.Generator().manual_seed(seed)
    r, g = _dist(gen, zeros=[seed % V]), _dist(gen, zeros=[(seed + 2) % V, (seed + 3) % V])  # g's support: 4 < 5
    bonus, _ = _draws(r, g, f, gen)
    assert _pvalue(bonus, r) > ALPHA


def test_one_candidate_is_hit_as_often_as_guess_and_residual_overlap():
    gen = torch.Generator().manual_seed(7)
    r, g = _dist(gen), _dist(gen)
    bonus, cands = _draws(r, g, 1, gen)
    hit = (bonus == cands[:, 0]).double().mean().item()
    overlap = torch.minimum(r, g).sum().item()
    assert abs(hit - overlap) < 4 * (overlap * (1 - overlap) / N) ** 0.5
    assert overlap > r.max().item()  # the point: more than a fixed top-1 candidate could be hit


def test_more_candidates_hit_more_often():
    gen = torch.Generator().manual_seed(3)
    r, g = _dist(gen), _dist(gen)
    rates = []
    for f in (1, 2, 3):
        bonus, cands = _draws(r, g, f, gen)
        rates.append((bonus[:, None] == cands).any(1).double().mean().item())
    assert rates[0] < rates[1] < rates[2]


def test_a_coupling_without_the_residual_step_is_caught():
    """Accepting y with min(1, r/g) and otherwise drawing from r itself (not the residual) over-draws y's."""
    gen = torch.Generator().manual_seed(4)
    r, g = _dist(gen), _dist(gen)
    cands = draw_candidates(g.expand(N, V), 1, torch.rand(N, V, generator=gen, dtype=torch.float64))[:, 0]
    u = torch.rand(N, 2, generator=gen, dtype=torch.float64)
    accept = u[:, 0] * g[cands] < r[cands]
    broken = torch.where(accept, cands, sample_with_uniforms(r.expand(N, V), u[:, 1]))
    assert _pvalue(broken, r) < ALPHA


def test_candidates_are_draws_without_replacement():
    gen = torch.Generator().manual_seed(5)
    g = _dist(gen, zeros=[0])
    cands = draw_candidates(g.expand(N, V), 2, torch.rand(N, V, generator=gen, dtype=torch.float64))
    assert (cands[:, 0] != cands[:, 1]).all() and (cands != 0).all()
    first = torch.bincount(cands[:, 0], minlength=V).double()
    assert scipy.stats.chisquare(first[1:].numpy(), (g[1:] * N).numpy()).pvalue > ALPHA
    # second | first = y: g without y, renormalised
    y = int(g.argmax())
    after = cands[cands[:, 0] == y, 1]
    rest = g.clone()
    rest[y] = 0
    rest /= rest.sum()
    seen = torch.bincount(after, minlength=V).double()
    keep = rest > 0
    assert scipy.stats.chisquare(seen[keep].numpy(), (rest[keep] * len(after)).numpy()).pvalue > ALPHA


def test_unused_candidate_slots_are_never_accepted():
    """-1 pads a position with fewer candidates; a candidate of guess 0 (support used up) is not accepted."""
    r = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)
    g = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    u = torch.zeros(1, 3, dtype=torch.float64)
    for cands in ([[-1, -1]], [[0, 1]]):
        assert coupled_bonus(r, g, torch.tensor(cands), u).item() == 0  # from r itself (u = 0: token 0)


def test_bonus_guess_drops_the_drafted_token_and_keeps_the_last_position():
    q = torch.tensor([[[0.5, 0.25, 0.25], [0.2, 0.2, 0.6], [0.1, 0.3, 0.6]]])
    g = bonus_guess(q, torch.tensor([[0, 2]]))
    assert torch.allclose(g[0, 0], torch.tensor([0.0, 0.5, 0.5]))
    assert torch.allclose(g[0, 1], torch.tensor([0.5, 0.5, 0.0]))
    assert torch.equal(g[0, 2], q[0, 2])
    assert bonus_guess(torch.tensor([[[1.0, 0.0], [0.5, 0.5]]]), torch.tensor([[0]]))[0, 0].sum() == 0


def test_a_row_draws_alike_alone_and_in_a_batch_whose_loop_ends_elsewhere():
    """The loop over candidate slots ends once every row has its bonus: a row alone ends at its own first
    acceptance, in a batch at the last row's; the draws must not depend on where (uniforms come up front)."""
    gen = torch.Generator().manual_seed(11)
    rows = 64
    r = torch.stack([_dist(gen) for _ in range(rows)])
    g = torch.stack([_dist(gen, zeros=[i % V]) for i in range(rows)])
    cands = draw_candidates(g, 4, torch.rand(rows, V, generator=gen, dtype=torch.float64))
    cands[::5, 2:] = -1  # rows with fewer candidates
    u = torch.rand(rows, 5, generator=gen, dtype=torch.float64)
    batch = coupled_bonus(r, g, cands, u)
    alone = torch.cat([coupled_bonus(r[i:i + 1], g[i:i + 1], cands[i:i + 1], u[i:i + 1]) for i in range(rows)])
    assert torch.equal(batch, alone)
    assert (batch == cands[:, 0]).any() and not (batch[:, None] == cands).any(1).all()  # both ends are met
