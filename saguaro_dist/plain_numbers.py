"""numpy and torch scalars (np.float32(0.5), np.int64(3), a 0-d tensor) as the plain Python numbers (and bools)
they hold: SamplingParams' and BeamSearchParams' checks then judge the value, not its type (np.float32 was refused
where np.float64, a float subclass, passed), and everything downstream (msgpack, protobuf, Ray) sees int, float
and bool only."""
from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable, Mapping

NUMBER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "seed", "logprobs",
                 "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "truncate_prompt_tokens", "n")
TOKEN_LIST_FIELDS = ("stop_token_ids", "allowed_token_ids")
FLAG_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize")


def plain_number(value):
    """A number's plain int or float. Anything else is returned as it is, for the checks to judge: a bool
    (numpy's and torch's come back as Python's), a string, an array, None."""
    if value is None or type(value) in (int, float, bool) or isinstance(value, (str, bytes)):
        return value
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):  # numpy scalar, 0-d array/tensor
        item = value.item()  # (a 0-d object array's may itself be a numpy scalar: unwrapped again)
        return value if item is value else plain_number(item)
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    if isinstance(value, numbers.Real):  # (Fraction and the like)
        return float(value)
    return value


def plain_flag(value):
    """A numpy or torch bool (np.True_, a 0-d bool tensor) as Python's; anything else as it is (a number is no flag)."""
    plain = plain_number(value)
    return plain if type(plain) is bool else value


def plain_list(values):
    """Any iterable of numbers the checks take (list, tuple, set, generator, range, 1-d array or tensor) as a list
    of plain ones; anything else (a string, a mapping, a scalar) as it is."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable) or getattr(values, "ndim", 1) == 0:
        return values
    return [plain_number(v) for v in values]


def plain_bias(bias):
    """logit_bias ({token id: bias}, or pairs) with plain ids and biases; anything else as it is."""
    if isinstance(bias, Mapping):
        return {plain_number(token): plain_number(value) for token, value in bias.items()}
    if isinstance(bias, (list, tuple)):
        return [plain_list(pair) for pair in bias]
    return bias


def make_numbers_plain(params) -> None:
    """A (frozen) SamplingParams' numbers made plain in place, before its checks."""
    for name in NUMBER_FIELDS:
        object.__setattr__(params, name, plain_number(getattr(params, name)))
    for name in TOKEN_LIST_FIELDS:
        object.__setattr__(params, name, plain_list(getattr(params, name)))
    for name in FLAG_FIELDS:
        object.__setattr__(params, name, plain_flag(getattr(params, name)))
    object.__setattr__(params, "logit_bias", plain_bias(params.logit_bias))
