"""Property test of the draft worker's edge (what the DraftService hands it, decoded): any call either
works or is refused with the protocol's errors (ValueError: INVALID_ARGUMENT, UnknownSequence: NOT_FOUND,
OutOfOrder: FAILED_PRECONDITION), and a refused call loses nothing: the sequence then drafts exactly as
on a twin worker that never saw the call."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saguaro_dist.config import Config
from saguaro_dist.distributed.errors import OutOfOrder, UnknownSequence
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Proposal

K, VOCAB = 3, 64  # tiny_checkpoint("draft") has a 64-token vocabulary
GREEDY = DraftSampling(0.0, 0, 1.0, None)
SEEDED = DraftSampling(0.8, 0, 1.0, 7)  # a refused call must not draw from the sequence's generator either
REFUSALS = (ValueError, UnknownSequence, OutOfOrder)
TOKENS = st.integers(0, VOCAB - 1)
WIDE = st.integers(-1, VOCAB + 1)  # mostly valid ids, and the ids just outside the vocabulary
SMALL = st.integers(-1, K + 2)


@pytest.fixture(scope="module")
def twins(tiny_checkpoint):
    """Two workers on the same draft: the first gets the random calls, the second only those that worked."""
    path = tiny_checkpoint("draft")
    config = Config(model=path, draft=path, mode="ssd", k=K, fan_out=6, enable_prefix_caching=False)
    return build_draft_worker(config), build_draft_worker(config), itertools.count(1)


def random_call(seq_id: int):
    """(name, argument) of one protocol call on seq_id, its fields anywhere near their valid ranges."""
    jit = st.builds(JitDraftRequest, st.just(seq_id), SMALL, SMALL, WIDE, st.booleans())
    outcome = st.builds(Outcome, st.just(seq_id), SMALL, SMALL, WIDE, st.none() | st.lists(WIDE, max_size=3 * K + 1),
                        cache_hit=st.booleans(), skip_tree=st.booleans(), target_proposed=st.booleans())
    prefill = st.builds(PrefillRequest, st.just(seq_id), st.lists(WIDE, max_size=6), st.sampled_from([GREEDY, SEEDED]),
                        shard=st.integers(-1, 2), num_shards=st.integers(1, 2), prompt_len=st.integers(-1, 7))
    return st.one_of(st.tuples(st.just("jit_draft"), jit), st.tuples(st.just("observe"), outcome),
                     st.tuples(st.just("prefill"), prefill))


def call(worker, name: str, msg):
    """As the DraftService calls the worker: an observe is followed by the trees it makes owed."""
    if name == "observe":
        worker.observe([msg])
        return [(t.accepted, t.bonus_tokens, t.proposals) for t in worker.build_trees()]
    return getattr(worker, name)([msg])


def next_draft(worker, seq_id: int, bonus: int) -> list[int]:
    """The next just-in-time draft of seq_id, whatever round it is at (nothing of it accepted)."""
    s = worker.seqs[seq_id]
    first = s.round == 0 and not s.speculation
    return worker.jit_draft([JitDraftRequest(seq_id, 0 if first else s.round + 1, 0, bonus)])[0].tokens.tolist()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data(), prompt=st.lists(TOKENS, min_size=1, max_size=6), bonus=TOKENS,
       sampling=st.sampled_from([GREEDY, SEEDED]))
def test_a_refused_call_loses_nothing(twins, data, prompt, bonus, sampling):
    fuzzed, reference, ids = twins
    seq_id = next(ids)
    for worker in (fuzzed, reference):
        worker.prefill([PrefillRequest(seq_id, prompt, sampling)])
    assert next_draft(fuzzed, seq_id, bonus) == next_draft(reference, seq_id, bonus)
    for name, msg in data.draw(st.lists(random_call(seq_id), min_size=1, max_size=3)):
        try:
            result = call(fuzzed, name, msg)
        except REFUSALS:
            continue
        assert same(call(reference, name, msg), result)  # what worked works alike on the twin
    assert next_draft(fuzzed, seq_id, bonus) == next_draft(reference, seq_id, bonus)


def same(a, b) -> bool:
    """Equal results: nested lists and tuples of ints, Proposals, tensors (bit for bit) and None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, Proposal):
        return isinstance(b, Proposal) and same(a.tokens, b.tokens) and same(a.probs, b.probs)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name, make", [
    ("jit_draft", lambda sid, r: JitDraftRequest(sid, r + 1, 0, VOCAB)),              # bonus past the vocabulary
    ("jit_draft", lambda sid, r: JitDraftRequest(sid, r + 1, K + 1, 5)),              # more accepted than speculated
    ("observe", lambda sid, r: Outcome(sid, r, 0, 5, [1] * (K - 1))),                 # a speculation not K long
    ("observe", lambda sid, r: Outcome(sid, r, 0, 5, [1] * (K - 1) + [VOCAB + 3])),   # an id past the vocabulary
    ("prefill", lambda sid, r: PrefillRequest(sid, [5, VOCAB], GREEDY)),              # a prompt past it
])
def test_each_refusal_the_property_test_found_loses_nothing(twins, name, make):
    """The property test's finds, pinned: each was accepted in part before, and the sequence was lost."""
    fuzzed, reference, ids = twins
    seq_id = next(ids)
    for worker in (fuzzed, reference):
        worker.prefill([PrefillRequest(seq_id, [5, 6, 7], GREEDY)])
    assert next_draft(fuzzed, seq_id, 9) == next_draft(reference, seq_id, 9)
    with pytest.raises(REFUSALS):
        call(fuzzed, name, make(seq_id, fuzzed.seqs[seq_id].round))
    assert next_draft(fuzzed, seq_id, 9) == next_draft(reference, seq_id, 9)
