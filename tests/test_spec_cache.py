"""SpeculationCache: keys (seq, k, t*), latest round only, counters."""
import torch

from saguaro_dist.engine.messages import Proposal, SpeculationTree
from saguaro_dist.spec import SpeculationCache


def test_hit_and_wrong_keys_miss():
    cache = SpeculationCache()
    cache.put(1, 5, {(0, 7): "a", (2, 3): "b"})
    assert cache.lookup(1, 5, 0, 7) == "a"
    assert cache.lookup(1, 5, 2, 3) == "b"
    assert cache.lookup(1, 5, 0, 3) is None   # right k, wrong bonus
    assert cache.lookup(1, 5, 1, 7) is None   # right bonus, wrong k
    assert cache.lookup(2, 5, 0, 7) is None   # another sequence
    assert (cache.hits, cache.misses) == (2, 3)
    assert cache.hit_rate == 0.4


def test_stale_round_is_a_miss_and_newer_round_replaces():
    cache = SpeculationCache()
    cache.put("s", 3, {(1, 1): "old"})
    assert cache.lookup("s", 4, 1, 1) is None       # looking for a round not stored yet
    assert cache.put("s", 4, {(0, 2): "new"})
    assert cache.lookup("s", 3, 1, 1) is None       # the old round is gone
    assert cache.lookup("s", 4, 1, 1) is None
    assert cache.lookup("s", 4, 0, 2) == "new"
    assert not cache.put("s", 3, {(1, 1): "late"})  # a late delivery of an older round is ignored
    assert cache.latest_round("s") == 4 and cache.latest_round("x") is None


def test_drop_and_counters_reset():
    cache = SpeculationCache()
    cache.put(1, 0, {(0, 0): 1})
    cache.put(2, 0, {(0, 0): 2})
    assert len(cache) == 2
    cache.drop(1)
    cache.drop(99)
    assert len(cache) == 1 and cache.lookup(1, 0, 0, 0) is None and cache.lookup(2, 0, 0, 0) == 2
    cache.reset_counters()
    assert (cache.hits, cache.misses, cache.hit_rate) == (0, 0, 0.0)


def test_put_tree_with_protocol_messages():
    tree = SpeculationTree(seq_id=9, round=2, accepted=[0, 1], bonus_tokens=[3, 6],
                           proposals=Proposal(tokens=torch.tensor([[1, 2], [4, 5]]), probs=None))
    cache = SpeculationCache()
    assert cache.put_tree(tree)
    assert cache.lookup(9, 2, 1, 6).tokens.tolist() == [4, 5]
    # tensor keys from the verifier work too
    assert cache.lookup(9, 2, torch.tensor(1), torch.tensor(6)).tokens.tolist() == [4, 5]
    assert cache.lookup(9, 2, 1, 3) is None and cache.lookup(9, 1, 0, 3) is None  # not a branch; a stale round
