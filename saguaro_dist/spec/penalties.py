"""Repetition, frequency and presence penalties: what they do to the target's logits, as vLLM does it.

Penalties change the target's distribution, so they belong to the target side: the verifier compares
the draft's q with the *penalized* p, and the output follows the penalized target exactly whatever
the draft proposed. Row t of a verify scores the token after x_1..x_t, so its counts include those
speculated tokens (`position_counts`): a row sees exactly the context plain decoding would have.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Scalar = float | torch.Tensor  # a float, or [T, 1]: one value per row


def position_counts(output_ids: list[int], drafted: list[int], rows: int, vocab_size: int) -> torch.Tensor:
    """Occurrences of each token among the output before each row's token: row t counts
    output_ids + drafted[:t]. Returns [rows, V] float32 (one sequence of batch_position_counts)."""
    return batch_position_counts([output_ids], [drafted], rows, vocab_size)[0]


def prompt_mask(prompt_ids: list[int], vocab_size: int) -> torch.Tensor:
    """[V] bool: the token occurs in the prompt (the repetition penalty's other source)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[torch.tensor([t for t in prompt_ids if t < vocab_size], dtype=torch.long)] = True
    return mask


def apply_penalties(logits: torch.Tensor, in_prompt: torch.Tensor, counts: torch.Tensor,
                    presence: Scalar, frequency: Scalar, repetition: Scalar) -> torch.Tensor:
    """vLLM's penalties, in its order, on logits [T, V] (a new tensor).

    seen(j) = in_prompt(j) or counts(j) > 0;
    repetition r: l(j) / r if l(j) > 0 else l(j) * r, for seen j (HF's and vLLM's rule);
    then l(j) -= frequency * counts(j) + presence * [counts(j) > 0] (output tokens only).
    in_prompt [V] or [T, V] bool; counts [T, V] float, occurrences in the output before each row's
    token; each penalty a float or [T, 1]. Neutral values (0, 0, 1) leave a row's logits as they were.
    """
    in_output = counts > 0
    if isinstance(repetition, torch.Tensor) or repetition != 1.0:
        scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(in_prompt | in_output, scaled, logits)
    return logits - frequency * counts - presence * in_output.to(logits.dtype)


def penalize_positions(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], drafted: list[int],
                       presence: float, frequency: float, repetition: float) -> torch.Tensor:
    """logits [T, V] of one sequence, row t scoring the token after output_ids + drafted[:t] (a verify's
    rows, or the draft's glue over [b, x_1..x_K]), with its penalties (one sequence of penalize_batch)."""
    in_prompt = prompt_mask(prompt_ids, logits.shape[1])[None]
    return penalize_batch(logits[None], in_prompt, [output_ids], [drafted], [(presence, frequency, repetition)])[0]


def batch_position_counts(outputs: list[list[int]], drafted: list[list[int]], rows: int, vocab_size: int) -> torch.Tensor:
    """position_counts of B sequences at once: [B, rows, V] float32, sequence b's row t counting
    outputs[b] + drafted[b][:t]. Ids >= vocab_size count nothing (a spare column, dropped)."""
    seq = torch.tensor([b for b, out in enumerate(outputs) for _ in out], dtype=torch.long)
    tokens = torch.tensor([t for out in outputs for t in out], dtype=torch.long).clamp(max=vocab_size)
    base = torch.zeros(len(outputs), vocab_size + 1)
    base.index_put_((seq, tokens), torch.ones(len(tokens)), accumulate=True)
    counts = base[:, None, :vocab_size].expand(len(outputs), rows, vocab_size).clone()
    if rows > 1:  # row t adds x_1..x_t: a running sum of one-hots (rows short of drafts padded with the spare id)
        padded = [d[:rows - 1] + [vocab_size] * (rows - 1 - len(d[:rows - 1])) for d in drafted]
        steps = torch.nn.functional.one_hot(torch.tensor(padded, dtype=torch.long).clamp(max=vocab_size), vocab_size + 1)
        counts[:, 1:] += steps[..., :vocab_size].cumsum(1).float()
    return counts


