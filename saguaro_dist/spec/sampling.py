"""Sampling distributions and draws: plain sampling settings, Saguaro sampling, per-row generators.

Every distribution here is exactly what gets sampled from: the verifier must be handed the same
tensor as q that the draft drew its token from, or losslessness is gone.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

Generators = Sequence[torch.Generator | None] | None


def _float(x: torch.Tensor) -> torch.Tensor:
    """At least float32: half-precision softmax/cumsum is too coarse for acceptance ratios."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _per_row(value, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A scalar, list or tensor of per-row settings as a [n] tensor."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    return t.expand(n).contiguous() if t.dim() == 0 else t


def _filter_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities over descending-sorted logits after top-k then top-p.

    keep_k(j) = j < k (k = 0: all); p' = softmax(logits | keep_k);
    keep_p(j) = sum_{i<j} p'(i) < top_p, or j = 0 (top_p >= 1: all);
    result = norm(p' * keep_p).
    The first token stays by rank, not by the comparison: a top_p under float32's smallest (1e-46) is 0
    here, and 0 < 0 dropped every token (NaN probabilities, the last token id drawn).
    """
    v = sorted_logits.shape[-1]
    rank = torch.arange(v, device=sorted_logits.device)
    k_eff = torch.where(top_k > 0, top_k.clamp(max=v), v)
    masked = sorted_logits.masked_fill(rank[None, :] >= k_eff[:, None], float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0) | (rank[None, :] == 0)
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [N, V] of tempered logits after top-k then top-p (_filter_sorted), in vocabulary order."""
    sorted_logits, order = sort_descending(scaled)
    return torch.empty_like(scaled).scatter_(1, order, _filter_sorted(sorted_logits, top_k, top_p))


def _min_p_filter(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min-p on tempered logits [N, V]: a token whose probability is below min_p times its row's
    largest is dropped, keep(j) = softmax(scaled)(j) >= min_p * max_i softmax(scaled)(i) (min_p = 0:
    all). The likeliest token always stays, so greedy choices never change."""
    probs = torch.softmax(scaled, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return scaled.masked_fill(probs < threshold, float("-inf"))


def sort_descending(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x.sort(dim=-1, descending=True, stable=True): ties keep the lower index first. x [N, V].

    A float32 CPU row sorts as unique int64 keys (the float's bits mapped to an order-preserving int,
    negated for descending, in the high half; the index in the low half): numpy's vectorised
    (AVX-512) integer sort of those is ~10x torch's stable float sort (V = 2048: 12 rows 0.11 vs
    1.13 ms), and unique keys make stability free. -0.0 is folded into +0.0 first (equal floats,
    equal keys). Other dtypes and devices take torch's sort.
    """
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
        return x.sort(dim=-1, descending=True, stable=True)
    bits = (x + 0.0).numpy().view(np.int32).astype(np.int64)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)               # int order == float order (no NaN)
    keys = (~ordered << 32) | np.arange(x.shape[-1], dtype=np.int64)  # value descending, then index
    keys.sort(axis=-1)
    order = torch.from_numpy(keys & 0xFFFFFFFF)
    return x.gather(-1, order), order


def target_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p=0.0) -> torch.Tensor:
    """The distribution plain sampling draws from, per row (used for the target and the draft alike).

    T = 0: one_hot(argmax logits). Otherwise p = norm(top_p(top_k(min_p(softmax(logits / T))))), vLLM's
    order: min-p on the tempered distribution, then top-k, then the smallest prefix (by descending
    probability) of the renormalised top-k distribution whose mass reaches top_p, renormalised. Ties at
    a cut-off are broken by a stable sort (lower token id first).

    logits [N, V]; temperature [N] float (or scalar); top_k [N] int, 0 = off; top_p [N] float in (0, 1];
    min_p [N] float in [0, 1], 0 = off. Returns probs [N, V] (float32, or float64 for float64 logits).
    """
    logits = _float(logits)
    n, v = logits.shape
    temperature = _per_row(temperature, n, logits.dtype, logits.device)
    top_k = _per_row(top_k, n, torch.int64, logits.device)
    top_p = _per_row(top_p, n, logits.dtype, logits.device)
    min_p = _per_row(min_p, n, logits.dtype, logits.device)
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if bool((min_p > 0).any()):  # one more softmax, only for the batches that ask for it
        scaled = _min_p_filter(scaled, min_p)
    filtered = ((top_k > 0) & (top_k < v)) | (top_p < 1.0)
    if not bool(filtered.any()):  # no filtering on any row: skip the O(V log V) sort
        probs = torch.softmax(scaled, dim=-1)
    elif bool(filtered.all()):
        probs = _top_k_top_p(scaled, top_k, top_p)
    else:  # only those rows: the sorted path's renormalising moved an unfiltered row's last bits, so a seeded row's
        probs = torch.softmax(scaled, dim=-1)  # draw could depend on its batch-mates' settings
        probs[filtered] = _top_k_top_p(scaled[filtered], top_k[filtered], top_p[filtered])
    if not bool(greedy.any()):  # three [N, V] passes saved on the sampled-only batches the draft makes
        return probs
    one_hot = torch.nn.functional.one_hot(greedy_tokens(logits), v).to(probs.dtype)
    return torch.where(greedy[:, None], one_hot, probs)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The token T = 0 picks (where target_probs puts its one-hot): argmax of the logits taken in at
    least float32, ties to the lowest id. logits [..., V] -> tokens [...] int64.

    A float32 CPU tensor takes numpy's vectorised argmax (the same rule: the first maximum, a NaN
    counting as the largest), ~10x torch's at V = 2048: 12 rows (a batch-1 tree's branch step) 61 ->
    6 us, 96 rows 434 -> 23 us."""
    x = _float(logits)
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return x.argmax(dim=-1)
    return torch.from_numpy(np.asarray(np.argmax(x.detach().numpy(), axis=-1), dtype=np.int64))


def one_hot_probs(tokens: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q for a deterministic proposal: q(x) = [x == token]. tokens [...] int64 -> probs [..., V]."""
    return torch.nn.functional.one_hot(tokens, vocab_size).to(dtype)


