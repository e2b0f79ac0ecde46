"""Target and draft must share one vocabulary: every speculative formula indexes both by token id."""
from __future__ import annotations


def vocab_size_of(x) -> int:
    """A ModelRunner, a ModelConfig, a config.json dict or any object with `vocab_size`."""
    size = x.get("vocab_size") if isinstance(x, dict) else getattr(x, "vocab_size", None)
    if not isinstance(size, int):
        raise ValueError(f"cannot read a vocab_size from {type(x).__name__}")
    return size


def check_same_vocab(target, draft):
    t, d = vocab_size_of(target), vocab_size_of(draft)
    if t != d:
        raise ValueError(f"vocab mismatch: the target has vocab_size {t}, the draft {d}; "
                         "speculative decoding needs one shared vocabulary")
