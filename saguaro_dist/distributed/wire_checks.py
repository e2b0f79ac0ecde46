"""CodecError and the checks a decoded field must pass: each returns the value or raises CodecError
naming the field."""
from __future__ import annotations

import math

__all__ = ["CodecError", "int64", "non_negative", "duration", "non_negative_ints", "required"]

_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


class CodecError(ValueError):
    """A protobuf message that does not describe a valid protocol message."""


def int64(value, what: str) -> int:
    """Protobuf would raise its own error on overflow; name the field instead."""
    value = int(value)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise CodecError(f"{what} = {value} does not fit in int64")
    return value


def non_negative(value: int, what: str) -> int:
    if value < 0:
        raise CodecError(f"{what} must be >= 0, got {value}")
    return value


def duration(value: float, what: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise CodecError(f"{what} must be a finite number of seconds >= 0, got {value}")
    return value


def non_negative_ints(ids, what: str) -> list[int]:
    """Token ids, accepted counts: a repeated int64 field as a list, every value >= 0."""
    ids = list(ids)
    if any(t < 0 for t in ids):
        raise CodecError(f"{what} has a negative value")
    return ids


def required(msg, field: str, owner: str):
    if not msg.HasField(field):
        raise CodecError(f"{owner}.{field} is required")
    return getattr(msg, field)
