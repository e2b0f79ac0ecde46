"""A seeded request's proposals must draw on random numbers no earlier round of it used.

Speculative sampling is exact for any proposal q only if the proposal x is distributed as q given
everything generated so far. SSD's split draft (config.draft_executor "split", the default for SSD with
a CPU draft, one host or Ray) holds every sequence on two DraftWorkers: the thread's worker drafts whole
rounds and tree misses (SplitDraftBackend.jit_draft), the tree side drafts the cohorts of rounds without
trees (start_jit_draft). Each worker's DraftSeq gets make_generator(seed, salt=2) at prefill
(engine/draft_worker.py, DraftWorker.prefill), and _draft_sequentially draws from it in call order: for a
seeded request both halves hold the SAME stream, each at its own position. The first draft the tree side
makes for a sequence therefore reuses the uniforms of the thread's first draft (its second those of the
thread's second, ...): x at round r is a function of numbers that already shaped the output of an earlier
round, so x is not distributed as q given the text, and verifying it against q is no longer exact.
(Unseeded requests draw a fresh OS seed per worker and are unaffected; a re-prefill on a worker, after a
worker died, restarts the stream from the seed the same way.)

The draft here is context-free (the same logits after any text: FlatRunner), so a repeated stream shows
at once as a repeated proposal, and the target is context-free too (i.i.d. tokens from P), so its law of
the first two tokens is P x P. Only the draft model is faked: the split backend, both DraftWorkers,
their generators, verify() and the target's own per-request generators are the engine's.
"""
from __future__ import annotations

import pytest
import scipy.stats
import torch

from saguaro_dist import SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.draft_worker import DraftWorker
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.engine.split_draft import SplitDraftBackend
from saguaro_dist.spec import verify

torch.set_num_threads(1)

ALPHA = 1e-3


class FlatRunner:
    """A draft model whose next-token logits are the same after any text (the ModelRunner calls the
    draft worker makes for prefills and just-in-time drafts)."""
    max_model_len = max_positions = 1 << 20
    device = torch.device("cpu")

    def __init__(self, logits: torch.Tensor):
        self.logits, self.vocab_size, self.lens = logits, logits.shape[-1], {}

    def add(self, seq_id):
        self.lens[seq_id] = 0

    def free(self, seq_id):
        self.lens.pop(seq_id, None)

    def length(self, seq_id):
        return self.lens[seq_id]

    def truncate(self, seq_id, n):
        self.lens[seq_id] = min(self.lens[seq_id], n)

    def extend(self, ids, tokens, counts):
        for seq_id, t in zip(ids, tokens):
            self.lens[seq_id] += len(t)
        return [self.logits.expand(c, self.vocab_size).clone() for c in counts]


class InProcessTreeSide(LocalDraftBackend):
    """The split draft's tree side (a DraftProcess on one host, a DraftPool on Ray) in this process: the
    same DraftWorker behind it, the TreeSide calls the split backend makes."""

    def catch_up(self, rounds):
        for outcomes in rounds:
            self.worker.observe(outcomes)

    def lost(self, seq_ids):
        return []

    def accepting(self):
        return True


def split_draft(q: torch.Tensor, k: int = 1) -> SplitDraftBackend:
    config = Config(model="unused", draft="unused", mode="ssd", k=k, enable_prefix_caching=False)
    half = lambda: DraftWorker(config, FlatRunner(torch.log(q)))  # noqa: E731
    return SplitDraftBackend(LocalDraftBackend(half()), InProcessTreeSide(half()))


def seeded(n: int) -> list[DraftSampling]:
    return [DraftSampling(1.0, 0, 1.0, seed) for seed in range(n)]


def test_the_tree_sides_first_cohort_draft_repeats_the_threads_first_draft():
    """Round 0 drafted by the thread's worker, round 1 (a cohort) by the tree side, for 256 seeded
    sequences over a flat 64-token q: independent draws agree 1/64 of the time, not always."""
    n, vocab = 256, 64
    split = split_draft(torch.full((vocab,), 1.0 / vocab))
    try:
        split.prefill([PrefillRequest(i, [0], s) for i, s in enumerate(seeded(n))])
        first = split.jit_draft([JitDraftRequest(i, 0, 0, 0, skip_tree=True) for i in range(n)])
        second = split.start_jit_draft([JitDraftRequest(i, 1, 0, 1, skip_tree=True) for i in range(n)]).result()
    finally:
        split.close()
    same = sum(a.tokens.tolist() == b.tokens.tolist() for a, b in zip(first, second))
    assert same < 16, f"{same} of {n} sequences proposed the same token in rounds 0 and 1 (expected ~{n // vocab})"


