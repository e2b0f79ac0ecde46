"""A tiny, deterministic, real implementation of the DraftWorker interface, for the gRPC tests.

It follows the same round protocol and raises the same errors as engine/draft_worker.DraftWorker
(UnknownSequence, OutOfOrder, ValueError) without a model: proposals are a fixed function of the
committed tokens. Its probs exercise all three wire forms: None at temperature 0, sparse with top_k,
dense otherwise. Run as a script it serves itself: `python test_grpc_toy_worker.py PORT_FILE`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from saguaro_dist.distributed.errors import DraftBehind, OutOfOrder, UnknownSequence
from saguaro_dist.engine.messages import DraftSampling, Proposal, SpeculationTree

K, VOCAB = 3, 64


def toy_tokens(committed: list[int], k: int = K) -> list[int]:
    """The speculation after `committed`: a fixed function, so tests know it in advance."""
    last = committed[-1]
    return [(last * 7 + i + 1) % VOCAB for i in range(k)]


def toy_probs(sampling: DraftSampling, tokens: list[int]) -> torch.Tensor | None:
    if sampling.temperature == 0:
        return None
    if sampling.top_k > 0:
        probs = torch.zeros(len(tokens), VOCAB)
        for i, t in enumerate(tokens):
            support = [(t + j) % VOCAB for j in range(sampling.top_k)]
            probs[i, support] = torch.linspace(1.0, 0.1, sampling.top_k) / torch.linspace(1.0, 0.1, sampling.top_k).sum()
        return probs
    return torch.softmax(torch.arange(len(tokens) * VOCAB, dtype=torch.float32).reshape(len(tokens), VOCAB) / 97, -1)


@dataclass
class ToySeq:
    sampling: DraftSampling
    committed: list[int]
    speculation: list[int] = field(default_factory=list)
    round: int = 0
    pending: bool = False
    branches: dict = field(default_factory=dict)


class ToyWorker:
    """prefill / jit_draft / observe / build_trees / release, like DraftWorker; single-threaded."""

    def __init__(self, build_delay_s: float = 0.0):
        self.seqs: dict[int, ToySeq] = {}
        self.build_delay_s = build_delay_s  # lets tests make trees late
        self.calls: list[str] = []

    def prefill(self, reqs):
        self.calls.append("prefill")
        for r in reqs:
            if r.seq_id in self.seqs:
                raise OutOfOrder(f"sequence {r.seq_id} is already prefilled")
            if not r.prompt_token_ids:
                raise ValueError(f"sequence {r.seq_id}: empty prompt")
        for r in reqs:
            self.seqs[r.seq_id] = ToySeq(r.sampling, list(r.prompt_token_ids))

    def jit_draft(self, reqs):
        self.calls.append("jit_draft")
        states = [self._get(r.seq_id) for r in reqs]
        for s, r in zip(states, reqs):
            first = s.round == 0 and not s.speculation
            if r.round != s.round + 1 and not (first and r.round == 0):
                error = DraftBehind if r.round > s.round + 1 else OutOfOrder
                raise error(f"sequence {r.seq_id}: jit for round {r.round}, draft is at round {s.round}")
        proposals = []
        for s, r in zip(states, reqs):
            s.committed = s.committed + s.speculation[:r.accepted] + [r.bonus_token]
            s.speculation, s.round, s.pending = toy_tokens(s.committed), r.round, True
            proposals.append(self._proposal(s, s.speculation))
        return proposals

    def observe(self, outcomes):
        self.calls.append("observe")
        for o in outcomes:
            s = self._get(o.seq_id)
            if o.round != s.round:
                raise OutOfOrder(f"sequence {o.seq_id}: outcome of round {o.round}, draft is at round {s.round}")
            nxt = o.next_tokens if o.next_tokens is not None else s.branches.get((o.accepted, o.bonus_token))
            if nxt is None:
                raise OutOfOrder(f"sequence {o.seq_id}: hit on a branch never built")
            s.committed = s.committed + s.speculation[:o.accepted] + [o.bonus_token]
            s.speculation, s.round, s.pending = list(nxt), o.round + 1, True

    def plan_trees(self):
        return []  # a worker may announce no plans: the target then waits for its trees

    def finish_trees(self):
        return self.build_trees()

    def build_trees(self):
        self.calls.append("build_trees")
        time.sleep(self.build_delay_s)
        trees = []
        for seq_id, s in self.seqs.items():
            if s.pending:
                trees.append(self._tree(seq_id, s))
                s.pending = False
        return trees

    def release(self, reqs):
        self.calls.append("release")
        for r in reqs:
            self.seqs.pop(r.seq_id, None)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def _get(self, seq_id):
        if seq_id not in self.seqs:
            raise UnknownSequence(f"unknown sequence {seq_id}")
        return self.seqs[seq_id]

    def _proposal(self, s: ToySeq, tokens: list[int]) -> Proposal:
        return Proposal(torch.tensor(tokens, dtype=torch.long), toy_probs(s.sampling, tokens))

    def _tree(self, seq_id: int, s: ToySeq) -> SpeculationTree:
        """One branch per outcome (k, t = the speculated token + 1), plus the all-accepted bonus."""
        rows, s.branches = [], {}
        for k in range(len(s.speculation) + 1):
            t = (s.speculation[k] + 1) % VOCAB if k < len(s.speculation) else 0
            tokens = toy_tokens(s.committed + s.speculation[:k] + [t])
            s.branches[(k, t)] = tokens
            rows.append((k, t, self._proposal(s, tokens)))
        return SpeculationTree.from_rows(seq_id, s.round, rows)


def expected_branch(committed: list[int], speculation: list[int], k: int) -> tuple[int, list[int]]:
    """The (bonus, tokens) of the toy tree's branch for k accepted tokens."""
    t = (speculation[k] + 1) % VOCAB if k < len(speculation) else 0
    return t, toy_tokens(committed + speculation[:k] + [t])


def test_toy_worker_follows_the_round_protocol():
    from saguaro_dist.engine.messages import JitDraftRequest, Outcome, PrefillRequest
    w = ToyWorker()
    w.prefill([PrefillRequest(1, [5, 6], DraftSampling(0.0, 0, 1.0, None))])
    (p,) = w.jit_draft([JitDraftRequest(1, 0, 0, 9)])
    assert p.tokens.tolist() == toy_tokens([5, 6, 9]) and p.probs is None
    (tree,) = w.build_trees()
    assert (tree.seq_id, tree.round, tree.num_branches) == (1, 0, K + 1)
    w.observe([Outcome(1, 0, *tree.keys()[1], None)])
    assert w.seqs[1].speculation == tree.proposal(1).tokens.tolist() and w.seqs[1].round == 1


def _serve_forever(port_file: str) -> None:
    """Subprocess entry: serve a ToyWorker on loopback and report the port through a file."""
    import os

    from saguaro_dist.distributed.draft_service import serve_draft
    server, port = serve_draft(ToyWorker(), "127.0.0.1", 0)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(port_file + ".tmp", port_file)  # the reader never sees a half-written port
    server.wait_for_termination()


if __name__ == "__main__":
    _serve_forever(sys.argv[1])
