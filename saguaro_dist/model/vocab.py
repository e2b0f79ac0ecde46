"""Target and draft must share one vocabulary: every speculative formula indexes both by token id.

"Share" means the same tokenizer. The embedding tables may still differ in size: model families pad
them to a multiple that depends on how each size was trained (Qwen2.5: 151936 rows up to 7B, 152064
from 14B, over one 151665-token tokenizer). Such a draft is made to speak the target's vocabulary
(match_vocab): its tables are cut to the target's rows, or padded with zero rows whose logits are
masked to -inf, so its proposal distribution q is zero on the ids it lacks, and an id it has no row for
(a padding row the target sampled: untrained, so vanishingly rare) reads a zero embedding. Rejection sampling stays exact
whatever q is, as long as q is what the draft sampled from; the target's distribution covers every row.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from saguaro_dist.model.layers import PlainModule, softcap

log = logging.getLogger(__name__)


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


class MaskedLMHead(PlainModule):
    """An LM head over a table padded with zero rows: their logits are set to -inf (q = 0 there). A model's
    final softcap (Gemma 2's) runs here, before the mask: after it, tanh would turn -inf into -cap."""

    def __init__(self, base: nn.Module, own_size: int, final_softcap: float | None = None):
        super().__init__()
        self.base, self.own_size, self.final_softcap = base, own_size, final_softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.base(hidden)
        if self.final_softcap is not None:
            logits = softcap(logits, self.final_softcap)
        logits[..., self.own_size:] = float("-inf")  # in place: 128 columns, where a cat copied all 152k
        return logits


def _padded(weight: torch.Tensor, rows: int) -> nn.Parameter:
    extra = weight.new_zeros(rows - weight.shape[0], weight.shape[1])
    return nn.Parameter(torch.cat([weight, extra]), requires_grad=False)


def match_vocab(model: nn.Module, own_size: int, vocab_size: int) -> None:
    """Make a built (loaded) CausalLM of `own_size` ids speak `vocab_size` ids (module docstring), by
    editing its tables once: more ids get zero rows (an id beyond its own reads a zero embedding, its
    logit is masked), fewer ids score only the first rows. A tied table stays tied."""
    head, embed = model.lm_head, model.model.embed_tokens
    if own_size == vocab_size:
        return
    if vocab_size < own_size:  # the rows beyond are never fed (the tokenizer's ids lie below) nor scored
        head.weight = nn.Parameter(head.weight[:vocab_size], requires_grad=False)
        head.out_features = vocab_size
        return
    tied = head.weight is embed.weight
    embed.weight = _padded(embed.weight, vocab_size)
    embed.num_embeddings = vocab_size
    head.weight = embed.weight if tied else _padded(head.weight, vocab_size)
    head.out_features = vocab_size
    # the softcap moves into the head, ahead of the mask (no family has both it and Granite's logits_scaling)
    model.lm_head, model.final_softcap = MaskedLMHead(head, own_size, model.final_softcap), None
