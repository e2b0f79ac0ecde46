"""The one-host draft pipe's wire format (engine/pipe_wire.py): what goes in comes out."""
import pickle
import threading
from multiprocessing import Pipe

import pytest
import torch

from saguaro_dist.engine import pipe_wire
from saguaro_dist.engine.messages import Proposal, SpeculationTree


def _tree(n: int, vocab: int | None, seq_id: int = 0) -> SpeculationTree:
    gen = torch.Generator().manual_seed(seq_id)
    probs = (lambda: torch.rand(4, vocab, generator=gen)) if vocab else (lambda: None)
    return SpeculationTree.from_rows(seq_id, 3, [(i % 5, 100 + i, Proposal(torch.randint(0, 50, (4,), generator=gen), probs()))
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
    assert (a.seq_id, a.round, a.keys(), a.build_s) == (b.seq_id, b.round, b.keys(), b.build_s)
    assert (a.proposals is None) == (b.proposals is None)
    if a.proposals is not None:
        assert torch.equal(a.proposals.tokens, b.proposals.tokens)
        assert (a.proposals.probs is None) == (b.proposals.probs is None)
        if a.proposals.probs is not None:
            assert torch.equal(a.proposals.probs, b.proposals.probs)


@pytest.mark.parametrize("n, vocab", [(12, None), (12, 2048), (0, None), (1, 7)])
def test_trees_round_trip(n, vocab):
    trees = [_tree(n, vocab, seq_id=s) for s in range(3)]
    kind, got = _round_trip("trees", trees)
    assert kind == "trees"
    for a, b in zip(trees, got):
        _assert_same(a, b)
    for tree in (t for t in got if t.num_branches):
        tree.proposals.tokens[0, 0] = 1  # the engine may write what it received


def test_a_view_of_a_bigger_tensor_sends_only_its_rows():
    """The draft's trees are row slices of one build's columns: each must travel on its own."""
    tree = _tree(12, 2048)
    part = SpeculationTree(0, 3, tree.accepted[4:8], tree.bonus_tokens[4:8],
                           Proposal(tree.proposals.tokens[4:8], tree.proposals.probs[4:8]))
    got = _round_trip(part)[0]
    _assert_same(part, got)
    assert got.proposals.probs.untyped_storage().nbytes() == 4 * 4 * 2048 * 4


def test_small_arrays_go_in_band_large_ones_out_of_band():
    buffers = []
    callback = pipe_wire._out_of_band(buffers)
    small, large = torch.zeros(4, dtype=torch.long).numpy(), torch.zeros(pipe_wire.INBAND_BYTES).numpy()
    assert callback(pickle.PickleBuffer(small)) is True and buffers == []
    assert callback(pickle.PickleBuffer(large)) is False and len(buffers) == 1
