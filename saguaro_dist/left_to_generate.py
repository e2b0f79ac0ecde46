"""Whether a request's constraints leave a token to generate at its first output position: one-token bad words
bar their token everywhere, and min_tokens bars the end ids (the eos ids and stop_token_ids) there. A request
that bars every token would meet logits all -inf (NaN probabilities, an arbitrary token, not the model's), so
both edges refuse it up front: the target's (sampling_params.check_against_model) and the draft protocol's
(messages.DraftSampling), with the same checks and messages."""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def check_left_to_generate(allowed_token_ids: Iterable[int] | None, banned_words: Iterable[Sequence[int]],
                           min_tokens: int, end_ids: Iterable[int], vocab_size: int | None = None) -> None:
    """ValueError where nothing could be generated; vocab_size None: the checks that need no vocabulary only."""
    allowed = None if allowed_token_ids is None else set(allowed_token_ids)
    banned = {w[0] for w in banned_words if len(w) == 1}
    if allowed is not None and banned and allowed <= banned:
        raise ValueError("bad_words bar every token of allowed_token_ids: nothing could be generated")
    if not min_tokens:
        return
    ends = set(end_ids)  # held back under ignore_eos too (vLLM's)
    if allowed is not None and allowed <= ends:
        raise ValueError(f"allowed_token_ids holds only end tokens (EOS / stop_token_ids), which min_tokens = "
                         f"{min_tokens} holds back: nothing could be generated")
    if vocab_size is not None and len({t for t in ends if t < vocab_size}) == vocab_size:
        raise ValueError(f"stop_token_ids (with EOS) name every token of the vocabulary, which min_tokens = "
                         f"{min_tokens} holds back: nothing could be generated")