def test_a_re_prefilled_sequence_draws_afresh():
    """A draft worker that died hands its sequences to another, which prefills them again with their output so
    far (engine/split_draft.py): their first draft there drew the numbers of the sequence's very first draft
    (the stream restarted from the seed), so with a flat q it repeated that draft's token."""
    n, vocab = 256, 64
    split = split_draft(torch.full((vocab,), 1.0 / vocab))
    try:
        split.prefill([PrefillRequest(i, [0], s) for i, s in enumerate(seeded(n))])
        first = split.jit_draft([JitDraftRequest(i, 0, 0, 0, skip_tree=True) for i in range(n)])
        split.prefill([PrefillRequest(i, [0, 0, 5], s, prompt_len=1) for i, s in enumerate(seeded(n))])
        again = split.jit_draft([JitDraftRequest(i, 0, 0, 7, skip_tree=True) for i in range(n)])
    finally:
        split.close()
    same = sum(a.tokens.tolist() == b.tokens.tolist() for a, b in zip(first, again))
    assert same < 16, f"{same} of {n} re-prefilled sequences repeated their first draft (expected ~{n // vocab})"


@pytest.mark.parametrize("tree_side_drafts_round_1", [False, True], ids=["thread_twice", "cohort_on_tree_side"])
def test_seeded_split_drafts_follow_the_target(tree_side_drafts_round_1):
    """Two rounds of K = 1 for N seeded requests: round 0 drafted by the thread's worker, round 1 by the
    thread's worker again (the control: it passes) or by the tree side (a cohort round). The first two
    output tokens must be i.i.d. P. With the tree side reusing round 0's uniforms, a rejected x = 0 in
    round 0 is proposed again in round 1 and judged against q as if fresh: P(1, 1) comes out ~0.228, not
    0.25 (chi-square p ~ 1e-19 at N = 20000)."""
    n = 20000
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])
    target = p.expand(n, 2, 2).contiguous()  # p_1, p_2 of every row: a context-free target
    generators = [Sequence(i, str(i), [0], SamplingParams(temperature=1.0, seed=i)).generator for i in range(n)]
    split = split_draft(q)
    try:
        split.prefill([PrefillRequest(i, [0], s) for i, s in enumerate(seeded(n))])
        first = split.jit_draft([JitDraftRequest(i, 0, 0, 0, skip_tree=True) for i in range(n)])
        x0, q0 = torch.stack([a.tokens for a in first]), torch.stack([a.probs for a in first])
        out0 = verify(target, x0, q0, generators)
        reqs = [JitDraftRequest(i, 1, a, b, skip_tree=True)
                for i, (a, b) in enumerate(zip(out0.accepted.tolist(), out0.bonus.tolist()))]
        second = split.start_jit_draft(reqs).result() if tree_side_drafts_round_1 else split.jit_draft(reqs)
        x1, q1 = torch.stack([a.tokens for a in second]), torch.stack([a.probs for a in second])
        out1 = verify(target, x1, q1, generators)
    finally:
        split.close()
    y1 = torch.where(out0.accepted >= 1, x0[:, 0], out0.bonus)
    # accepted: round 0 emitted x then its bonus; rejected: round 0 emitted its bonus alone, round 1 the next
    y2 = torch.where(out0.accepted >= 1, out0.bonus, torch.where(out1.accepted >= 1, x1[:, 0], out1.bonus))
    counts = torch.bincount(y1 * 2 + y2, minlength=4).double()
    expected = (p[:, None] * p[None, :]).reshape(-1).double() * n
    pvalue = scipy.stats.chisquare(counts.numpy(), expected.numpy()).pvalue
    assert pvalue > ALPHA, f"joint of the first two tokens {counts.tolist()} against {expected.tolist()}: p = {pvalue:.2e}"

