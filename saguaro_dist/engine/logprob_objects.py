"""vLLM's Logprob objects for the offline API: the engine keeps each token's entry as {token id: log p}
(engine/logprobs.RankedLogprobs, the chosen token first, its rank beside); RequestOutput and
CompletionOutput hand callers {token id: Logprob(logprob, rank, decoded_token)}, as vLLM's, so code written
for vLLM (`out.outputs[0].logprobs[i][tid].logprob`, `.decoded_token`) runs unchanged. The server and
StreamDelta keep the plain entries (the HTTP layer shapes its own). No torch here: `saguaro_dist.Logprob`
imports light."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

Decode = Callable[[int], str]  # one token id -> its text


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's (vllm/logprobs.py): a token's log-probability, its rank in the row (1: the likeliest), and its
    text as the tokenizer decodes that one token (None without a tokenizer or with detokenize=False)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_value(value: Logprob | float) -> float:
    """A log p from a Logprob or a plain float (RequestOutput built by hand from earlier releases' entries)."""
    return value.logprob if isinstance(value, Logprob) else float(value)


def entry_ranks(entry: dict[int, float], top_n: int) -> dict[int, int | None]:
    """Each token's rank in an engine entry (the chosen token, then the row's top_n in topk order; the chosen
    one once), 1 for the likeliest. The chosen token always has the engine's rank (vLLM's: how many tokens are
    at least as likely, itself included), so a tie ranks it last among its equals, inside the top or out; the
    others take 1, 2, ... in topk order, skipping the chosen token's rank, so no two share one (as vLLM's).
    An entry without a rank (an engine that sent none): counted among the entry's own tokens inside the top,
    None outside. The HTTP server ranks the same way (serve/responses._ranks)."""
    if not entry:
        return {}
    chosen, *others = entry
    rank = getattr(entry, "rank", None)
    if rank is None and len(entry) <= top_n:
        rank = sum(lp >= entry[chosen] for lp in entry.values())
    free_ranks = (r for r in itertools.count(1) if r != rank)
    ranked = sorted(others, key=lambda t: -entry[t])  # stable: topk's order stays among exact ties
    return {chosen: rank, **dict(zip(ranked, free_ranks))}


def logprob_entry(entry: dict[int, float], top_n: int, decode: Decode | None) -> dict[int, Logprob]:
    """One engine entry as vLLM's {token id: Logprob}, in its order (the chosen token first, as vLLM's)."""
    ranks = entry_ranks(entry, top_n)
    return {t: Logprob(lp, ranks[t], None if decode is None else decode(t)) for t, lp in entry.items()}


def logprob_entries(entries: list[dict[int, float] | None] | None, top_n: int | None,
                    decode: Decode | None) -> list[dict[int, Logprob] | None] | None:
    """A list of engine entries (a None one, the first prompt token's, stays None); None stays None."""
    if entries is None:
        return None
    return [None if e is None else logprob_entry(e, top_n or 0, decode) for e in entries]


class TokenTexts:
    """tokenizer.decode([id]) remembered per id: an entry of top N decodes N + 1 tokens, and the same few
    recur from token to token. At most the vocabulary's size of short strings."""

    def __init__(self, tokenizer):
        self._tokenizer, self._texts = tokenizer, {}

    def decoder(self, detokenize: bool) -> Decode | None:
        """The decode of a request: none without a tokenizer, or when it asked for ids only (vLLM's)."""
        return self.text if detokenize and self._tokenizer is not None else None

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text
