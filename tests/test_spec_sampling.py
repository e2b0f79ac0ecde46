"""Sampling distributions (plain settings, Saguaro sigma_{F,C}) and per-row-generator draws."""
import math

import pytest
import torch

from saguaro_dist.spec import (
    one_hot_probs, row_uniforms, saguaro_probs, sample, sample_with_uniforms, target_probs, top_f_mask, top_k_proposal,
)
from saguaro_dist.spec.sampling import sort_descending

torch.set_num_threads(1)


def _logits(probs):
    return torch.tensor(probs, dtype=torch.float64).log()[None]


def test_greedy_rows_are_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    p = target_probs(logits, [0.0, 0.0], [2, 0], [0.5, 1.0])
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_without_filters_is_tempered_softmax():
    logits = torch.randn(3, 7, dtype=torch.float64)
    p = target_probs(logits, [1.0, 0.5, 2.0], [0, 0, 0], [1.0, 1.0, 1.0])
    want = torch.softmax(logits / torch.tensor([[1.0], [0.5], [2.0]], dtype=torch.float64), dim=-1)
    assert torch.allclose(p, want)


def test_top_k_keeps_k_tokens_renormalised():
    p = target_probs(_logits([0.1, 0.4, 0.2, 0.3]), 1.0, 2, 1.0)
    assert torch.allclose(p, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]], dtype=torch.float64))


@pytest.mark.parametrize("top_p, want", [
    (0.75, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),   # mass before 0.15 is 0.8 >= 0.75: cut there
    (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    (0.3, [1.0, 0.0, 0.0, 0.0]),                # the first token always stays
])
def test_top_p_hand_cases(top_p, want):
    p = target_probs(_logits([0.5, 0.3, 0.15, 0.05]), 1.0, 0, top_p)
    assert torch.allclose(p, torch.tensor([want], dtype=torch.float64))


@pytest.mark.parametrize("min_p, want", [
    (0.5, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),   # 0.15 < 0.5 x 0.5: dropped; 0.3 >= 0.25 stays
    (0.3, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # 0.15 >= 0.15 stays (the rule is "below")
    (1.0, [1.0, 0.0, 0.0, 0.0]),              # only the likeliest
    (0.0, [0.5, 0.3, 0.15, 0.05]),            # off
])
def test_min_p_hand_cases(min_p, want):
    p = target_probs(_logits([0.5, 0.3, 0.15, 0.05]), 1.0, 0, 1.0, min_p)
    assert torch.allclose(p, torch.tensor([want], dtype=torch.float64))


def test_min_p_applies_to_the_tempered_distribution_before_top_k_and_top_p():
    """vLLM's order: temperature, min-p, then top-k / top-p on what min-p left. At T = 0.5 the
    probabilities [0.5, 0.3, 0.15, 0.05] sharpen to [25, 9, 2.25, 0.25] / 36.5, so min_p = 0.2 (threshold
    5 / 36.5) drops the last two, which min_p on the untempered row would have kept; top_p = 0.7 then cuts
    [25, 9] / 34 after the first (0.735 >= 0.7)."""
    tempered = target_probs(_logits([0.5, 0.3, 0.15, 0.05]), 0.5, 0, 1.0, 0.2)
    assert torch.allclose(tempered, torch.tensor([[25 / 34, 9 / 34, 0.0, 0.0]], dtype=torch.float64))
    both = target_probs(_logits([0.5, 0.3, 0.15, 0.05]), 0.5, 0, 0.7, 0.2)
    assert torch.equal(both, torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64))


def test_min_p_is_per_row_and_leaves_greedy_rows_alone():
    logits = torch.randn(3, 50)
    p = target_probs(logits, [1.0, 1.0, 0.0], 0, 1.0, [0.0, 0.9, 0.9])
    assert bool((p[0] > 0).all()) and 1 <= int((p[1] > 0).sum()) < 50
    assert p[2].argmax() == logits[2].argmax() and p[2].max() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sort_descending_is_torchs_stable_sort(dtype):
    """The keyed integer sort of float32 rows orders exactly as torch's stable sort: ties (many equal
    logits, +0.0 beside -0.0, rows of -inf) keep the lower token id first."""
    torch.manual_seed(0)
    x = (torch.randn(8, 301) * 5).to(dtype)
    x[0, :40] = 1.5
    x[1, 3], x[1, 4], x[1, 200] = -0.0, 0.0, -0.0
    x[2] = float("-inf")
    x[3, ::2] = float("-inf")
    x[4] = x[4].round()  # many ties among small integers
    x[5, 7], x[5, 8] = torch.finfo(dtype).max, torch.finfo(dtype).tiny
    got, want = sort_descending(x), x.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_top_p_tie_at_the_cut_keeps_the_lower_id_in_float32():
    # Tokens 1 and 2 tie at 0.366 each; top_p = 0.3 is reached by the first of them: only the lower id stays.
    p = target_probs(torch.tensor([[0.0, 1.0, 1.0, 0.0]]), 1.0, 0, 0.3)
    assert p[0, 1] == 1.0 and p.sum() == 1.0


def test_top_p_applies_to_the_renormalised_top_k_distribution():
    # top-2 gives [0.625, 0.375]; top_p = 0.6 then keeps only the first (0.625 >= 0.6)
    p = target_probs(_logits([0.5, 0.3, 0.15, 0.05]), 1.0, 2, 0.6)
    assert torch.equal(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64))


