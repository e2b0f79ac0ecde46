"""The draft's coupled candidates for a whole tree build in one distribution pass (engine/draft_trees.py,
TreeBuilding._sampled_candidates): each state's guess and candidates are bit for bit what the per-state
computation gave, whatever its batch-mates' sampling settings, and each state draws from its own stream."""
import torch

from saguaro_dist.engine.draft_state import DraftSeq, fanout_key
from saguaro_dist.engine.draft_trees import TreeBuilding
from saguaro_dist.engine.messages import DraftSampling
from saguaro_dist.engine.sequence import make_generator
from saguaro_dist.engine.target import RowSampling, sampling_probs
from saguaro_dist.spec.coupled import bonus_guess, sampled_branches, sparse_guess

K, V = 4, 300
SETTINGS = [DraftSampling(0.7, 0, 1.0, seed=1), DraftSampling(1.3, 20, 1.0, seed=2),
            DraftSampling(0.5, 0, 0.8, seed=3), DraftSampling(0.9, 0, 1.0, seed=4, min_p=0.1),
            DraftSampling(0.7, 50, 0.9, seed=5, min_p=0.02), DraftSampling(0.2, 0, 1.0, seed=None)]


def states_of(settings: list[DraftSampling]) -> list[DraftSeq]:
    return [DraftSeq(i, s, make_generator(s.seed if s.seed is not None else 7, 1), committed=[1, 2, 3])
            for i, s in enumerate(settings)]


def per_state(s: DraftSeq, logits: torch.Tensor, spec: torch.Tensor, fanout: list[int]):
    """The per-state computation the batched pass replaced (one RowSampling and one softmax per state)."""
    probs = sampling_probs(logits, RowSampling.of([s.sampling], logits.device, rows_per_seq=logits.shape[0]))
    ids, kept = sparse_guess(bonus_guess(probs[None], spec[None])[0], 64)
    uniforms = torch.rand(kept.shape, generator=s.candidate_generator(), dtype=torch.float64)
    return (ids, kept), sampled_branches(ids, kept, fanout, uniforms)


def test_batched_candidates_equal_per_state_bit_for_bit(monkeypatch):
    monkeypatch.setattr("saguaro_dist.engine.draft_trees.sparse_guess", lambda g: sparse_guess(g, 64))
    gen = torch.Generator().manual_seed(0)
    for rows in (K + 1, K):  # a tree with and without k = K
        logits = torch.randn(len(SETTINGS), rows, V, generator=gen) * 4
        logits[:, :, :40] = logits[:, :, :40].round()  # ties: the sort and top-k must break them alike
        spec = torch.randint(0, V, (len(SETTINGS), K), generator=gen)
        fanout = [3, 2, 2, 1, 1][:rows]
        batched_states, alone_states = states_of(SETTINGS), states_of(SETTINGS)
        batched = TreeBuilding._sampled_candidates(batched_states, logits, spec, {fanout_key(batched_states[0]): fanout})
        for i, s in enumerate(alone_states):
            guess, picked = per_state(s, logits[i], spec[i], fanout)
            assert batched[i] == picked
            assert all(torch.equal(a, b) for a, b in zip(batched_states[i].guess, guess))


def test_a_state_draws_the_same_whatever_its_batch(monkeypatch):
    """A seeded state's candidates do not depend on which other states share its build."""
    monkeypatch.setattr("saguaro_dist.engine.draft_trees.sparse_guess", lambda g: sparse_guess(g, 64))
    gen = torch.Generator().manual_seed(1)
    logits, spec = torch.randn(len(SETTINGS), K + 1, V, generator=gen) * 3, torch.randint(0, V, (len(SETTINGS), K), generator=gen)
    fanouts = {fanout_key(states_of(SETTINGS)[0]): [3, 2, 2, 1, 1]}
    everyone = TreeBuilding._sampled_candidates(states_of(SETTINGS), logits, spec, fanouts)
    for i in range(len(SETTINGS)):
        alone = TreeBuilding._sampled_candidates(states_of(SETTINGS)[i:i + 1], logits[i:i + 1], spec[i:i + 1], fanouts)
        assert alone[0] == everyone[i]


def test_no_coupled_state_is_no_work():
    assert TreeBuilding._sampled_candidates([], torch.empty(0, K + 1, V), torch.empty(0, K, dtype=torch.long), {}) == []