def penalize_batch(logits: torch.Tensor, in_prompt: torch.Tensor, outputs: list[list[int]], drafted: list[list[int]],
                   settings: list[tuple[float, float, float]]) -> torch.Tensor:
    """penalize_positions of B sequences in one pass (a per-sequence loop cost ~15 small ops a row):
    logits [B, T, V]; in_prompt [B, V] bool; settings[b] = (presence, frequency, repetition)."""
    counts = batch_position_counts(outputs, drafted, logits.shape[1], logits.shape[2]).to(logits.device)
    presence, frequency, repetition = torch.tensor(settings, dtype=logits.dtype, device=logits.device)[:, :, None, None].unbind(1)
    return apply_penalties(logits, in_prompt.to(logits.device)[:, None, :], counts, presence, frequency, repetition)


@dataclass
class RowPenalties:
    """Penalty state of rows that each draw one token a step (the draft's K draws): apply() to a step's
    logits, drew() the tokens drawn, so the next step counts them."""
    in_prompt: torch.Tensor   # [R, V] bool
    counts: torch.Tensor      # [R, V] float32: occurrences in the row's output so far
    presence: torch.Tensor    # [R, 1] float32
    frequency: torch.Tensor   # [R, 1] float32
    repetition: torch.Tensor  # [R, 1] float32
    bias: torch.Tensor | None = None  # [R, V] float32: logit bias and allowed tokens (spec/logit_bias.py), added first

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self._to(logits.device)
        if self.bias is not None:
            logits = logits + self.bias
        return apply_penalties(logits, self.in_prompt, self.counts, self.presence, self.frequency, self.repetition)

    def drew(self, tokens: torch.Tensor) -> None:
        """tokens [R]: one more occurrence each (rows draw distinct positions: no duplicates per row)."""
        self.counts[torch.arange(len(tokens), device=self.counts.device), tokens.to(self.counts.device)] += 1

    def _to(self, device) -> None:
        for name in ("in_prompt", "counts", "presence", "frequency", "repetition", "bias"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))


def row_penalties(prompts: list[list[int]], outputs: list[list[int]], settings: list[tuple[float, float, float]],
                  vocab_size: int, bias: torch.Tensor | None = None) -> RowPenalties:
    """RowPenalties of rows whose context is prompts[i] + outputs[i]; settings[i] = (presence,
    frequency, repetition); bias [R, V] or None. Rows of one sequence may share their prompt list (it
    is scanned once)."""
    masks: dict[int, torch.Tensor] = {}
    for p in prompts:  # (not setdefault: its default would scan every row's prompt)
        if id(p) not in masks:
            masks[id(p)] = prompt_mask(p, vocab_size)
    return masked_row_penalties(torch.stack([masks[id(p)] for p in prompts]), outputs, settings, vocab_size, bias)


def masked_row_penalties(in_prompt: torch.Tensor, outputs: list[list[int]], settings: list[tuple[float, float, float]],
                         vocab_size: int, bias: torch.Tensor | None = None) -> RowPenalties:
    """row_penalties of rows whose prompts are given as masks, in_prompt [R, V] bool (prompt_mask's rows: a
    caller that keeps a sequence's mask builds it once, not every round)."""
    rows = torch.tensor([i for i, out in enumerate(outputs) for _ in out], dtype=torch.long)
    tokens = torch.tensor([t for out in outputs for t in out], dtype=torch.long)
    counts = torch.zeros(len(outputs), vocab_size)
    counts.index_put_((rows, tokens), torch.ones(len(tokens)), accumulate=True)
    column = lambda i: torch.tensor([s[i] for s in settings], dtype=torch.float32)[:, None]  # noqa: E731
    return RowPenalties(in_prompt, counts, column(0), column(1), column(2), bias)
