"""Rejection-sampling verification on hand-built cases (exactness in distribution: test_spec_exactness.py)."""
import pytest
import torch

from saguaro_dist.spec import (
    VerifyResult, acceptance_ratios, bonus_probs, emitted_tokens, first_rejection, greedy_tokens, greedy_verify,
    one_hot_probs, residual_probs, target_probs, verify,
)

torch.set_num_threads(1)
V = 6


def _greedy_target(argmaxes):
    """[1, K+1, V] one-hot target rows (what target_probs gives at T = 0)."""
    logits = torch.full((len(argmaxes), V), -1.0)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 3.0
    return target_probs(logits, 0.0, 0, 1.0)[None]


@pytest.mark.parametrize("draft, want_accepted, want_bonus", [
    ([2, 4, 1], 3, 5),   # all accepted: bonus = argmax p_{K+1}
    ([2, 3, 1], 1, 4),   # x_2 != argmax p_2: accept x_1, bonus = argmax p_2
    ([0, 4, 1], 0, 2),   # first token wrong
    ([2, 4, 0], 2, 1),
])
def test_greedy_accept_iff_argmax(draft, want_accepted, want_bonus):
    target = _greedy_target([2, 4, 1, 5])
    draft_tokens = torch.tensor([draft])
    for q in (None, one_hot_probs(draft_tokens, V)):
        out = verify(target, draft_tokens, q, [torch.Generator().manual_seed(0)])
        assert (out.accepted.item(), out.bonus.item()) == (want_accepted, want_bonus)


def test_acceptance_ratios_hand_cases():
    target = torch.zeros(1, 5, 3)
    target[0, :4] = torch.tensor([[0.2, 0.8, 0.0], [0.5, 0.5, 0.0], [0.3, 0.0, 0.7], [0.0, 0.5, 0.5]])
    tokens = torch.tensor([[0, 0, 2, 0]])
    q = torch.tensor([[[0.4, 0.6, 0.0], [0.4, 0.6, 0.0], [0.5, 0.5, 0.0], [0.0, 1.0, 0.0]]])
    # p/q = 0.5; p >= q: 1; q = 0 < p: 1; q = 0 = p: 0 (the target cannot emit it)
    assert torch.allclose(acceptance_ratios(target, tokens, q), torch.tensor([[0.5, 1.0, 1.0, 0.0]]))
    assert torch.allclose(acceptance_ratios(target, tokens, None), torch.tensor([[0.2, 0.5, 0.7, 0.0]]))


def test_first_rejection_counts_leading_accepts():
    ratios = torch.tensor([[1.0, 0.5, 1.0], [0.2, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    u = torch.tensor([[0.9, 0.4, 0.9], [0.3, 0.0, 0.0], [0.99, 0.99, 0.99], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert first_rejection(ratios, u).tolist() == [3, 0, 3, 0]
    u[0, 1] = 0.6
    assert first_rejection(ratios, u)[0] == 1


def test_residual_probs():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.2, 0.5, 0.3], [0.2, 0.3, 0.5]])
    assert torch.allclose(residual_probs(p, q), torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]]))


def test_bonus_probs_picks_residual_or_last_position():
    target = torch.tensor([[[0.5, 0.5, 0.0], [0.1, 0.1, 0.8], [0.0, 0.0, 1.0]]] * 2)
    tokens = torch.tensor([[0, 2]] * 2)
    out = bonus_probs(target, tokens, None, torch.tensor([0, 2]))
    assert torch.allclose(out, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))


def test_certain_acceptance_and_rejection_with_soft_distributions():
    p = torch.tensor([[[0.6, 0.4, 0.0], [0.5, 0.5, 0.0], [0.2, 0.2, 0.6]]])
    q = torch.tensor([[[0.6, 0.4, 0.0], [0.0, 0.0, 1.0]]])  # x_1 = 0 always accepted, x_2 = 2 never
    gens = [torch.Generator().manual_seed(s) for s in range(200)]
    out = verify(p.expand(200, -1, -1), torch.tensor([[0, 2]] * 200), q.expand(200, -1, -1), gens)
    assert out.accepted.eq(1).all()
    assert set(out.bonus.tolist()) == {0, 1}  # residual = p_2 (q_2 puts no mass on 0 or 1)


