"""The draft side: drafts speculations and prepares the speculation tree for the next round.

Single-threaded and transport-agnostic: the one-host engine runs it on a thread, the distributed
runtime behind a gRPC DraftService. See engine/messages.py for the round protocol.

KV invariant per sequence: the draft's KV holds a prefix of `committed + speculation`, and before
any forward it is cut back to `committed[:-1]` (the last committed token, the bonus, is the input
of the next forward).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from saguaro_dist.config import Config, Mode
from saguaro_dist.distributed.errors import OutOfOrder, UnknownSequence
from saguaro_dist.engine.messages import (
    Branch, DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Proposal, Release, SpeculationTree,
)
from saguaro_dist.engine.sequence import make_generator
from saguaro_dist.engine.target import sampling_probs
from saguaro_dist.spec import ProposalSource, SpecStats, sample, saguaro_probs, select_branches

log = logging.getLogger(__name__)


@dataclass
class DraftSeq:
    seq_id: int
    sampling: DraftSampling
    generator: torch.Generator
    committed: list[int]                     # P: tokens both sides agree on, ending with the pending bonus
    speculation: list[int] = field(default_factory=list)  # x_1..x_K the target verifies this round
    round: int = 0
    pending: bool = False                    # a tree is owed for this round
    from_cache: bool = False                 # this round's speculation was a cache hit
    branches: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # last tree: (k, t) -> tokens

    def commit(self, accepted: int, bonus: int) -> None:
        if not 0 <= accepted <= len(self.speculation):
            raise OutOfOrder(f"sequence {self.seq_id}: accepted={accepted} but the speculation has {len(self.speculation)} tokens")
        self.committed = self.committed + self.speculation[:accepted] + [bonus]


class DraftWorker:
    def __init__(self, config: Config, runner):
        self.config = config
        self.runner = runner
        self.k = config.k
        self.vocab_size = runner.vocab_size
        self.seqs: dict[int, DraftSeq] = {}
        self.stats = SpecStats(config.k)
        self.last_fanout = [1] * (config.k + 1)  # fan-out of the trees being built or last built

    # ---- protocol calls -------------------------------------------------------------------
    def prefill(self, reqs: list[PrefillRequest]) -> None:
        for r in reqs:
            if r.seq_id in self.seqs:
                raise OutOfOrder(f"sequence {r.seq_id} is already prefilled")
            if not r.prompt_token_ids:
                raise ValueError(f"sequence {r.seq_id}: empty prompt")
            self.runner.add(r.seq_id)
            self.seqs[r.seq_id] = DraftSeq(r.seq_id, r.sampling, make_generator(r.sampling.seed, salt=2), list(r.prompt_token_ids))
        self.runner.extend([r.seq_id for r in reqs], [r.prompt_token_ids for r in reqs], [1] * len(reqs))

    def jit_draft(self, reqs: list[JitDraftRequest]) -> list[Proposal]:
        """Neural backup: commit the real outcome, then draft K tokens one forward at a time."""
        states = [self._get(r.seq_id) for r in reqs]
        for s, r in zip(states, reqs):
            first = s.round == 0 and not s.speculation
            if r.round != s.round + 1 and not (first and r.round == 0):
                raise OutOfOrder(f"sequence {r.seq_id}: just-in-time draft for round {r.round}, draft is at round {s.round}")
        for s, r in zip(states, reqs):  # validate the whole batch before changing any state
            s.commit(r.accepted, r.bonus_token)
        proposals = self._draft_sequentially(states)
        for s, r, p in zip(states, reqs, proposals):
            s.speculation, s.round, s.pending, s.from_cache = p.tokens.tolist(), r.round, self.config.mode is Mode.SSD, False
        return proposals

    def observe(self, outcomes: list[Outcome]) -> None:
        """Commit outcomes; the next speculation is the cached branch (hit) or the target's tokens."""
        for o in outcomes:
            s = self._get(o.seq_id)
            if o.round != s.round:
                raise OutOfOrder(f"sequence {o.seq_id}: outcome of round {o.round}, draft is at round {s.round}")
            next_tokens = o.next_tokens if o.next_tokens is not None else s.branches.get((o.accepted, o.bonus_token))
            if next_tokens is None:
                raise OutOfOrder(f"sequence {o.seq_id} round {o.round}: outcome claims a hit on a branch never built")
            hit = o.next_tokens is None
            self.stats.record_lookups([self.last_fanout[o.accepted]], [hit])
            self.stats.record_verify([o.accepted], ProposalSource.CACHE if s.from_cache else ProposalSource.NEURAL)
            s.from_cache = hit
            s.commit(o.accepted, o.bonus_token)
            s.speculation, s.round, s.pending = list(next_tokens), o.round + 1, True

    def build_trees(self) -> list[SpeculationTree]:
        states = [s for s in self.seqs.values() if s.pending]
        if not states:
            return []
        fanout = self.last_fanout = self._fanout()
        ranking, k_idx, bonus = self._glue(states, fanout)
        trees = self._decode_branches(states, fanout, k_idx, bonus)
        for s in states:
            s.pending = False
        return trees

    def release(self, reqs: list[Release]) -> None:
        for r in reqs:
            if self.seqs.pop(r.seq_id, None) is not None:
                self.runner.free(r.seq_id)

    # ---- steps ------------------------------------------------------------------------------
    def _get(self, seq_id: int) -> DraftSeq:
        s = self.seqs.get(seq_id)
        if s is None:
            raise UnknownSequence(f"unknown sequence {seq_id}")
        return s

    def _sync(self, states: list[DraftSeq]) -> None:
        """Cut each KV back to committed[:-1], running any committed tokens it does not hold yet."""
        missing = {}
        for s in states:
            stored, want = self.runner.length(s.seq_id), len(s.committed) - 1
            if stored > want:
                self.runner.truncate(s.seq_id, want)
            elif stored < want:
                missing[s.seq_id] = s.committed[stored:want]
        if missing:
            self.runner.extend(list(missing), list(missing.values()), [1] * len(missing))

    def _fanout(self) -> list[int]:
        return self.stats.fanout(self.config.fan_out_kind, self.config.fan_out, self.vocab_size)

    def _proposal_probs(self, logits: torch.Tensor, states: list[DraftSeq], rows_per_seq: int, top_f: int) -> torch.Tensor:
        """What the draft samples from: the request's sampling, then Saguaro sigma_{F,C} (T > 0 only)."""
        probs = sampling_probs(logits, [s.sampling for s in states], rows_per_seq)
        if self.config.saguaro_c < 1.0:
            sampled = torch.tensor([s.sampling.temperature > 0 for s in states]).repeat_interleave(rows_per_seq)
            probs = torch.where(sampled[:, None], saguaro_probs(probs, top_f, self.config.saguaro_c), probs)
        return probs

    def _draft_sequentially(self, states: list[DraftSeq]) -> list[Proposal]:
        """K one-token forwards (the SD draft, and SSD's neural backup)."""
        self._sync(states)
        fanout = self._fanout()
        ids, inputs = [s.seq_id for s in states], [[s.committed[-1]] for s in states]
        tokens, dists = [], []
        for j in range(self.k):
            logits = torch.cat(self.runner.extend(ids, inputs, [1] * len(ids)))
            probs = self._proposal_probs(logits, states, 1, fanout[j])
            drawn = sample(probs, [s.generator for s in states])
            tokens.append(drawn)
            dists.append(probs)
            inputs = [[t] for t in drawn.tolist()]
        return self._proposals(states, 1, torch.stack(tokens, 1), torch.stack(dists, 1))

    def _proposals(self, states, rows_per_seq, tokens, dists) -> list[Proposal]:
        """tokens [R, K], dists [R, K, V] -> Proposals; greedy rows carry no distribution (one-hot)."""
        greedy = [s.sampling.temperature == 0 for s in states for _ in range(rows_per_seq)]
        return [Proposal(tokens[i].clone(), None if g else dists[i].clone()) for i, g in enumerate(greedy)]

    def _glue(self, states: list[DraftSeq], fanout: list[int]):
        """Draft logits over [b, x_1..x_K]; pick the top-F_k candidate bonus tokens per position."""
        self._sync(states)
        k = self.k
        logits = self.runner.extend([s.seq_id for s in states], [[s.committed[-1]] + s.speculation for s in states], [k + 1] * len(states))
        ranking = torch.stack(logits).float().softmax(-1)                          # [B, K+1, V]
        spec = torch.tensor([s.speculation for s in states], dtype=torch.long)      # [B, K]
        branch_set = select_branches(ranking, spec, fanout)
        return ranking, branch_set.accepted, branch_set.bonus

    def _decode_branches(self, states, fanout, k_idx: torch.Tensor, bonus: torch.Tensor) -> list[SpeculationTree]:
        """K steps for all B * N branches at once; branch (k, t) attends to P + x_1..x_k, then t."""
        n = k_idx.shape[1]
        seq_ids = [s.seq_id for s in states for _ in range(n)]
        prefix = torch.tensor([len(s.committed) for s in states]).repeat_interleave(n) + k_idx.flatten()
        state, logits = self.runner.branch_start(seq_ids, prefix.tolist(), bonus.flatten().tolist())
        tokens, dists = [], []
        for j in range(self.k):
            probs = self._proposal_probs(logits, states, n, fanout[j])
            drawn = sample(probs, [s.generator for s in states for _ in range(n)])
            tokens.append(drawn)
            dists.append(probs)
            if j + 1 < self.k:
                logits = self.runner.branch_step(state, drawn)
        proposals = self._proposals(states, n, torch.stack(tokens, 1), torch.stack(dists, 1))
        return [self._tree(s, k_idx[i], bonus[i], proposals[i * n:(i + 1) * n]) for i, s in enumerate(states)]

    def _tree(self, s: DraftSeq, k_row, bonus_row, proposals) -> SpeculationTree:
        branches = [Branch(int(k), int(t), p) for k, t, p in zip(k_row.tolist(), bonus_row.tolist(), proposals)]
        s.branches = {(b.accepted, b.bonus_token): b.proposal.tokens.tolist() for b in branches}
        return SpeculationTree(s.seq_id, s.round, branches)
