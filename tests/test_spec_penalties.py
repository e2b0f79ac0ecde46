"""Penalties on the target's logits (spec/penalties.py) against references written token by token, and
against transformers' own repetition-penalty processor."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from saguaro_dist.spec import penalize_batch, penalize_positions, position_counts, prompt_mask

V = 12


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], presence, frequency, repetition):
    """vLLM's rule one token at a time: repetition over prompt + output, then frequency and presence
    over the output."""
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


def penalized_rows(logits, prompt, output, drafted, presence, frequency, repetition):
    return penalize_positions(logits, prompt, output, drafted, presence, frequency, repetition)


@pytest.mark.parametrize("presence,frequency,repetition", [(0.5, 0.3, 1.3), (-0.4, 0.0, 1.0), (0.0, -1.2, 0.7),
                                                           (2.0, 2.0, 5.0)])
def test_each_row_is_penalized_as_plain_decoding_would_be(presence, frequency, repetition):
    """Row t of a verify scores the token after output + drafted[:t]: its penalties count those tokens."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=gen) * 3
    logits[:, 0] = 0.0  # a zero logit: unchanged by the repetition rule either way
    prompt, output, drafted = [0, 1, 2, 2], [3, 1, 3], [4, 3, 9]
    got = penalized_rows(logits, prompt, output, drafted, presence, frequency, repetition)
    for t in range(4):
        want = reference(logits[t], prompt, output + drafted[:t], presence, frequency, repetition)
        torch.testing.assert_close(got[t], want, rtol=0, atol=1e-6)


def test_the_repetition_rule_is_transformers():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, V, generator=gen) * 3
    prompt, output = [5, 6, 6], [7, 5, 0]
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    got = penalized_rows(logits, prompt, output, [], 0.0, 0.0, 1.7)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_neutral_penalties_change_nothing():
    logits = torch.randn(3, V)
    got = penalized_rows(logits, [1, 2], [3, 3], [4, 5], 0.0, 0.0, 1.0)
    assert torch.equal(got, logits)


def test_counts_cover_the_output_and_each_rows_drafted_prefix():
    counts = position_counts([2, 2, 7], [7, 1], 3, V)
    assert counts.shape == (3, V) and counts.dtype == torch.float32
    assert counts[0, 2] == 2 and counts[0, 7] == 1 and counts[0, 1] == 0
    assert counts[1, 7] == 2 and counts[1, 1] == 0
    assert counts[2, 7] == 2 and counts[2, 1] == 1
    assert position_counts([], [], 1, V).sum() == 0


def test_a_batch_is_penalized_as_each_sequence_alone():
    """penalize_batch (one pass over the target's penalized rows) against the token-by-token reference,
    each sequence's row t counting its output + drafted[:t]: sequences of other output lengths, fewer
    drafted tokens than rows (those rows count every draft), and ids beyond the vocabulary (counting nothing)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, V, generator=gen) * 3
    prompts, outputs = [[0, 1, 2], [5], [7, 7, 11]], [[3, 1, 3], [], [11, 2, 40]]
    drafted, settings = [[4, 3, 9], [2], [6, 6, 6]], [(0.5, 0.3, 1.3), (0.0, 0.0, 1.0), (-0.4, 1.2, 0.7)]
    in_prompt = torch.stack([prompt_mask(p, V) for p in prompts])
    got = penalize_batch(logits, in_prompt, outputs, drafted, settings)
    for b in range(3):
        for t in range(4):
            context = [i for i in outputs[b] + drafted[b][:t] if i < V]
            want = reference(logits[b, t], prompts[b], context, *settings[b])
            torch.testing.assert_close(got[b, t], want, rtol=0, atol=1e-6)


def test_rows_sharing_a_prompt_scan_it_once(monkeypatch):
    """A tree's branches share their sequence's prompt list: one [V] mask is built for them all."""
    import saguaro_dist.spec.penalties as penalties
    scans = []
    monkeypatch.setattr(penalties, "prompt_mask", lambda p, v: scans.append(p) or prompt_mask(p, v))
    shared, other = [3, 4, 5], [6]
    rows = penalties.row_penalties([shared, shared, shared, other], [[1], [2], [], [6]], [(0.0, 0.0, 1.2)] * 4, 8)
    assert scans == [shared, other]
    assert rows.in_prompt.shape == (4, 8) and rows.in_prompt[2, 5] and rows.in_prompt[3, 6] and not rows.in_prompt[3, 5]
