"""PrefixCache.finish whose truncate fails (after the row was renamed to its prefix key) frees that row and keeps
no namespace for it, then raises: neither the sequence's id nor the key holds a row afterwards (a real runner over a
tiny checkpoint; the fault is its truncate failing once)."""
from __future__ import annotations

import pytest

from saguaro_dist.model import ModelRunner
from saguaro_dist.model.prefix_cache import MIN_REUSE, PrefixCache
from test_engine_recovery_leaks import fail_once

TOKENS = [(5 * i + 1) % 60 + 2 for i in range(MIN_REUSE + 8)]  # long enough to be kept


def test_a_failed_truncate_frees_the_renamed_row(tiny_checkpoint):
    runner = ModelRunner(tiny_checkpoint("llama"))
    cache = PrefixCache(runner)
    spare = runner.spare_rows()
    cache.start("a", TOKENS, namespace="tenant")
    runner.extend(["a"], [TOKENS], [1])
    fail_once(runner, "truncate")
    with pytest.raises(RuntimeError, match="injected"):
        cache.finish("a", TOKENS)
    # the runner's own accounting: every row it took is free again, no id (the sequence's or the key) holds one
    assert runner.spare_rows() == spare and not runner._seqs, list(runner._seqs)
    assert not cache.namespaces and not cache.entries
    # and the cache goes on: the same sequence, run again, is kept and reused
    cache.start("b", TOKENS, namespace="tenant")
    runner.extend(["b"], [TOKENS], [1])
    cache.finish("b", TOKENS)
    assert cache.start("c", TOKENS, namespace="tenant") == len(TOKENS) - 1
