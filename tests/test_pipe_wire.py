"""The one-host draft pipe's wire format (engine/pipe_wire.py): what goes in comes out."""
import pickle
import threading
from multiprocessing import Pipe

import pytest
import torch

from saguaro_dist.engine import pipe_wire
from saguaro_dist.engine.messages import Branch, Proposal, SpeculationTree


def _tree(n: int, vocab: int | None, seq_id: int = 0) -> SpeculationTree:
    gen = torch.Generator().manual_seed(seq_id)
    probs = (lambda: torch.rand(4, vocab, generator=gen)) if vocab else (lambda: None)
    return SpeculationTree(seq_id, 3, [Branch(i % 5, 100 + i, Proposal(torch.randint(0, 50, (4,), generator=gen), probs()))
                                       for i in range(n)], build_s=0.001 * (seq_id + 1))


def _round_trip(*msg):
    tx, rx = Pipe()
    got = []
    reader = threading.Thread(target=lambda: got.append(pipe_wire.recv(rx)))  # big messages outgrow the pipe
    reader.start()
    pipe_wire.send(tx, *msg)
    reader.join(timeout=30)
    return got[0]


def _assert_same(a: SpeculationTree, b: SpeculationTree) -> None:
    assert (a.seq_id, a.round, len(a.branches), a.build_s) == (b.seq_id, b.round, len(b.branches), b.build_s)
    for x, y in zip(a.branches, b.branches):
        assert (x.accepted, x.bonus_token) == (y.accepted, y.bonus_token)
        assert torch.equal(x.proposal.tokens, y.proposal.tokens)
        assert (x.proposal.probs is None) == (y.proposal.probs is None)
        if x.proposal.probs is not None:
            assert torch.equal(x.proposal.probs, y.proposal.probs)


@pytest.mark.parametrize("n, vocab", [(12, None), (12, 2048), (0, None), (1, 7)])
def test_trees_round_trip(n, vocab):
    trees = [_tree(n, vocab, seq_id=s) for s in range(3)]
    kind, got = _round_trip("trees", trees)
    assert kind == "trees"
    for a, b in zip(trees, got):
        _assert_same(a, b)
    for branch in (b for t in got for b in t.branches):
        branch.proposal.tokens[0] = 1  # the engine may write what it received


def test_a_tree_with_mixed_proposals_round_trips():
    tree = _tree(2, 5)
    tree.branches[1].proposal.probs = None
    _assert_same(tree, _round_trip(tree)[0])


def test_small_arrays_go_in_band_large_ones_out_of_band():
    buffers = []
    callback = pipe_wire._out_of_band(buffers)
    small, large = torch.zeros(4, dtype=torch.long).numpy(), torch.zeros(pipe_wire.INBAND_BYTES).numpy()
    assert callback(pickle.PickleBuffer(small)) is True and buffers == []
    assert callback(pickle.PickleBuffer(large)) is False and len(buffers) == 1
