"""The bench prompts: held-out stdlib snippets (demo pair) or seeded random ids, all truncated to one length."""
from __future__ import annotations

import logging
import random

log = logging.getLogger(__name__)


def resolve_pair(target: str | None, draft: str | None) -> tuple[str, str]:
    """The checkpoints to bench: both given, or the shipped demo pair."""
    if target and draft:
        return target, draft
    if target or draft:
        raise ValueError("give both --target and --draft, or neither (the demo pair)")
    from saguaro_dist.demo import demo_pair
    return demo_pair()


def load_tokenizer_or_none(path: str):
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        log.info("no tokenizer at %s (%s): random token-id prompts", path, err)
        return None


def text_prompts(tokenizer, n: int, length: int) -> list[list[int]] | None:
    """The first n held-out snippets with at least `length` tokens, cut to `length`; None without the demo set."""
    try:
        from saguaro_dist.demo import demo_prompts
        texts = demo_prompts(len_of_demo_prompts())
    except (FileNotFoundError, ValueError):
        return None
    tokenizer.model_max_length = 1 << 30  # we cut the ids ourselves: no length warning
    ids = [tokenizer.encode(t) for t in texts]
    long_enough = [p[:length] for p in ids if len(p) >= length]
    if len(long_enough) < n:
        raise too_few_prompts(len(long_enough), n, len(texts), length, "--num-prompts / --num-requests")
    return long_enough[:n]


def too_few_prompts(found: int, n: int, total: int, length: int, flag: str, tokenizer: str = "the tokenizer",
                    what: str = "prompts a run") -> ValueError:
    """The error for n prompts where only `found` of the demo set's `total` snippets have `length` tokens: the
    cap named (asking for more than the set holds said only "lower --prompt-len", which could not help)."""
    if n > total:
        return ValueError(f"{flag} {n}: the demo set holds {total} prompts ({found} of them with {length} tokens in "
                          f"{tokenizer}), so at most {found} {what}; lower {flag}")
    return ValueError(f"only {found} of the {total} demo prompts have {length} tokens in {tokenizer}: lower "
                      f"--prompt-len, or {flag} to at most {found} ({what})")


def len_of_demo_prompts() -> int:
    import json
    from saguaro_dist.demo import PAIR_DIR
    return len(json.loads((PAIR_DIR / "prompts.json").read_text()))


def random_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(n)]


def bench_prompts(target: str, n: int, length: int, seed: int, vocab_size: int) -> tuple[list[list[int]], str]:
    """(n prompts of `length` token ids, where they came from)."""
    tokenizer = load_tokenizer_or_none(target)
    if tokenizer is not None:
        ids = text_prompts(tokenizer, n, length)
        if ids is not None:
            return ids, f"{n} held-out stdlib snippets (demo prompts), first {length} tokens; batch b runs them b at a time"
    return random_prompts(vocab_size, n, length, seed), f"{n} random token-id prompts (seed {seed}), {length} tokens; b at a time"
