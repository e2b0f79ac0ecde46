"""Closed-form expectations for speculative decoding rounds (verify latency normalised to 1)."""
from __future__ import annotations


def expected_tokens_per_round(accept_rate: float, k: int) -> float:
    """E[tokens per round] with i.i.d. per-token acceptance a: sum_{i=0..K} a^i = (1 - a^(K+1)) / (1 - a)
    (accepted draft tokens plus the bonus); K + 1 when a = 1."""
    if accept_rate >= 1.0:
        return float(k + 1)
    return (1.0 - accept_rate ** (k + 1)) / (1.0 - accept_rate)


def predicted_speedup(p_hit: float, tokens_hit: float, tokens_miss: float, t_primary: float,
                      t_backup: float) -> float:
    """SSD speedup over autoregressive decoding (Theorem 7), per round with verify time 1:
    [p E_hit + (1-p) E_miss] / [p max(1, T_p) + (1-p) (1 + T_b)],
    T_p: the primary speculator's time to build the cache, T_b: the backup's latency (both / verify)."""
    tokens = p_hit * tokens_hit + (1.0 - p_hit) * tokens_miss
    time = p_hit * max(1.0, t_primary) + (1.0 - p_hit) * (1.0 + t_backup)
    return tokens / time