def top_f_mask(probs: torch.Tensor, top_f) -> torch.Tensor:
    """mask(j) = j is among the top_f most probable tokens of its row (ties: torch.topk's order).

    probs [N, V]; top_f int or [N] int (0 = none). Returns bool [N, V].
    """
    n, v = probs.shape
    top_f = _per_row(top_f, n, torch.int64, probs.device).clamp(0, v)
    f_max = int(top_f.max()) if n else 0
    mask = torch.zeros_like(probs, dtype=torch.bool)
    if f_max == 0:
        return mask
    idx = probs.topk(f_max, dim=-1).indices
    keep = torch.arange(f_max, device=probs.device)[None, :] < top_f[:, None]
    return mask.scatter_(1, idx, keep)


def saguaro_probs(probs: torch.Tensor, top_f, c: float) -> torch.Tensor:
    """Saguaro sampling sigma_{F,C} (Definition 14): the draft's top-F probabilities scaled by C.

    sigma(z)(j) = w(j) z(j) / sum_i w(i) z(i), w(j) = C if j in top-F(z) else 1, C in [0, 1].
    C = 1 or F = 0 is the identity. If sum_i w(i) z(i) = 0 (C = 0 and all of z's mass lies in its
    top F, e.g. a greedy one-hot z), or is too small to divide by (below the dtype's least normal), the row is
    returned unchanged: that is the C -> 0 limit of
    sigma (C z / C), so the function stays continuous and always returns a distribution.

    probs [N, V]; top_f int or [N] int; returns probs [N, V]. This is both the distribution the
    draft samples from and the q the verifier must be given.
    """
    if not 0.0 <= c <= 1.0:
        raise ValueError(f"c must be in [0, 1], got {c!r}")
    if c == 1.0:
        return probs
    scaled = torch.where(top_f_mask(probs, top_f), probs * c, probs)
    total = scaled.sum(dim=-1, keepdim=True)
    # A mass below the dtype's least normal number (C = 0, the tail of a very peaked row: ~1e-40) divides as
    # badly as zero does (clamped, the row summed to 0.08): the row goes unchanged, as at 0.
    tiny = torch.finfo(total.dtype).tiny
    return torch.where(total >= tiny, scaled / total.clamp_min(tiny), probs)


def top_k_proposal(probs: torch.Tensor, k: int) -> torch.Tensor:
    """The draft's proposal kept to each row's k likeliest tokens, renormalised (k = 0: unchanged).

    Speculative sampling is exact for any proposal q the verifier is given (Leviathan et al., Theorem 1):
    truncating q costs only the acceptance of the tail's mass, and makes q sparse, so a tree's
    distributions travel as B * K * k (id, prob) pairs instead of B * K * V floats (Llama 3's V = 128256:
    24.6 MB of fp32 a tree of B = 12, K = 4). probs [N, V] -> [N, V], rows summing to 1 (all-zero rows stay).
    """
    if k <= 0 or k >= probs.shape[-1]:
        return probs
    top = probs.topk(k, dim=-1)
    kept = torch.zeros_like(probs).scatter_(-1, top.indices, top.values)
    total = kept.sum(dim=-1, keepdim=True)
    return kept / total.clamp_min(torch.finfo(total.dtype).tiny)


