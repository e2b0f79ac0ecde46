"""The draft side: drafts speculations and prepares the speculation tree for the next round (the trees
themselves: engine/draft_trees.py).

Single-threaded and transport-agnostic: the one-host engine runs it on a thread, the distributed
runtime behind a gRPC DraftService. See engine/messages.py for the round protocol.

KV invariant per sequence: the draft's KV holds committed tokens, then perhaps a tail it ran before
they were verified (DraftSeq.kv_tail: a draft's x's, a glue's speculation), which later rounds may
have committed otherwise. Before any forward it is cut back to `committed[:-1]` (the last committed
token, the bonus, is the input of the next forward) or to where that tail departs from the committed
text; committed tokens it lacks run in that next forward, ahead of the bonus.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from saguaro_dist.config import Config, Mode
from saguaro_dist.distributed.errors import DraftBehind, OutOfOrder, UnknownSequence
from saguaro_dist.engine.draft_backend import Lives
from saguaro_dist.engine.draft_constraints import DraftConstraints, RowRules
from saguaro_dist.engine.draft_state import DraftSeq, PlannedTrees
from saguaro_dist.engine.draft_trees import TreeBuilding
from saguaro_dist.engine.messages import JitDraftRequest, Outcome, PrefillRequest, Proposal, Release
from saguaro_dist.engine.sequence import cache_namespace, make_generator
from saguaro_dist.engine.structured import GrammarState, grammar_masked, greedy_in_grammar
from saguaro_dist.engine.target import RowSampling, sampling_probs
from saguaro_dist.model.prefix_cache import PrefixCache
from saguaro_dist.spec import (
    BudgetController, ProposalSource, SpecStats, greedy_tokens, sample, saguaro_probs, top_k_proposal,
)
from saguaro_dist.left_to_generate import check_left_to_generate
from saguaro_dist.spec.lookup_length import candidate_lengths

log = logging.getLogger(__name__)


class DraftWorker(TreeBuilding):
    """The draft side's protocol calls, its sequences and their draws; the trees are TreeBuilding's
    (engine/draft_trees.py)."""

    def __init__(self, config: Config, runner, tokenizer_loader: Callable[[], object] | None = None,
                 eos_token_ids: Iterable[int] = ()):
        """tokenizer_loader: the draft's tokenizer, loaded on the first request with a grammar (None: it
        has none, and grammars are not followed: acceptance only); eos_token_ids: the target's, where its
        grammars end (DraftFit; none: the tokenizer's EOS alone)."""
        self.config = config
        self.runner = runner
        self.prefixes = PrefixCache(runner, enabled=config.enable_prefix_caching)  # a sequence's add / free
        self.constraints = DraftConstraints(runner.vocab_size, tokenizer_loader, eos_token_ids)
        self.k = config.k
        self.vocab_size = runner.vocab_size
        self.seqs: dict[int, DraftSeq] = {}
        # The life each sequence is in (PrefillRequest.generation): stamped on its trees and plans, and what tells
        # a late outcome, draft or release of an earlier life (a re-prefill overtook it) from the current one's.
        self.lives = Lives()
        self._planned: PlannedTrees | None = None  # plan_trees' trees, for finish_trees
        self.stats = SpecStats(config.k)  # the draft's own proposals; the miss exponent r of every tree
        # k* of the target side's proposals that a tree was built after: those trees' outcomes. A long
        # n-gram match is accepted whole far more often than the draft's guesses (and a short one less).
        self.target_proposed = SpecStats(config.k)
        # An explicit per-position fan-out is the user's exact tree: only a budget B adapts.
        adaptive = config.adaptive_fan_out and isinstance(config.fan_out, int)
        self.budget = BudgetController(floor=(config.k + 1) / config.fan_out_budget, enabled=adaptive)
        # Saguaro sampling trades acceptance for cache hits: SD has no cache, so its draft samples as is.
        self.saguaro_c = config.saguaro_c if config.mode is Mode.SSD else 1.0

    # ---- protocol calls -------------------------------------------------------------------
    def prefill(self, reqs: list[PrefillRequest]) -> None:
        if not reqs:  # as the other calls take an empty batch (the runner refuses an empty extend)
            return
        for r in reqs:
            if not r.prompt_token_ids:
                raise ValueError(f"sequence {r.seq_id}: empty prompt")
            if not 0 <= r.shard < r.num_shards:
                raise ValueError(f"sequence {r.seq_id}: shard {r.shard} of {r.num_shards}")
            if not 0 <= r.prompt_len <= len(r.prompt_token_ids):
                raise ValueError(f"sequence {r.seq_id}: prompt_len {r.prompt_len} of {len(r.prompt_token_ids)} tokens")
            self._check_tokens(r.seq_id, r.prompt_token_ids, "prompt")
            # (DraftSampling checked the rest; this one needs the vocabulary: every token an end under min_tokens)
            check_left_to_generate(None, (), r.sampling.min_tokens, r.sampling.end_token_ids, self.vocab_size)
        # A re-prefill (the target moved it after a worker died) restarts the sequence.
        self.release([Release(r.seq_id) for r in reqs if r.seq_id in self.seqs])
        started: list[int] = []
        try:
            self._start(reqs, started)
        except BaseException:
            self._undo_start(started)
            raise

    def _start(self, reqs: list[PrefillRequest], started: list[int]) -> None:
        """prefill's work after its checks; `started` gets each sequence added to the runner."""
        # Live sources, listed once: the committed tokens each sequence's KV holds.
        live = {sid: self._kv_tokens(s) for sid, s in self.seqs.items()} if self.prefixes.enabled else {}
        cached = []
        for r in reqs:
            cached.append(self.prefixes.start(r.seq_id, r.prompt_token_ids, live, cache_namespace(r.cache_salt)))
            started.append(r.seq_id)
        for r in reqs:
            s = self.seqs[r.seq_id] = DraftSeq(r.seq_id, r.sampling, make_generator(r.sampling.seed, salt=2),
                                               list(r.prompt_token_ids), r.prompt_len or len(r.prompt_token_ids),
                                               shard=r.shard, num_shards=r.num_shards)
            s.grammar = self.constraints.grammar_state(r.sampling.grammar, s.committed[s.prompt_len:])
        self.lives.begin(reqs)
        self.runner.extend([r.seq_id for r in reqs], [r.prompt_token_ids[n:] for r, n in zip(reqs, cached)], [1] * len(reqs))

    def _undo_start(self, started: list[int]) -> None:
        """A prefill that failed part way (out of memory, an id twice in the batch) holds none of its sequences:
        the target takes a refused prefill for one the draft does not hold, and never releases them."""
        for seq_id in started:
            self.seqs.pop(seq_id, None)
            self.lives.end([seq_id])
            self.prefixes.finish(seq_id, [])  # its row freed, nothing of it kept as a prefix

    def jit_draft(self, reqs: list[JitDraftRequest]) -> list[Proposal]:
        """Neural backup: commit the real outcome, then draft K tokens one forward at a time. A request of a
        sequence's earlier life is answered an empty proposal (no tokens) and changes nothing: its asker has moved
        on (it re-prefilled the sequence), and the target takes no such proposal (messages.proposal_fits)."""
        current = self._current(reqs, "just-in-time draft")
        drafted = iter(self._jit_draft([r for r, keep in zip(reqs, current) if keep]) if any(current) else ())
        return [next(drafted) if keep else no_proposal() for keep in current]

    def _jit_draft(self, reqs: list[JitDraftRequest]) -> list[Proposal]:
        refuse_duplicates(reqs, "just-in-time draft")
        states = [self._get(r.seq_id) for r in reqs]
        for s, r in zip(states, reqs):
            first = s.round == 0 and not s.speculation
            # A sequence with no speculation yet takes round 0 only: a later one would commit its bonus after
            # a speculation this worker never learned (the first draft made by the other half of a split
            # draft, say), a wrong context that no later check would catch.
            if (r.round != 0) if first else (r.round != s.round + 1):
                error = DraftBehind if r.round > s.round + 1 else OutOfOrder
                raise error(f"sequence {r.seq_id}: just-in-time draft for round {r.round}, draft is at round {s.round}"
                            + (" with no speculation yet" if first else ""))
            self._check_outcome(s, r.accepted, r.bonus_token)
            self._check_room(s, r.accepted)
        self.budget.interrupted()  # the whole batch checked above: state changes from here on
        for s, r in zip(states, reqs):
            if s.speculation:  # the target verified s.speculation; if a tree was built for it, it missed
                self._record_outcome(s, r.accepted, hit=False)
            s.commit(r.accepted, r.bonus_token)
        proposals = self._draft_sequentially(states)
        for s, r, p in zip(states, reqs, proposals):
            wants_tree = self.config.mode is Mode.SSD and not r.skip_tree
            s.speculation, s.round, s.pending, s.tree_built = p.tokens.tolist(), r.round, wants_tree, False
            s.note_kv_tail(s.speculation)  # _draft_sequentially ran x_1..x_{K-1}
            s.source = ProposalSource.NEURAL
            s.hit = None
        return proposals

    def _note_load(self, outcomes: list[Outcome]) -> None:
        """The budget's signal from these outcomes. A miss the draft's other half drafted just in time (the
        split draft's thread) reaches this worker after that draft: the gap since its last build held the
        target's draft, not idleness here, and read as slack it turned the plans off after every such miss,
        so the next miss waited for a whole tree it could not use (b = 1, T = 0.7, trees every round: a
        miss's wait 3.1 -> 2.65 ms, session 63)."""
        if any(drafted_elsewhere(o) for o in outcomes):
            self.budget.interrupted()
        self.budget.outcomes_arrived(max((o.tree_wait_s for o in outcomes), default=0.0))

    def observe(self, outcomes: list[Outcome]) -> None:
        """Commit outcomes; the next speculation is the target's tokens, or the cached branch (k*, t*). Those of a
        sequence's earlier life are dropped (its new life restarted at round 0: taken, they failed the batch)."""
        outcomes = [o for o, keep in zip(outcomes, self._current(outcomes, "outcome")) if keep]
        refuse_duplicates(outcomes, "outcome")  # else each would commit in turn, the second on the first's tokens
        self._note_load(outcomes)
        states = [self._get(o.seq_id) for o in outcomes]
        for s, o in zip(states, outcomes):  # validate the whole batch before changing any state
            if o.round != s.round:
                raise OutOfOrder(f"sequence {o.seq_id}: outcome of round {o.round}, draft is at round {s.round}")
            if o.next_tokens is None and (o.accepted, o.bonus_token) not in s.branches:
                raise OutOfOrder(f"sequence {o.seq_id} round {o.round}: outcome claims a hit on a branch never built")
            self._check_outcome(s, o.accepted, o.bonus_token)
            if o.next_tokens is not None:  # a speculation is K tokens: trees are built K deep for a batch at once;
                if not self._speculation_length_ok(o):  # a round of n-gram proposals alone may take 1..3K (no tree)
                    raise ValueError(f"sequence {o.seq_id}: next_tokens holds {len(o.next_tokens)} tokens, not K = "
                                     f"{self.k} (1..3K only from an n-gram round that wants no tree)")
                self._check_tokens(o.seq_id, o.next_tokens, "next_tokens")
        for s, o in zip(states, outcomes):
            self._observe_one(s, o)

    def _speculation_length_ok(self, o: Outcome) -> bool:
        """K tokens; or, proposed by the target side for a round without a tree (engine/lookup_rounds.py), any
        of its lengths: 1..3K."""
        n = len(o.next_tokens)
        return n == self.k or (o.target_proposed and o.skip_tree and 0 < n <= max(candidate_lengths(self.k)))

    def _observe_one(self, s: DraftSeq, o: Outcome) -> None:
        next_tokens = o.next_tokens if o.next_tokens is not None else s.branches[(o.accepted, o.bonus_token)]
        fresh = not s.speculation  # a cache-parallel shard learning the first (just-in-time) speculation
        if not fresh:
            self._record_outcome(s, o.accepted, hit=o.cache_hit)
        s.commit(o.accepted, o.bonus_token)
        s.speculation, s.round = list(next_tokens), 0 if fresh else o.round + 1
        s.source = (ProposalSource.CACHE if o.cache_hit else ProposalSource.LOOKUP if o.target_proposed
                    else ProposalSource.NEURAL)  # (another shard's just-in-time draft)
        s.pending, s.tree_built = not o.skip_tree, False
        key = (o.accepted, o.bonus_token)
        s.hit = key if o.cache_hit and key in s.branch_rows and s.branches.get(key) == s.speculation else None

    def _record_outcome(self, s: DraftSeq, accepted: int, hit: bool) -> None:
        """Feed the fan-out estimates (a, P(k*), r) from a verified round. Misses count too: they reach the
        draft as a just-in-time request, and every shard of a sequence must record the same rounds or
        their fan-outs, hence their slices of one tree, drift apart."""
        if s.tree_built:
            self.stats.record_lookups([s.fanout[accepted]], [hit])
        if s.source is not ProposalSource.LOOKUP:
            self.stats.record_verify([accepted], s.source)
        elif s.tree_built:
            self.target_proposed.record_outcomes([accepted])

    def _current(self, msgs: list, what: str) -> list[bool]:
        """Per message, whether it is of its sequence's current life; a debug line names the others (dropped)."""
        current = [not self.lives.stale(m) for m in msgs]
        if not all(current):
            stale = [(m.seq_id, m.generation) for m, keep in zip(msgs, current) if not keep]
            log.debug("dropped %d %s(s) of an earlier life (seq_id, generation): %s", len(stale), what, stale[:8])
        return current

    def reset_prefix_cache(self) -> None:
        """Forget every kept prefix (its rows go back to the pool); running sequences are untouched."""
        self.prefixes.clear()

    def release(self, reqs: list[Release]) -> None:
        """Free the sequences; a late release of an earlier life (a re-prefill overtook it) leaves the new one be."""
        for r, keep in zip(reqs, self._current(reqs, "release")):
            if not keep:
                continue
            s = self.seqs.pop(r.seq_id, None)
            self.lives.end([r.seq_id])
            if s is not None:
                self.prefixes.finish(r.seq_id, self._kv_tokens(s))

    def _kv_tokens(self, s: DraftSeq) -> list[int]:
        """The committed tokens s's KV holds from its start: never the pending bonus (not yet run), nor a
        speculated tail where later rounds committed other tokens (DraftSeq.kv_committed)."""
        return s.committed[:min(len(s.committed) - 1, s.kv_committed(self.runner.length(s.seq_id)))]

    # ---- steps ------------------------------------------------------------------------------
    def _check_tokens(self, seq_id: int, ids, what: str) -> None:
        """Token ids from the wire, checked before any state holds them: one out of the vocabulary would
        fail every later forward of its sequence, not just this call."""
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"sequence {seq_id}: {what} has a token id outside [0, {self.vocab_size})")

    def _check_outcome(self, s: DraftSeq, accepted: int, bonus_token: int) -> None:
        """What commit() will take, checked for the whole batch before the first commit."""
        if not 0 <= accepted <= len(s.speculation):
            raise OutOfOrder(f"sequence {s.seq_id}: accepted={accepted} but the speculation has {len(s.speculation)} tokens")
        self._check_tokens(s.seq_id, [bonus_token], "bonus token")

    def _check_room(self, s: DraftSeq, accepted: int) -> None:
        """A just-in-time draft's forwards end with len(committed) + accepted + K positions in the KV (the bonus,
        then x_1..x_{K-1}): checked before any sequence of the batch commits."""
        needed = len(s.committed) + accepted + self.k
        if needed > self.runner.max_positions:  # max_model_len and its position slack (engine/build.py)
            raise ContextFull(f"sequence {s.seq_id}: a just-in-time draft would take it to {needed} positions, past "
                              f"the draft's max_model_len {self.runner.max_model_len} and its position slack")

    def jit_reply_bytes(self, reqs: list[JitDraftRequest]) -> int:
        """An upper bound of jit_draft(reqs)'s answer encoded (proposal_codec.py): a sampled row's q as dense K x V
        float32 at most, K int32 tokens and framing per row. What the service checks before the worker drafts."""
        sampled = sum(1 for r in reqs if (s := self.seqs.get(r.seq_id)) is not None and s.sampling.temperature > 0)
        return sampled * self.k * self.vocab_size * 4 + len(reqs) * (4 * self.k + 64) + 1024

    def _get(self, seq_id: int) -> DraftSeq:
        s = self.seqs.get(seq_id)
        if s is None:
            raise UnknownSequence(f"unknown sequence {seq_id}")
        return s

    def _cut_back(self, states: list[DraftSeq]) -> list[list[int]]:
        """Cut each KV back to committed[:-1], or to where it departs from it (DraftSeq.kv_committed); the
        committed tokens it lacks (to run)."""
        missing = []
        for s in states:
            stored, want = self.runner.length(s.seq_id), len(s.committed) - 1
            kept = min(want, s.kv_committed(stored))
            if stored > kept:
                self.runner.truncate(s.seq_id, kept)
            s.note_kv_tail([])
            missing.append(s.committed[kept:want])
        return missing

    def _proposal_probs(self, logits: torch.Tensor, rows: RowSampling, top_f: list[int] | None) -> torch.Tensor:
        """What the draft samples from, per row: the request's sampling, then Saguaro sigma_{F,C} (T > 0),
        then its top proposal_top_k tokens (a greedy row is one-hot: both leave it as it is)."""
        probs = sampling_probs(logits, rows)
        if self.saguaro_c < 1.0:
            sampled = (rows.temperature > 0).to(probs.device)
            scaled = saguaro_probs(probs, torch.tensor(top_f), self.saguaro_c)
            probs = torch.where(sampled[:, None], scaled, probs)
        return top_k_proposal(probs, self.config.proposal_top_k)

    def _draw_k(self, rows: list[DraftSeq], fanouts: list[list[int]] | None, logits: torch.Tensor, step,
                generators: Callable[[], list[torch.Generator]], rules: RowRules | None = None,
                grammars: list[GrammarState | None] | None = None) -> tuple[Proposal, list[torch.Tensor]]:
        """K draws per row; step(tokens [R]) -> next logits [R, V]. Position j uses Saguaro's F_j (fanouts
        None: C = 1, no sigma to apply); the requests' penalties, bias, bad words and grammars (each row on
        its own matcher), if any, apply to every draw. generators(): each row's, asked for only if a row samples.
        Returns the draws as columns (tokens [R, K], probs [R, K, V] or None when every row is greedy)
        and the K raw logits [R, V] they came from."""
        greedy = all(s.sampling.temperature == 0 for s in rows)
        sampling = None if greedy else RowSampling.of([s.sampling for s in rows], logits.device)  # once for the K draws
        row_generators = None if greedy else generators()
        tokens, dists, seen = [], [], []
        for j in range(self.k):
            seen.append(logits)
            scored = logits if rules is None else rules.apply(logits)
            if greedy:  # q is one-hot at the argmax: draw it directly, never build the [R, V] tensor
                drawn = greedy_tokens(scored) if grammars is None else greedy_in_grammar(scored, grammars)
            else:
                if grammars is not None:
                    scored = grammar_masked(scored, grammars)
                probs = self._proposal_probs(scored, sampling, None if fanouts is None else [f[j] for f in fanouts])
                drawn = sample(probs, row_generators)
                dists.append(probs)
            tokens.append(drawn)
            if rules is not None:
                rules.drew(drawn)
            if grammars is not None:
                grammars = [g if g is not None and g.advance([t]) else None for g, t in zip(grammars, drawn.tolist())]
            if j + 1 < self.k:
                logits = step(drawn)
        # Proposals leave the worker on the CPU (one copy per draw, not per row): they cross a pipe or
        # gRPC, and the target moves them to its own device.
        return Proposal(torch.stack(tokens, 1).cpu(), torch.stack(dists, 1).cpu() if dists else None), seen

    def _draft_sequentially(self, states: list[DraftSeq]) -> list[Proposal]:
        """K forwards (the SD draft, and SSD's neural backup). The first also runs the committed tokens
        the KV lacks (x_K after a fully accepted round: one forward of 2 tokens, not 2 of 1)."""
        missing = self._cut_back(states)
        ids = [s.seq_id for s in states]
        # Only Saguaro's sigma (C < 1) reads a just-in-time draft's fan-out: ~10 us a shard count a round.
        by_shards = {g: self._fanout(g) for g in {s.num_shards for s in states}} if self.saguaro_c < 1.0 else None
        fanouts = [by_shards[s.num_shards] for s in states] if by_shards else None

        def step(drawn):
            return torch.cat(self.runner.extend(ids, [[t] for t in drawn.tolist()], [1] * len(ids)))
        first = torch.cat(self.runner.extend(ids, [m + s.committed[-1:] for m, s in zip(missing, states)], [1] * len(ids)))
        columns = self._draw_k(states, fanouts, first, step, lambda: [s.draft_generator() for s in states],
                               self.constraints.rows(states, [[] for _ in states]),
                               self.constraints.row_grammars(states, [[] for _ in states]))[0]
        # A copy per row: a view would keep every row's q alive as long as any one is.
        return [Proposal(columns.tokens[i].clone(),
                         None if columns.probs is None or s.sampling.temperature == 0 else columns.probs[i].clone())
                for i, s in enumerate(states)]


class ContextFull(ValueError):
    """A well-formed request the draft cannot serve: it would take a sequence past its max_model_len."""


def refuse_duplicates(msgs: list, what: str) -> None:
    """One message per sequence in a batch: a second would apply on top of the first (or fail after it)."""
    seen: set[int] = set()
    twice = {m.seq_id for m in msgs if m.seq_id in seen or seen.add(m.seq_id)}
    if twice:
        raise ValueError(f"{what} batch names sequence(s) {sorted(twice)[:8]} more than once")


def no_proposal() -> Proposal:
    """The answer to a just-in-time draft of an earlier life: no tokens (a speculation no target verifies)."""
    return Proposal(torch.empty(0, dtype=torch.long), None)


def drafted_elsewhere(o: Outcome) -> bool:
    """Whether o's next speculation is a draft made after the verify by another worker: a miss's, or a
    round's without a tree (not a hit, not the target side's n-gram proposal)."""
    return not o.cache_hit and o.next_tokens is not None and not o.target_proposed
