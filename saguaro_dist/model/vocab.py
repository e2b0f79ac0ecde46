"""Target and draft must share one vocabulary: every speculative formula indexes both by token id.

"Share" means the same tokenizer. The embedding tables may still differ in size: model families pad
them to a multiple that depends on how each size was trained (Qwen2.5: 151936 rows up to 7B, 152064
from 14B, over one 151665-token tokenizer). Such a draft is made to speak the target's vocabulary
(match_vocab): its logits are cut or padded with -inf to the target's rows, so its proposal
distribution q is zero on the ids it lacks, and an id it has no row for (a padding row the target
sampled: untrained, so vanishingly rare) reads a placeholder row. Rejection sampling stays exact
whatever q is, as long as q is what the draft sampled from; the target's distribution covers every row.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)
PLACEHOLDER_ID = 0  # the row the draft reads for an id beyond its table


def vocab_size_of(x) -> int:
    """A ModelRunner, a ModelConfig, a config.json dict or any object with `vocab_size`."""
    size = x.get("vocab_size") if isinstance(x, dict) else getattr(x, "vocab_size", None)
    if not isinstance(size, int):
        raise ValueError(f"cannot read a vocab_size from {type(x).__name__}")
    return size


def check_pair_vocab(target_size: int, draft_size: int, target_tokenizer, draft_tokenizer) -> None:
    """Can this pair speculate? The same tokenizer (when both ship one) and, when the embedding sizes
    differ, proof that only padding differs: both tokenizers present, equal, and every id they make
    below both sizes."""
    if target_tokenizer is not None and draft_tokenizer is not None \
            and target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError("target and draft tokenizers differ: speculative decoding needs one shared vocabulary")
    if target_size == draft_size:
        return
    if target_tokenizer is None or draft_tokenizer is None:
        raise ValueError(f"vocab mismatch: the target has vocab_size {target_size}, the draft {draft_size}, and "
                         "without both tokenizers nothing shows that only padding rows differ; speculative "
                         "decoding needs one shared vocabulary")
    used = len(target_tokenizer)
    if used > min(target_size, draft_size):
        raise ValueError(f"the tokenizer makes {used} ids but the target has vocab_size {target_size} and the draft "
                         f"{draft_size}: a model without a row for some of them cannot take part")
    log.info("target vocab_size %d, draft %d, one %d-token tokenizer: the draft's rows are matched to the "
             "target's (padding rows only)", target_size, draft_size, used)


class PaddedEmbedding(nn.Module):
    """An embedding of `own_size` rows that reads PLACEHOLDER_ID's row for the ids beyond them."""

    def __init__(self, base: nn.Module, own_size: int):
        super().__init__()
        self.base, self.own_size = base, own_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base(ids.masked_fill(ids >= self.own_size, PLACEHOLDER_ID))


class MatchedLMHead(nn.Module):
    """The LM head's logits cut, or padded with -inf, to `vocab_size` columns."""

    def __init__(self, base: nn.Module, own_size: int, vocab_size: int):
        super().__init__()
        self.base, self.own_size, self.vocab_size = base, own_size, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.base(hidden)
        if self.vocab_size <= self.own_size:
            return logits[..., :self.vocab_size]
        pad = logits.new_full((*logits.shape[:-1], self.vocab_size - self.own_size), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


def match_vocab(model: nn.Module, own_size: int, vocab_size: int) -> None:
    """Make a built (loaded) CausalLM of `own_size` ids speak `vocab_size` ids (module docstring)."""
    if own_size == vocab_size:
        return
    model.model.embed_tokens = PaddedEmbedding(model.model.embed_tokens, own_size)
    model.lm_head = MatchedLMHead(model.lm_head, own_size, vocab_size)
