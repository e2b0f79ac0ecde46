"""Statistical exactness of verify: the emitted tokens follow the target, for any proposal q.

A toy language over V = 5 tokens: the target's and the draft's next-token distributions depend on
the whole history (tables indexed by it). Each of B rows runs round 1 (draft K tokens, verify); the
first output token is x_1 if accepted, else the bonus. The second is x_2, or the bonus, or (after a
rejection at x_1) the first output of a round 2 from the new prefix. Their joint must be
p(y1) p(y2 | y1): a chi-square test with false-alarm rate ALPHA, and B large enough to detect, with
power 0.9, a 1% probability shift between the two likeliest first tokens. The same test must flag
broken verifiers (always accept; bonus from p instead of the residual; accept by argmax at T > 0;
verifying Saguaro draws against the unscaled q).
"""
import pytest
import scipy.stats
import torch

from saguaro_dist.spec import VerifyResult, acceptance_ratios, first_rejection, saguaro_probs, sample, target_probs, verify

torch.set_num_threads(1)

V = 5
B = 65536
ALPHA = 1e-3
SHIFT = 0.01  # smallest error the test must catch
TARGET = dict(temperature=0.9, top_k=4, top_p=0.9)  # leaves zero-probability cells


# ---- broken verifiers (tests only) ---------------------------------------------------------------

def _always_accept(target, tokens, q, generators):
    k = tokens.shape[1]
    return VerifyResult(accepted=torch.full((tokens.shape[0],), k), bonus=sample(target[:, k], generators))


def _bonus_from_p(target, tokens, q, generators):
    accepted = first_rejection(acceptance_ratios(target, tokens, q), torch.rand(tokens.shape, dtype=torch.float64))
    return VerifyResult(accepted=accepted, bonus=sample(target[torch.arange(len(accepted)), accepted], generators))


def _argmax_accept(target, tokens, q, generators):
    """The reference engine's fast-backup shortcut: accept x_i iff it is the target's argmax."""
    k = tokens.shape[1]
    ratios = (target[:, :k].argmax(-1) == tokens).to(torch.float32)
    accepted = first_rejection(ratios, torch.zeros(tokens.shape, dtype=torch.float64))
    return VerifyResult(accepted=accepted, bonus=sample(target[torch.arange(len(accepted)), accepted], generators))


# ---- the toy language ------------------------------------------------------------------------------

def _tables(gen, depth, settings, noise_from=None):
    """Conditional next-token distributions for histories of length 0..depth: [V]*L + [V] each.
    settings: target_probs kwargs, or None for the raw logits (the draft's own z built from them)."""
    logits = {}
    for length in range(depth + 1):
        base = torch.randn((V,) * length + (V,), generator=gen, dtype=torch.float64)
        logits[length] = base if noise_from is None else noise_from[length] + 0.8 * base
    if settings is None:
        return logits
    return {n: target_probs(l.reshape(-1, V), **settings).reshape(l.shape) for n, l in logits.items()}


def _cond(table, hist):
    """Rows table[h_1, .., h_L] for histories hist [N, L]."""
    length = hist.shape[1]
    flat = torch.zeros(hist.shape[0], dtype=torch.int64)
    for j in range(length):
        flat = flat * V + hist[:, j]
    return table[length].reshape(-1, V)[flat]


def _draft(kind, z_tables):
    """(sample_from(hist) -> probs, verify_q(hist) -> probs, or None for an argmax proposal)."""
    soft = {n: torch.softmax(l, -1) for n, l in z_tables.items()}
    topk = {n: target_probs(l.reshape(-1, V), 1.2, 3, 1.0).reshape(l.shape) for n, l in z_tables.items()}
    sag = lambda h: saguaro_probs(_cond(soft, h), 2, 0.3)  # noqa: E731
    return {
        "random_q": (lambda h: _cond(soft, h), lambda h: _cond(soft, h)),
        "top_k_q": (lambda h: _cond(topk, h), lambda h: _cond(topk, h)),  # q = 0 where p > 0
        "saguaro_q": (sag, sag),
        "saguaro_wrong_q": (sag, lambda h: _cond(soft, h)),  # sampled sigma(z), verified against z
        "deterministic": (lambda h: _cond(soft, h), None),   # argmax proposal, q = one-hot (None)
    }[kind]


