"""Log-probabilities of the tokens a request gained, as vLLM reports them by default: the target's raw
distribution (log_softmax of its logits, before temperature, top-k or top-p; after a structured-output grammar's
mask, as vLLM's bitmask comes before its sampler), so the figures do not depend on how the token was sampled,
or on which speculation (draft, cache, fallback) proposed it."""
from __future__ import annotations

import torch


class RankedLogprobs(dict):
    """An entry {token id: log p}, chosen token first, that also knows the chosen token's rank in its row
    (1: the likeliest): vLLM's rank of a token outside the top N. A dict still (pickled with its rank), so
    everything that carries an entry carries it unchanged."""

    def __init__(self, items: dict[int, float], rank: int):
        super().__init__(items)
        self.rank = rank


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[RankedLogprobs]:
    """One dict per row: the chosen token's log-probability first, then the row's top_n tokens' (the
    chosen one appears once), with the chosen token's rank. logits [R, V], tokens [R] -> R dicts of
    1..top_n + 1 entries.

    A vocabulary smaller than top_n (up to MAX_LOGPROBS = 20) gives all its tokens: topk past V raised
    inside the engine step, failing every request in flight."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top_n = min(top_n, logp.shape[-1])
    chosen_t = logp.gather(-1, torch.tensor(tokens, dtype=torch.long, device=logp.device)[:, None])
    ranks = token_ranks(logp, chosen_t).tolist()
    chosen = chosen_t.squeeze(-1).tolist()
    if top_n == 0:
        return [RankedLogprobs({t: lp}, r) for t, lp, r in zip(tokens, chosen, ranks)]
    values, ids = logp.topk(top_n, dim=-1)
    return [RankedLogprobs({t: lp, **dict(zip(i, v))}, r)
            for t, lp, r, i, v in zip(tokens, chosen, ranks, ids.tolist(), values.tolist())]


def token_ranks(logp: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """vLLM's rank of each row's chosen token: how many tokens are at least as likely, itself included
    (a tie ranks the chosen token last among its equals). logp [R, V], chosen [R, 1] -> [R]."""
    return (logp >= chosen).sum(-1)