def test_top_p_one_keeps_tiny_tokens():
    logits = torch.tensor([[30.0, 0.0, -5.0, 1.0]])
    assert bool((target_probs(logits, 1.0, 0, 1.0) > 0).all())
    assert bool((target_probs(logits, 1.0, 3, 1.0) > 0).sum() == 3)


def test_per_row_settings_match_row_by_row():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=gen)
    t, k, p = [0.0, 0.7, 1.0, 1.3, 0.9], [0, 3, 0, 5, 11], [1.0, 0.9, 0.5, 1.0, 0.8]
    batched = target_probs(logits, t, k, p)
    for i in range(5):
        assert torch.allclose(batched[i], target_probs(logits[i:i + 1], t[i], k[i], p[i])[0])
    assert torch.allclose(batched.sum(-1), torch.ones(5))


def test_saguaro_hand_case_and_identity():
    z = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    assert torch.allclose(saguaro_probs(z, 1, 0.5), torch.tensor([[0.25, 0.3, 0.2]], dtype=torch.float64) / 0.75)
    assert torch.allclose(saguaro_probs(z, 2, 0.0), torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64))
    assert saguaro_probs(z, 2, 1.0) is z
    assert torch.equal(saguaro_probs(z, 0, 0.3), z)


def test_saguaro_c_zero_with_all_mass_in_top_f_returns_z():
    z = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0]])
    assert torch.equal(saguaro_probs(z, 2, 0.0), z)
    # ...which is the C -> 0 limit of sigma
    assert torch.allclose(saguaro_probs(z, 2, 1e-9), z)


def test_saguaro_c_zero_with_a_tail_too_small_to_divide_by_returns_a_distribution():
    """C = 0 on a peaked row whose mass outside the top F is below float32's least normal (~1e-40): the clamp
    divided by that least normal instead, so the row summed to ~0.08 (a q no verifier should take; the gRPC
    codec refuses it, costing a fallback a round). Now such a row goes unchanged, as a zero tail's does."""
    z = torch.zeros(1, 1000)
    z[0, :4] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    z[0, 4:] = 1e-43  # a float32 denormal: the tail's mass ~1e-40
    out = saguaro_probs(z, 4, 0.0)
    assert abs(float(out.sum()) - 1) < 1e-6 and torch.equal(out, z)
    assert torch.allclose(saguaro_probs(z.double(), 4, 0.0).sum(), torch.tensor(1.0, dtype=torch.float64))


def test_saguaro_per_row_top_f():
    z = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 2)
    out = saguaro_probs(z, torch.tensor([1, 3]), 0.5)
    assert torch.allclose(out[0], torch.tensor([0.2, 0.3, 0.2, 0.1]) / 0.8)
    assert torch.allclose(out[1], torch.tensor([0.2, 0.15, 0.1, 0.1]) / 0.55)
    assert torch.equal(top_f_mask(z, torch.tensor([0, 4])), torch.tensor([[False] * 4, [True] * 4]))
    with pytest.raises(ValueError):
        saguaro_probs(z, 1, 1.5)


