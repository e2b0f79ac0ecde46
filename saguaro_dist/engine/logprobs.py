"""Log-probabilities of the tokens a request gained, as vLLM reports them by default: the target's raw
distribution (log_softmax of its logits, before temperature, top-k or top-p), so the figures do not depend
on how the token was sampled, or on which speculation (draft, cache, fallback) proposed it."""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[dict[int, float]]:
    """One dict per row: the chosen token's log-probability first, then the row's top_n tokens' (the
    chosen one appears once). logits [R, V], tokens [R] -> R dicts of 1..top_n + 1 entries.

    A vocabulary smaller than top_n (up to MAX_LOGPROBS = 20) gives all its tokens: topk past V raised
    inside the engine step, failing every request in flight."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top_n = min(top_n, logp.shape[-1])
    chosen = logp.gather(-1, torch.tensor(tokens, dtype=torch.long, device=logp.device)[:, None]).squeeze(-1).tolist()
    if top_n == 0:
        return [{t: lp} for t, lp in zip(tokens, chosen)]
    values, ids = logp.topk(top_n, dim=-1)
    return [{t: lp, **dict(zip(i, v))} for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]