def row_uniforms(generators: Generators, n: int, m: int, device=None) -> torch.Tensor:
    """[n, m] float64 uniforms in [0, 1); row i comes from generators[i] alone (None: the default
    generator of `device`), so a seeded row draws the same numbers whatever else is in the batch.
    Rows sharing one generator object (a sequence's branches) take consecutive draws in row order."""
    gens = list(generators) if generators is not None else [None] * n
    if len(gens) != n:
        raise ValueError(f"need one generator (or None) per row: {n} rows, {len(gens)} generators")
    if not n or all(g is gens[0] for g in gens):  # one group (a tree's branches): the same draws, no row scatter
        return _uniforms(gens[0] if n else None, n, m, device)
    if len(set(map(id, gens))) == n and all(g is not None and g.device.type == "cpu" for g in gens):
        # Every row its own CPU generator (seeded requests): each draws its m numbers straight into its row,
        # and the batch moves once (per-row tensors and a cat cost ~2x, 64 rows a round). uniform_ is what
        # torch.rand(out=) runs after its checks (the same numbers), at two thirds of its ~9 us a row.
        out = torch.empty((n, m), dtype=torch.float64)
        for g, row in zip(gens, out.unbind(0)):
            row.uniform_(generator=g)
        return out.to(device)
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for i, g in enumerate(gens):
        groups.setdefault(id(g), (g, []))[1].append(i)
    # One draw per group, concatenated, then one scatter back to row order where the groups interleave
    # (a scatter per group cost ~25 us a row: seeded batches of 64 spent 1.8 ms a round here).
    blocks = _group_blocks(list(groups.values()), n, m, device)
    order = [i for _, rows in groups.values() for i in rows]  # blocks' row j is row order[j]
    if order == list(range(n)):
        return blocks
    out = torch.empty_like(blocks)
    out[torch.tensor(order, device=blocks.device)] = blocks
    return out


def _group_blocks(groups: list[tuple[torch.Generator | None, list[int]]], n: int, m: int, device) -> torch.Tensor:
    """[n, m]: each group's len(rows) x m draws from its generator, one block after another. CPU generators
    fill their block of one tensor in place (torch.rand's numbers: a block is contiguous, filled in order),
    without a tensor and a cat input per group (a tree's rows: ~64 groups a step)."""
    if not all(g is not None and g.device.type == "cpu" for g, _ in groups):
        return torch.cat([_uniforms(g, len(rows), m, device) for g, rows in groups])
    out, lo = torch.empty((n, m), dtype=torch.float64), 0
    for g, rows in groups:
        out[lo:lo + len(rows)].uniform_(generator=g)
        lo += len(rows)
    return out.to(device)


def _uniforms(generator: torch.Generator | None, n: int, m: int, device) -> torch.Tensor:
    """[n, m] float64 uniforms from `generator` (None: the default generator of `device`), on `device`."""
    gen_device = generator.device if generator is not None else device
    return torch.rand((n, m), generator=generator, dtype=torch.float64, device=gen_device).to(device)


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: token = min{j : u * S < CDF(j)}, CDF(j) = sum_{i<=j} probs(i), S = CDF(V-1).

    Rows need not be normalised. Zero-probability tokens are never returned (a float rounding of
    u * S up to S is clamped to the row's last positive token). probs [N, V], u [N] -> tokens [N] int64.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (u.to(cdf.device, torch.float64) * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # searchsorted lands on a j with CDF(j) > CDF(j-1), i.e. probs(j) > 0, unless it ran off the
    # end (j = V): only those rows need their last positive token (an [N, V] pass saved otherwise).
    v = probs.shape[-1]
    off_end = tokens >= v
    if bool(off_end.any()):
        last_positive = (v - 1) - (probs[off_end] > 0).flip(-1).to(torch.int8).argmax(dim=-1)
        tokens = tokens.masked_scatter(off_end, last_positive)
    return tokens


def sample(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """token_i ~ probs[i], using generators[i] (None: default generator). probs [N, V] -> tokens [N] int64."""
    u = row_uniforms(generators, probs.shape[0], 1, probs.device)[:, 0]
    return sample_with_uniforms(probs, u)