def test_sample_never_draws_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(4000, -1)
    tokens = sample(probs)
    assert set(tokens.tolist()) == {1, 3}
    # u rounding up to the total lands on the last positive token, not on a trailing zero
    assert sample_with_uniforms(probs[:1], torch.tensor([1.0 - 1e-17])).item() == 3
    mixed = torch.tensor([[0.2, 0.8, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.3, 0.7, 0.0]])
    assert sample_with_uniforms(mixed, torch.tensor([1.0, 0.1, 1.0])).tolist() == [1, 1, 3]


def test_sample_frequencies_roughly_match():
    torch.manual_seed(0)
    probs = torch.tensor([[0.1, 0.2, 0.7]]).expand(20000, -1)
    freq = torch.bincount(sample(probs), minlength=3) / 20000
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.7]), atol=0.02)


def test_seeded_rows_reproducible_regardless_of_batch():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(6, 50, generator=gen), dim=-1)
    alone = sample(probs[2:3], [torch.Generator().manual_seed(7)])
    gens = [torch.Generator().manual_seed(s) for s in (3, 4)] + [torch.Generator().manual_seed(7), None, None, None]
    batched = sample(probs, gens)
    assert batched[2] == alone[0]
    u1 = row_uniforms([torch.Generator().manual_seed(9)], 1, 4)
    u2 = row_uniforms([None, torch.Generator().manual_seed(9)], 2, 4)
    assert torch.equal(u1[0], u2[1])


def test_generator_count_must_match_rows():
    with pytest.raises(ValueError):
        sample(torch.ones(3, 4) / 4, [None, None])


def test_one_hot_probs():
    q = one_hot_probs(torch.tensor([[1, 0]]), 3)
    assert q.shape == (1, 2, 3) and q.dtype == torch.float32
    assert math.isclose(float(q.sum()), 2.0)