def test_seeded_rows_reproducible_regardless_of_batch():
    gen = torch.Generator().manual_seed(5)
    b, k = 7, 3
    target = torch.softmax(torch.randn(b, k + 1, 30, generator=gen), dim=-1)
    q = torch.softmax(torch.randn(b, k, 30, generator=gen), dim=-1)
    tokens = torch.multinomial(q.reshape(-1, 30), 1, generator=gen).reshape(b, k)
    seeds = [11, 12, 13, 14, 15, 16, 17]
    full = verify(target, tokens, q, [torch.Generator().manual_seed(s) for s in seeds])
    order = [4, 1, 6]
    part = verify(target[order], tokens[order], q[order], [torch.Generator().manual_seed(seeds[i]) for i in order])
    assert full.accepted[order].tolist() == part.accepted.tolist()
    assert full.bonus[order].tolist() == part.bonus.tolist()


def test_shape_check_and_emitted_tokens():
    with pytest.raises(ValueError):
        verify(torch.ones(1, 2, 4) / 4, torch.tensor([[0, 1]]), None)
    result = VerifyResult(accepted=torch.tensor([0, 2, 1]), bonus=torch.tensor([9, 8, 7]))
    assert emitted_tokens(torch.tensor([[1, 2], [3, 4], [5, 6]]), result) == [[9], [3, 4, 8], [5, 7]]


def test_greedy_target_with_sampled_draft_emits_the_argmax_chain():
    gen = torch.Generator().manual_seed(2)
    b, chain = 500, [2, 4, 1]
    target = _greedy_target(chain).expand(b, -1, -1)
    q = torch.softmax(torch.randn(b, 2, V, generator=gen), dim=-1)
    tokens = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(b, 2)
    out = verify(target, tokens, q, [torch.Generator().manual_seed(i) for i in range(b)])
    for emitted in emitted_tokens(tokens, out):
        assert emitted == chain[:len(emitted)]
    assert set(out.accepted.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("q_kind", ["one-hot", "uniform", "random"])
def test_greedy_verify_gives_the_tokens_verify_gives(q_kind):
    """The engine's greedy fast path against the general verifier on the one-hot p, for every q a
    proposal can carry (draft argmax / n-gram: one-hot; random fallback: uniform; a sampled draft),
    with tied logits and half-precision logits among the rows."""
    gen = torch.Generator().manual_seed(3)
    b, k = 400, 3
    logits = torch.randint(0, 4, (b, k + 1, V), generator=gen).float()  # small integers: many ties
    logits[: b // 2] = torch.randn(b // 2, k + 1, V, generator=gen)
    best = greedy_tokens(logits)
    # drafts that match the argmax chain for a random number of leading positions, then anything
    tokens = torch.where(torch.rand(b, k, generator=gen) < 0.7, best[:, :k], torch.randint(0, V, (b, k), generator=gen))
    q = {"one-hot": None, "uniform": torch.full((b, k, V), 1.0 / V),
         "random": torch.softmax(torch.randn(b, k, V, generator=gen), dim=-1)}[q_kind]
    p = target_probs(logits.flatten(0, 1), 0.0, 0, 1.0).view(b, k + 1, V)
    want = verify(p, tokens, q, [torch.Generator().manual_seed(i) for i in range(b)])
    got = greedy_verify(logits, tokens)
    assert torch.equal(got.accepted, want.accepted) and torch.equal(got.bonus, want.bonus)
    assert set(got.accepted.tolist()) == set(range(k + 1))
    half = greedy_verify(logits.to(torch.bfloat16), tokens)  # exact up-cast: the same argmax as target_probs'
    want_half = verify(target_probs(logits.to(torch.bfloat16).flatten(0, 1), 0.0, 0, 1.0).view(b, k + 1, V), tokens, q)
    assert torch.equal(half.accepted, want_half.accepted) and torch.equal(half.bonus, want_half.bonus)
