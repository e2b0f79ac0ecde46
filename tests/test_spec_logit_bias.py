"""spec.logit_bias: one additive row for OpenAI's logit_bias and vLLM's allowed_token_ids."""
import math

import torch

from saguaro_dist.spec import bias_row


def test_bias_lands_on_its_tokens_and_the_rest_stays_zero():
    row = bias_row(((1, 2.5), (4, -100.0)), None, 6)
    assert row.tolist() == [0.0, 2.5, 0.0, 0.0, -100.0, 0.0] and row.dtype == torch.float32


def test_allowed_tokens_leave_every_other_token_at_minus_infinity():
    row = bias_row(((2, 1.0), (3, 4.0)), (0, 2), 5)
    assert row[0] == 0 and row[2] == 1.0 and all(math.isinf(row[t]) and row[t] < 0 for t in (1, 3, 4))
    probs = torch.zeros(5).add(row).softmax(-1)
    assert probs[[1, 3, 4]].sum() == 0 and torch.isclose(probs[2] / probs[0], torch.tensor(math.e))


def test_ids_beyond_a_smaller_vocabulary_are_left_out():
    """A draft whose vocabulary is smaller than the target's: what it has is constrained, and an
    allowed list with nothing inside it constrains nothing (the target still does)."""
    assert bias_row(((1, 1.0), (9, 3.0)), (1, 9), 4).tolist() == [-math.inf, 1.0, -math.inf, -math.inf]
    assert bias_row((), (7, 9), 4).tolist() == [0.0] * 4