def _round(hist, k, p_tables, kind, z_tables, verifier):
    """One SD round for every row of hist [N, L]: returns (draft tokens [N, K], VerifyResult)."""
    sample_from, verify_q = _draft(kind, z_tables)
    tokens, qs = torch.zeros(hist.shape[0], 0, dtype=torch.int64), []
    for _ in range(k):
        h = torch.cat([hist, tokens], dim=1)
        x = sample_from(h).argmax(-1) if verify_q is None else sample(sample_from(h))
        if verify_q is not None:
            qs.append(verify_q(h))
        tokens = torch.cat([tokens, x[:, None]], dim=1)
    target = torch.stack([_cond(p_tables, torch.cat([hist, tokens[:, :j]], 1)) for j in range(k + 1)], dim=1)
    return tokens, verifier(target, tokens, torch.stack(qs, 1) if qs else None, None)


def _first_two_tokens(k, kind, verifier, seed):
    """Simulate B rows; returns (y1 [B], y2 [B], the target's joint [V, V])."""
    gen = torch.Generator().manual_seed(seed)
    z_tables = _tables(gen, k + 1, None)  # round 2 conditions on up to 1 + K tokens
    p_tables = _tables(gen, k + 1, TARGET, noise_from=z_tables)
    torch.manual_seed(seed)  # the draws below use the default generator (the vectorised path)
    tokens, out = _round(torch.zeros(B, 0, dtype=torch.int64), k, p_tables, kind, z_tables, verifier)
    y1 = torch.where(out.accepted >= 1, tokens[:, 0], out.bonus)
    y2 = torch.where(out.accepted >= 2, tokens[:, 1], out.bonus)
    rejected = (out.accepted == 0).nonzero().squeeze(-1)
    tokens2, out2 = _round(y1[rejected, None], k, p_tables, kind, z_tables, verifier)
    y2[rejected] = torch.where(out2.accepted >= 1, tokens2[:, 0], out2.bonus)
    joint = p_tables[0][:, None] * p_tables[1]
    return y1, y2, joint


def _chi2_pvalue(counts, probs):
    """Chi-square goodness of fit over the cells with probs > 0; cells with probs = 0 must be empty."""
    counts, probs = counts.double().reshape(-1), probs.double().reshape(-1)
    zero = probs <= 0
    if counts[zero].sum() > 0:
        return 0.0
    if int((~zero).sum()) == 1:  # one possible cell holding every count: a perfect fit (df = 0)
        return 1.0
    expected = probs[~zero] / probs[~zero].sum() * counts.sum()
    return float(scipy.stats.chisquare(counts[~zero].numpy(), expected.numpy()).pvalue)


def _pvalues(k, kind, verifier, seed=0):
    y1, y2, joint = _first_two_tokens(k, kind, verifier, seed)
    marginal = _chi2_pvalue(torch.bincount(y1, minlength=V), joint.sum(1))
    pairs = _chi2_pvalue(torch.bincount(y1 * V + y2, minlength=V * V), joint)
    return marginal, pairs


@pytest.mark.parametrize("probs", [
    [0.5, 0.5, 0.0, 0.0, 0.0],
    [0.45, 0.45, 0.04, 0.03, 0.03],  # two big cells and the most degrees of freedom: the hard case
    [0.6, 0.2, 0.1, 0.1, 0.0],
])
def test_sample_size_detects_a_one_percent_shift(probs):
    """Power >= 0.9 of the marginal test against moving SHIFT of mass between the two likeliest first
    tokens: noncentrality = B * SHIFT^2 (1/p_a + 1/p_b)."""
    probs = torch.tensor(probs, dtype=torch.float64)
    top = probs.topk(2).values
    lam = B * SHIFT ** 2 * float(1 / top[0] + 1 / top[1])
    df = int((probs > 0).sum()) - 1
    crit = scipy.stats.chi2.ppf(1 - ALPHA, df)
    assert scipy.stats.ncx2.sf(crit, df, lam) >= 0.9


@pytest.mark.parametrize("kind", ["random_q", "top_k_q", "saguaro_q", "deterministic"])
@pytest.mark.parametrize("k", [2, 3])
def test_verify_is_exact(k, kind):
    marginal, pairs = _pvalues(k, kind, verify)
    assert marginal > ALPHA and pairs > ALPHA, (marginal, pairs)


@pytest.mark.parametrize("kind", ["random_q", "saguaro_q"])
@pytest.mark.parametrize("broken", [_always_accept, _bonus_from_p, _argmax_accept])
def test_broken_verifiers_are_caught(broken, kind):
    marginal, pairs = _pvalues(2, kind, broken)
    assert min(marginal, pairs) < ALPHA, (marginal, pairs)


def test_saguaro_draws_need_the_saguaro_q():
    marginal, pairs = _pvalues(2, "saguaro_wrong_q", verify)
    assert min(marginal, pairs) < ALPHA, (marginal, pairs)
