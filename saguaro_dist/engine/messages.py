"""The messages that cross between the target side and the draft side, one type per stage.

Mirrored 1:1 by protos/saguaro.proto (package saguaro.v1); the gRPC transport converts between the
two, the in-process transport passes these objects as they are. One exception: a SpeculationTree's
branches travel as columns (one Proposal of tokens [N, K]), so Branch has no message of its own.

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

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftSampling:
    """What the draft needs of a request's sampling settings to draw its proposals."""
    temperature: float
    top_k: int
    top_p: float
    seed: int | None


@dataclass
class Proposal:
    """K speculated tokens and the distributions they were really drawn from (the verifier's q)."""
    tokens: torch.Tensor        # [K] int64
    probs: torch.Tensor | None  # [K, V] float32; None means one-hot on `tokens` (greedy, n-gram)


@dataclass
class PrefillRequest:
    seq_id: int
    prompt_token_ids: list[int]
    sampling: DraftSampling
    shard: int = 0        # cache-parallel: this worker builds branches shard, shard + num_shards, ...
    num_shards: int = 1   # of a tree num_shards times the configured budget


@dataclass
class JitDraftRequest:
    """Neural backup: draft K tokens now, after the real outcome (accepted, bonus_token)."""
    seq_id: int
    round: int
    accepted: int     # k*: draft tokens of the last speculation the target accepted (0 for the first round)
    bonus_token: int  # t*: the token the target sampled after them
    skip_tree: bool = False  # SSD: the target will not look up a tree for this speculation; build none


@dataclass
class Outcome:
    """Target -> draft, per sequence per round: what verification decided."""
    seq_id: int
    round: int
    accepted: int                    # k* in 0..K
    bonus_token: int                 # t*
    next_tokens: list[int] | None    # the speculation verified next; None: the cached branch (k*, t*) of this worker
    cache_hit: bool = False          # the target found (k*, t*) in the speculation cache
    skip_tree: bool = False          # the target will not look up a tree for next_tokens; build none
    tree_wait_s: float = 0.0         # how long the target waited for this round's tree (the draft's budget signal)


@dataclass
class Branch:
    accepted: int      # k: the outcome this branch answers
    bonus_token: int   # t
    proposal: Proposal


@dataclass
class SpeculationTree:
    """Draft -> target: prepared speculations for the likely outcomes of `round`."""
    seq_id: int
    round: int
    branches: list[Branch]
    build_s: float = 0.0  # the draft's wall time for the build that made this tree (all its trees; metrics only)


@dataclass
class Release:
    seq_id: int