def test_rows_sharing_a_generator_take_consecutive_draws():
    g = torch.Generator().manual_seed(4)
    u = row_uniforms([g, None, g], 3, 2)
    want = torch.rand((2, 2), generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert torch.equal(u[[0, 2]], want)
    assert not torch.equal(u[0], u[2])
    # Every row on one generator (a tree's branches) takes the one-group path: still consecutive draws,
    # the same numbers as those rows among others'.
    alone = row_uniforms([torch.Generator().manual_seed(4)] * 2, 2, 2)
    assert torch.equal(alone, want)


def test_row_uniforms_of_no_rows_and_of_interleaved_generators():
    """No rows: an empty [0, m] (a verify of an empty batch). Interleaved generators: each row its own
    generator's next draws, whatever the order of the rows."""
    assert row_uniforms([], 0, 3).shape == (0, 3)
    a, b = (torch.Generator().manual_seed(s) for s in (1, 2))
    u = row_uniforms([a, b, a, b], 4, 2)
    want_a, want_b = (torch.rand((2, 2), generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in (1, 2))
    assert torch.equal(u[[0, 2]], want_a) and torch.equal(u[[1, 3]], want_b)


def test_tempered_only_rows_get_target_probs_own_bits():
    from saguaro_dist.engine.messages import DraftSampling
    from saguaro_dist.engine.target import RowSampling, sampling_probs
    logits = torch.randn(12, 2048, generator=torch.Generator().manual_seed(5)) * 4
    plain = [DraftSampling(0.7, 0, 1.0, 1), DraftSampling(1.3, 0, 1.0, 2)]
    rows = RowSampling.of(plain, rows_per_seq=6)
    assert rows.tempered_only
    want = target_probs(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p)
    assert torch.equal(sampling_probs(logits, rows), want)
    filtered = [DraftSampling(0.0, 0, 1.0, 1), DraftSampling(0.7, 5, 1.0, 1), DraftSampling(0.7, 0, 0.9, 1),
                DraftSampling(0.7, 0, 1.0, 1, min_p=0.1)]
    for other in filtered:  # one greedy or filtered sequence among tempered ones: target_probs decides
        assert not RowSampling.of(plain + [other]).tempered_only


def test_row_sampling_lives_on_the_logits_device():
    """The tempered-only draw divides by rows.temperature directly: built for another device, every
    T > 0 sample on a GPU failed (session 64, an H200). The meta device stands in for one here."""
    from saguaro_dist.engine.messages import DraftSampling
    from saguaro_dist.engine.target import RowSampling, sampling_probs
    plain = [DraftSampling(0.7, 0, 1.0, 1), DraftSampling(1.3, 5, 1.0, 2)]
    rows = [RowSampling.of(settings, "meta", rows_per_seq=3) for settings in (plain[:1], plain)]
    assert all({t.device.type for t in (r.temperature, r.top_k, r.top_p, r.min_p)} == {"meta"} for r in rows)
    assert rows[0].tempered_only  # (target_probs, which the other takes, moves them itself)
    assert sampling_probs(torch.empty(3, 16, device="meta"), rows[0]).device.type == "meta"


def test_greedy_tokens_is_torch_argmax_on_every_layout():
    """The CPU numpy path picks what torch.argmax picks: the first maximum among ties, the first NaN,
    -0.0 equal to 0.0; on 1-D, 3-D, strided, half-precision (up-cast) and float64 (torch's own) input."""
    from saguaro_dist.spec import greedy_tokens
    gen = torch.Generator().manual_seed(5)
    ties = torch.randint(0, 3, (64, 7, 50), generator=gen).float()  # many ties per row
    ties[0, 0, 3], ties[1, 0, :2], ties[2, 0, 9] = float("nan"), torch.tensor([-0.0, 0.0]), float("-inf")
    ties[1, 0, 2:] = -1.0
    cases = [ties, ties[:, :, ::2], ties[0, 0], ties.transpose(0, 1), ties.to(torch.bfloat16), ties.double(),
             torch.randn(12, 2048, generator=gen), torch.empty(0, 9), torch.randn(3, 9, requires_grad=True)]
    for x in cases:
        got = greedy_tokens(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.float().argmax(dim=-1) if x.dtype != torch.double else x.argmax(-1)), x.shape


def test_top_k_proposal_keeps_each_rows_k_likeliest_renormalised():
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    kept = top_k_proposal(probs, 2)
    assert torch.allclose(kept, torch.tensor([[0.0, 0.625, 0.375, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0] * 4]))
    assert top_k_proposal(probs, 0) is probs and top_k_proposal(probs, 4) is probs  # off, and nothing to cut


def test_a_tiny_temperature_samples_the_argmax_not_the_last_token():
    """logits / T overflowed float32 to inf at T = 1e-40: softmax gave NaN, and sample_with_uniforms' off-the-end
    fallback then returned the last token id every time, on the plain path and every speculative one alike.
    A temperature under GREEDY_BELOW is greedy now (vLLM's rule); the T -> 0 limit is the argmax."""
    from saguaro_dist import SamplingParams
    logits = torch.tensor([[2.0, 1.0, 3.0, -1.0]])
    for tiny in (1e-40, 1e-6):
        params = SamplingParams(temperature=tiny)
        assert params.temperature == 0.0 and params.greedy
        probs = target_probs(logits, params.temperature, 0, 1.0)
        assert torch.isfinite(probs).all(), probs
        assert sample_with_uniforms(probs, torch.tensor([0.5])).item() == 2
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_a_rows_probabilities_do_not_depend_on_its_batch_mates_settings():
    """Bit for bit: a seed fixes a row's uniforms, and its p must not move with what the other rows ask for
    (the sorted path's renormalising once ran every row of a batch where any row had top-k or top-p)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 2048, generator=gen) * 3
    temperature, top_k, top_p = torch.tensor([0.7, 0.7, 1.0, 0.7]), torch.tensor([0, 50, 0, 0]), torch.tensor([1.0, 1.0, 0.9, 1.0])
    together = target_probs(logits, temperature, top_k, top_p)
    for r in range(4):
        alone = target_probs(logits[r:r + 1], temperature[r:r + 1], top_k[r:r + 1], top_p[r:r + 1])
        assert torch.equal(together[r], alone[0]), r
