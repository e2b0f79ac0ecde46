"""The draft side's per-sequence state, and what a tree build carries between its two halves."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from saguaro_dist.distributed.errors import OutOfOrder
from saguaro_dist.engine.messages import DraftSampling, TreePlan
from saguaro_dist.engine.sequence import CANDIDATE_STREAM, DRAFT_STREAM, substream
from saguaro_dist.engine.structured import GrammarState
from saguaro_dist.model.branch import BranchState
from saguaro_dist.spec import ProposalSource


@dataclass
class LastTree:
    """What the last tree's branch decode left behind: a hit on one of its branches then needs no glue
    forward over the branch's tokens (their KV and draft logits are here)."""
    state: BranchState                  # private KV of every branch built in that call
    step_logits: list[torch.Tensor]     # K x [N, V]: the logits branch row i drew x_1..x_K from


@dataclass
class DraftSeq:
    seq_id: int
    sampling: DraftSampling
    generator: torch.Generator
    committed: list[int]                     # P: tokens both sides agree on, ending with the pending bonus
    prompt_len: int = 0                      # committed[:prompt_len] is the prompt (penalties tell it apart)
    bias: torch.Tensor | None = None         # [V] its logit bias and allowed tokens, built at first use
    in_prompt: torch.Tensor | None = None    # [V] bool: the prompt's tokens (penalties), built at first use
    grammar: GrammarState | None = None      # structured outputs: the matcher after committed[prompt_len:]
    speculation: list[int] = field(default_factory=list)  # x_1..x_K the target verifies this round
    round: int = 0
    pending: bool = False                    # a tree is owed for this round
    # Who proposed this round's speculation: CACHE (a branch of a tree), NEURAL (drafted just in time)
    # or LOOKUP (the target side's n-gram lookup or fast backup).
    source: ProposalSource = ProposalSource.NEURAL
    tree_built: bool = False                 # a tree was built for this speculation (the target looks it up)
    fanout: list[int] | None = None          # F_0..F_K of that tree
    shard: int = 0                           # cache-parallel slice of the tree this worker builds
    num_shards: int = 1
    branches: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # last tree: (k, t) -> tokens
    branch_rows: dict[tuple[int, int], int] = field(default_factory=dict)  # last tree: (k, t) -> its row there
    last_tree: LastTree | None = None
    hit: tuple[int, int] | None = None       # this round's speculation is branch (k, t) of last_tree
    # The KV from position kv_tail_at on holds kv_tail: tokens this worker ran before they were committed
    # (a draft's x_1..x_{K-1}, a glue's x_1..x_K). Later rounds may commit other tokens there.
    kv_tail_at: int = 0
    kv_tail: list[int] = field(default_factory=list)
    # This round's tree drew its candidates from the draft's guesses (coupled bonus draws, spec/coupled.py):
    # their sparse form, (ids [P, M], probs [P, M]); None: top-F candidates.
    guess: tuple[torch.Tensor, torch.Tensor] | None = None

    def commit(self, accepted: int, bonus: int) -> None:
        if not 0 <= accepted <= len(self.speculation):
            raise OutOfOrder(f"sequence {self.seq_id}: accepted={accepted} but the speculation has {len(self.speculation)} tokens")
        self.committed = self.committed + self.speculation[:accepted] + [bonus]
        if self.grammar is not None and not self.grammar.advance(self.speculation[:accepted] + [bonus]):
            self.grammar = None  # the target's tokenizer reads the grammar differently: propose unconstrained

    def note_kv_tail(self, tokens: list[int]) -> None:
        """The KV holds the committed tokens, then `tokens` as far as it goes, run before they were verified
        ([]: nothing beyond the committed text; a forward about to run them may note them first)."""
        self.kv_tail_at, self.kv_tail = len(self.committed), tokens

    def kv_committed(self, stored: int) -> int:
        """How many of the KV's `stored` positions hold committed tokens: all, up to where a tail run before
        it was verified departs from what was committed since. A length alone does not tell: after rounds
        whose speculation came from elsewhere (a tree's branch, an n-gram proposal, the other half's draft),
        a tail of rejected x's sits where committed tokens belong, and the KV is no longer shorter than the
        committed text (every later proposal drafted from a wrong context, session 61)."""
        for position, token in enumerate(self.kv_tail, self.kv_tail_at):
            if position >= min(stored, len(self.committed)) or self.committed[position] != token:
                return min(position, stored)
        return stored

    def draft_generator(self) -> torch.Generator:
        """What a just-in-time draft after `committed` draws from (engine/sequence.py, DRAFT_STREAM: the two
        halves of a split draft, each drafting some rounds of a seeded request, once drew the same numbers
        from one shared stream)."""
        return substream(self.generator, DRAFT_STREAM | len(self.committed))

    def tree_generator(self) -> torch.Generator:
        """What this round's tree draws from: a stream of its own, so that a build stopped part-way, at a moment
        set by timing (finish_trees' abandon), leaves every later draw, and so a seeded output, as it was."""
        return substream(self.generator, len(self.committed))

    def candidate_generator(self) -> torch.Generator:
        """What this round's coupled candidates are drawn from: apart from the tree's branch draws, which must
        not depend on which candidate was drawn (a branch's q is the verifier's, whatever t* turned out)."""
        return substream(self.generator, CANDIDATE_STREAM | len(self.committed))

    def forget_tree(self) -> None:
        """No tree, and no branch a next round could adopt (a build stopped part-way)."""
        self.last_tree, self.branches, self.branch_rows = None, {}, {}


@dataclass
class PlannedTrees:
    """Between plan_trees and finish_trees: the trees whose outcomes are chosen, not yet decoded."""
    states: list[DraftSeq]
    fanouts: dict[tuple[int, bool], list[int]]  # fanout_key -> F_0..F_K
    rows: list[tuple[int, int, int]]   # (state index, k, t) per branch, state by state
    start: float                       # perf_counter at the plan's start (the build's wall time)


class TreeAbandoned(Exception):
    """A tree build stopped part-way: the target no longer waits for it (finish_trees' abandon)."""


def fanout_key(s: DraftSeq) -> tuple[int, bool]:
    """What a tree's fan-out depends on: its share of the budget (shard count), and whether the target
    side proposed the speculation (such proposals fare their own way)."""
    return s.num_shards, s.source is ProposalSource.LOOKUP


def empty_plan(s: DraftSeq) -> TreePlan:
    """s's plan before its branches are listed: its guesses, if its candidates were drawn from them."""
    ids, probs = s.guess or (None, None)
    return TreePlan(s.seq_id, s.round, guess_ids=ids, guess_probs=probs)


def tree_plans(states: list[DraftSeq], rows: list[tuple[int, int, int]]) -> list[TreePlan]:
    """One TreePlan per state from (state index, k, t) rows: the outcomes its tree will answer."""
    plans = [empty_plan(s) for s in states]
    for i, k, t in rows:
        plans[i].accepted.append(k)
        plans[i].bonus_tokens.append(t)
    return plans


def tree_generators(states: list[DraftSeq], rows: list[tuple[int, int, int]]) -> list[torch.Generator]:
    """Per (state index, k, t) row, its state's tree generator: one per state, its rows drawing from it in
    row order."""
    generators = {i: states[i].tree_generator() for i in {i for i, _, _ in rows}}
    return [generators[i] for i, _, _ in rows]
