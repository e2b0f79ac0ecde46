"""The messages that cross between the target side and the draft side, one type per stage.

Mirrored 1:1 by protos/saguaro.proto (package saguaro.v1); the gRPC transport converts between the
two, the in-process transport passes these objects as they are. A SpeculationTree holds its branches as
columns, as on the wire: one Proposal of tokens [N, K] for N branches, not N objects (a pickled or
encoded tensor per branch cost more than the rest of a tree's trip; docs/architecture.md).

Round protocol for one sequence (P = committed tokens, ending with the last bonus token b that the
target has not run yet; s = the speculation x_1..x_K the target verifies this round):
  1. the target verifies s while the draft, knowing P and s, builds a SpeculationTree: for each
     outcome (k, t) chosen by the fan-out, the speculation that would follow P + x_1..x_k + t;
  2. the draft pushes the tree; the target looks up its real outcome (k*, t*) there (hit) or asks
     the fallback (miss);
  3. the target sends an Outcome naming (k*, t*) and the tokens it verifies next, so the draft
     builds the next tree for the right speculation.
Cache-parallel: one sequence may live on several draft workers (shards), each building a disjoint
slice of a bigger tree; only shard 0 answers just-in-time drafts, the others learn them as Outcomes.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from saguaro_dist.sampling_params import (
    TokenBias, allowed_tokens, biased, check_min_p, check_penalties, check_top, checked_temperature, penalized, token_bias,
)
from saguaro_dist.bad_word_ids import BadWordIds, checked_word_ids
from saguaro_dist.left_to_generate import check_left_to_generate
from saguaro_dist.spec.min_tokens import checked_end_ids


@dataclass(frozen=True)
class DraftSampling:
    """What the draft needs of a request's sampling settings to draw its proposals. The penalties, the
    logit bias, the allowed tokens, the bad words and the ends min_tokens holds back are the target's: a draft
    that applies them too proposes what the constrained target would choose."""
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: TokenBias = ()                        # (token id, bias) pairs, sorted
    allowed_token_ids: tuple[int, ...] | None = None  # None: any token
    grammar: str | None = None                        # structured outputs: llguidance grammar text; None: none
    min_p: float = 0.0                                # the target's min-p (0: off)
    bad_words: BadWordIds = ()                        # the bad words' token ids (spec/bad_words.py); (): none
    min_tokens: int = 0                               # end_token_ids barred while fewer output tokens precede
    end_token_ids: tuple[int, ...] = ()               # the target's eos ids and stop_token_ids (spec/min_tokens.py)

    def __post_init__(self):  # a protocol edge (gRPC, the pipe): NaN or 0 would poison the draft's logits
        object.__setattr__(self, "temperature", checked_temperature(self.temperature))
        check_top(self.top_p, self.top_k)
        check_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        check_min_p(self.min_p)
        object.__setattr__(self, "logit_bias", token_bias(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", allowed_tokens(self.allowed_token_ids))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("grammar must be non-empty llguidance grammar text (or None)")
        object.__setattr__(self, "bad_words", checked_word_ids(self.bad_words))
        object.__setattr__(self, "end_token_ids", checked_end_ids(self.min_tokens, self.end_token_ids))
        # As the target refuses such a request: where every token is barred the draft's q would be NaN
        check_left_to_generate(self.allowed_token_ids, self.bad_words, self.min_tokens, self.end_token_ids)

    @property
    def holds_back_ends(self) -> bool:
        """Whether min_tokens bars an end id anywhere (spec/min_tokens.py)."""
        return self.min_tokens > 0 and bool(self.end_token_ids)

    @property
    def biased(self) -> bool:
        return biased(self.logit_bias, self.allowed_token_ids)

    @property
    def penalized(self) -> bool:
        return penalized(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)


@dataclass
class Proposal:
    """K speculated tokens and the distributions they were really drawn from (the verifier's q)."""
    tokens: torch.Tensor        # [K] int64
    probs: torch.Tensor | None  # [K, V] float32; None means one-hot on `tokens` (greedy, n-gram)


def proposal_fits(p: Proposal, k: int, vocab_size: int) -> bool:
    """Whether a speculation from the draft side is one the target can verify: K token ids inside its
    vocabulary, and q, if any, [K, V]. A draft built with another K or vocabulary (a mismatched peer)
    would otherwise fail the target's whole step."""
    tokens = p.tokens.tolist()
    return (len(tokens) == k and all(0 <= t < vocab_size for t in tokens)
            and (p.probs is None or tuple(p.probs.shape) == (k, vocab_size)))


_generations = itertools.count(1)  # next() is atomic under the GIL: no two requests share a number


def new_generation() -> int:
    """A number no other PrefillRequest made in this process has."""
    return next(_generations)


@dataclass
class PrefillRequest:
    seq_id: int
    prompt_token_ids: list[int]
    sampling: DraftSampling
    shard: int = 0        # cache-parallel: this worker builds branches shard, shard + num_shards, ...
    num_shards: int = 1   # of a tree num_shards times the configured budget
    prompt_len: int = 0   # prompt_token_ids[:prompt_len] is the prompt, the rest output (a re-prefill); 0: all
    # This life of the sequence on the draft side. A re-prefill restarts its rounds at 0, so (seq_id, round)
    # cannot tell a late tree of the earlier life from the new life's; the draft stamps the life's trees and
    # plans with this, and the target drops another life's, in whatever order a transport delivers them.
    # Each request made is a new life; copies of one life (a cache-parallel shard's) pass it on.
    generation: int = field(default_factory=new_generation)
    cache_salt: str | None = None  # vLLM's: the draft's prefix cache shares KV only with sequences of the same salt


@dataclass
class JitDraftRequest:
    """Neural backup: draft K tokens now, after the real outcome (accepted, bonus_token)."""
    seq_id: int
    round: int
    accepted: int     # k*: draft tokens of the last speculation the target accepted (0 for the first round)
    bonus_token: int  # t*: the token the target sampled after them
    skip_tree: bool = False  # SSD: the target will not look up a tree for this speculation; build none
    # The life it was asked in (PrefillRequest.generation): the draft drops one of an earlier life (a re-prefill
    # overtook it) and answers it an empty proposal. 0: none named, taken as the current life's; the target's
    # backend stamps the life it last prefilled (draft_backend.Lives.stamp).
    generation: int = 0


@dataclass
class Outcome:
    """Target -> draft, per sequence per round: what verification decided."""
    seq_id: int
    round: int
    accepted: int                    # k* in 0..len(the speculation verified)
    bonus_token: int                 # t*
    next_tokens: list[int] | None    # the speculation verified next, K tokens (1..3K: a round of n-gram proposals
                                     # alone, target_proposed and skip_tree); None: the cached branch (k*, t*) of this worker
    cache_hit: bool = False          # the target found (k*, t*) in the speculation cache
    skip_tree: bool = False          # the target will not look up a tree for next_tokens; build none
    tree_wait_s: float = 0.0         # how long the target waited for this round's tree (the draft's budget signal)
    # next_tokens came from the target side (n-gram lookup, fast backup), not the draft: the draft fans
    # out its tree for them from how such proposals fare, not from its own acceptance.
    target_proposed: bool = False
    generation: int = 0              # the life it is of (as JitDraftRequest's): the draft drops an earlier life's


@dataclass
class TreePlan:
    """Draft -> target, pushed before the tree it announces: the outcomes (k, t) that tree will answer,
    known once the draft has ranked the bonus candidates and before it decodes the branches. A target
    whose outcome is not among them knows the round missed without waiting for the tree itself (a
    draft whose trees outlast the verify would otherwise make every miss wait for a tree it cannot use)."""
    seq_id: int
    round: int
    accepted: list[int] = field(default_factory=list)      # [N] k of each branch the tree will hold
    bonus_tokens: list[int] = field(default_factory=list)  # [N] t of each branch
    # Coupled bonus draws (spec/coupled.py): the sparse guess g_k per outcome position k that this tree's
    # candidates were drawn from, in draw order within each k; None: top-F candidates.
    guess_ids: torch.Tensor | None = None    # [P, M] int64, P = K + 1 (K: a tree without k = K)
    guess_probs: torch.Tensor | None = None  # [P, M] float32
    generation: int = 0  # the life it was planned in (PrefillRequest.generation)

    def holds(self, accepted: int, bonus_token: int) -> bool:
        return any(k == accepted and t == bonus_token for k, t in zip(self.accepted, self.bonus_tokens))


@dataclass
class SpeculationTree:
    """Draft -> target: prepared speculations for the likely outcomes of `round`, one row per branch:
    row i answers outcome (accepted[i], bonus_tokens[i]) with the speculation proposals.tokens[i]."""
    seq_id: int
    round: int
    accepted: list[int] = field(default_factory=list)      # [N] k of each branch
    bonus_tokens: list[int] = field(default_factory=list)  # [N] t of each branch
    proposals: Proposal | None = None  # tokens [N, K] int64, probs [N, K, V] float32 or None; None iff N == 0
    build_s: float = 0.0  # the draft's wall time for the build that made this tree (all its trees; metrics only)
    generation: int = 0   # the life it was built in (PrefillRequest.generation)

    @property
    def num_branches(self) -> int:
        return len(self.accepted)

    def keys(self) -> list[tuple[int, int]]:
        return list(zip(self.accepted, self.bonus_tokens))

    def proposal(self, i: int) -> Proposal:
        """Branch i's proposal: tokens [K], probs [K, V] or None (views of the columns)."""
        p = self.proposals
        return Proposal(p.tokens[i], None if p.probs is None else p.probs[i])

    def rows(self) -> list[tuple[int, int, Proposal]]:
        """(k, t, proposal) per branch, as from_rows takes them."""
        return [(k, t, self.proposal(i)) for i, (k, t) in enumerate(self.keys())]

    def lookup(self, accepted: int, bonus_token: int) -> Proposal | None:
        """The branch that answers outcome (accepted, bonus_token), or None."""
        for i, key in enumerate(zip(self.accepted, self.bonus_tokens)):
            if key == (accepted, bonus_token):
                return self.proposal(i)
        return None

    @classmethod
    def from_rows(cls, seq_id: int, round: int, rows: list[tuple[int, int, Proposal]], build_s: float = 0.0
                  ) -> SpeculationTree:
        """A tree from branches given one by one as (k, t, proposal), stacked into columns; a row without
        q gets its one-hot q when another row has one."""
        if not rows:
            return cls(seq_id, round, build_s=build_s)
        return cls(seq_id, round, [int(k) for k, _, _ in rows], [int(t) for _, t, _ in rows],
                   stack_proposals([p for _, _, p in rows]), build_s)

    @classmethod
    def concat(cls, trees: list[SpeculationTree]) -> SpeculationTree:
        """One tree from disjoint slices of the same round (cache-parallel shards, built in parallel:
        the slowest slice's build is the tree's)."""
        if len(trees) == 1:  # one worker: nothing to join (and no copy of its columns every round)
            return trees[0]
        full = [t for t in trees if t.num_branches]
        tree = cls(trees[0].seq_id, trees[0].round, build_s=max(t.build_s for t in trees),
                   generation=trees[0].generation)  # one life's slices (the pool prefills every shard alike)
        if full:
            tree.accepted = [k for t in full for k in t.accepted]
            tree.bonus_tokens = [b for t in full for b in t.bonus_tokens]
            tree.proposals = stack_proposals([t.proposals for t in full], cat=True)
        return tree


def stack_proposals(proposals: list[Proposal], cat: bool = False) -> Proposal:
    """Proposals stacked (or, with cat, columns of trees concatenated) along a first dimension; a
    proposal without q gets its one-hot q when another has one. Every proposal must have the same K."""
    join = torch.cat if cat else torch.stack
    if len({tuple(p.tokens.shape[-1:]) for p in proposals}) > 1:
        raise ValueError(f"proposals of one tree must all have K tokens, got {sorted({p.tokens.shape[-1] for p in proposals})}")
    given = next((p.probs for p in proposals if p.probs is not None), None)
    tokens = join([p.tokens for p in proposals])
    if given is None:
        return Proposal(tokens, None)
    return Proposal(tokens, join([one_hot_like(given, p.tokens) if p.probs is None else p.probs for p in proposals]))


def one_hot_like(q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The q [..., K, V] of a deterministic proposal: probability 1 on each of its tokens [..., K]."""
    shape = (*tokens.shape, q.shape[-1])
    return torch.zeros(shape, dtype=q.dtype, device=q.device).scatter_(-1, tokens.to(q.device)[..., None], 1.0)


@dataclass
class Release:
    seq_id: int
    generation: int = 0  # the life it ends (as JitDraftRequest's): a late release of an earlier life leaves the new one be


@dataclass
class ResetPrefixCache:
    """Drop every kept prefix (model/prefix_cache.py): prompts are then computed afresh (LLM.reset_prefix_cache)."""
