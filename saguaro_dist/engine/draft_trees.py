"""The draft side's speculation trees (SSD): which outcomes each tree answers (the glue over the
speculation, plan_trees) and the branches' K tokens (finish_trees). A part of DraftWorker
(engine/draft_worker.py), which holds the sequences, their KV and the draws these build on."""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch

from saguaro_dist.config import BonusDraw, Config, HitGlue
from saguaro_dist.engine.draft_backend import Lives
from saguaro_dist.engine.draft_constraints import DraftConstraints
from saguaro_dist.engine.draft_state import (
    DraftSeq, LastTree, PlannedTrees, TreeAbandoned, fanout_key, tree_generators, tree_plans,
)
from saguaro_dist.engine.messages import Proposal, SpeculationTree, TreePlan
from saguaro_dist.engine.target import RowSampling, sampling_probs
from saguaro_dist.spec import (
    BudgetController, SpecStats, full_acceptance_worth_skipping, scaled_budget, select_branches,
    without_full_acceptance,
)
from saguaro_dist.spec.coupled import bonus_guess, sampled_branches_of, sparse_guess


class TreeBuilding:
    """DraftWorker's tree builds: a mixin, on the worker's own state (below) and its draws (_draw_k, _cut_back)."""
    config: Config
    runner: object
    k: int
    vocab_size: int
    seqs: dict[int, DraftSeq]
    lives: Lives
    constraints: DraftConstraints
    budget: BudgetController
    stats: SpecStats            # the draft's own proposals; the miss exponent r of every tree
    target_proposed: SpecStats  # k* of the target side's proposals that a tree was built after
    _planned: PlannedTrees | None

    def build_trees(self) -> list[SpeculationTree]:
        """The trees owed for this round, in one call (plan_trees, then finish_trees)."""
        self.plan_trees()
        return self.finish_trees()

    def plan_trees(self) -> list[TreePlan]:
        """First half of a build: choose each owed tree's outcomes (one glue forward). Returns the plans
        worth announcing to the target before the trees: those of trees it has lately had to wait for
        (budget.busy; else none), so that a target whose outcome is not planned misses without waiting."""
        self._planned = None  # a glue that fails leaves nothing for finish_trees to decode
        states = [s for s in self.seqs.values() if s.pending]
        if not states:
            return []
        start = time.perf_counter()
        fanouts = {key: self._fanout(*key) for key in {fanout_key(s) for s in states}}
        rows = self._glue(states, fanouts)
        self._planned = PlannedTrees(states, fanouts, rows, start)
        plans = self._of_their_lives(tree_plans(states, rows))  # a coupled tree's always: its bonus is drawn against it
        return plans if self.budget.busy else [p for p in plans if p.guess_ids is not None]

    def finish_trees(self, abandon: Callable[[list[int]], bool] | None = None) -> list[SpeculationTree]:
        """Second half: decode the planned trees' branches. abandon(seq_ids), if given, is asked between
        decode steps whether the target has moved on from every one of these sequences (their plans told
        it they missed): the build then stops and returns no tree. A sampled build stops too: a tree draws
        from a generator of its own round (DraftSeq.tree_generator), so where a build stopped changes no
        later draw, and a seeded output stays reproducible (README, "Reproducible sampling")."""
        planned, self._planned = self._planned, None
        if planned is None:
            return []
        states = planned.states
        stop = (lambda: abandon([s.seq_id for s in states])) if abandon is not None else None
        try:
            trees = self._decode_branches(states, planned.fanouts, planned.rows, stop)
        except TreeAbandoned:
            for s in states:
                s.forget_tree()
            trees = []
        for s in states:
            s.pending, s.tree_built = False, True
        if trees:
            self._timed(trees, time.perf_counter() - planned.start)
        return self._of_their_lives(trees)

    def _of_their_lives(self, msgs: list) -> list:
        """Trees or plans stamped with their sequence's life: rounds restart at 0 with a re-prefill, and the target
        side tells a late one of an earlier life from the new life's by this alone."""
        for m in msgs:
            m.generation = self.lives.of(m.seq_id)
        return msgs

    def _timed(self, trees: list[SpeculationTree], build_s: float) -> None:
        self.budget.tree_built(build_s)
        for tree in trees:
            tree.build_s = build_s

    def _fanout(self, num_shards: int = 1, target_proposed: bool = False) -> list[int]:
        """F_0..F_K for a tree of num_shards x the configured budget (cache-parallel shards split it),
        for a speculation the draft made or one the target side proposed (each fares its own way)."""
        budget = self.config.fan_out
        if isinstance(budget, tuple):
            budget = [f * num_shards for f in budget]
        else:
            budget = scaled_budget(budget, self.budget.scale, self.k + 1) * num_shards
        outcomes = self.target_proposed if target_proposed else None
        return self.stats.fanout(self.config.fan_out_kind, budget, self.vocab_size, outcomes)

    @staticmethod
    def _rows_of(columns: Proposal, states: list[DraftSeq], lo: int, hi: int) -> Proposal:
        """Rows lo:hi of the draws (one sequence's); no q for a greedy sequence (one-hot on its tokens)."""
        greedy = columns.probs is None or states[lo].sampling.temperature == 0
        return Proposal(columns.tokens[lo:hi], None if greedy else columns.probs[lo:hi])

    def _glue(self, states: list[DraftSeq], fanouts: dict[int, list[int]]) -> list[tuple[int, int, int]]:
        """Draft logits over [b, x_1..x_K]; the candidate bonus tokens of this worker's slice of the tree.
        A speculation that is a branch of the last tree already ran b, x_1..x_{K-1} there: it adopts
        that KV and those logits and runs x_K alone (one token instead of K + 1).

        Returns one (state index, k, bonus token) per branch to build.
        """
        logits = torch.stack([self.constraints.positions(s, x) for s, x in zip(states, self._glue_logits(states))])
        spec = torch.tensor([s.speculation for s in states], dtype=torch.long, device=logits.device)  # [B, K]
        if logits.shape[1] == self.k:  # x_K not run (_glue_logits): outcomes k < K only
            fanouts = {key: without_full_acceptance(f, self.vocab_size) for key, f in fanouts.items()}
        for s in states:
            fanout = fanouts[fanout_key(s)]
            s.fanout = fanout + [0] * (self.k + 1 - len(fanout))  # a lookup at k = K meets F = 0 where x_K was not run
            s.guess = None
        coupled = [i for i, s in enumerate(states) if self._couples(s)]
        plain = [i for i, s in enumerate(states) if not self._couples(s)]
        picked = {}
        for rows, pick in ((coupled, self._sampled_candidates), (plain, self._top_f_candidates)):
            if rows:  # all of them: no copy (the usual build is all coupled at T > 0, all plain at T = 0)
                some = len(rows) < len(states)
                picked.update(zip(rows, pick([states[i] for i in rows], logits[rows] if some else logits,
                                             spec[rows] if some else spec, fanouts)))
        return [(i, kk, t) for i in range(len(states)) for kk, t in picked[i]]

    @staticmethod
    def _top_f_candidates(states: list[DraftSeq], logits: torch.Tensor, spec: torch.Tensor,
                          fanouts: dict[int, list[int]]) -> list[list[tuple[int, int]]]:
        """Per state, (k, t) per branch of this worker's slice: the draft's top-F_k tokens at k, bar x_k (the
        paper's pick; a coupled row draws instead: _sampled_candidates). logits [P, R, V], spec [P, K]."""
        ranking = logits.float().softmax(-1)  # [P, R, V]
        by_fanout: dict[tuple[int, bool], list[int]] = {}
        for i, s in enumerate(states):
            by_fanout.setdefault(fanout_key(s), []).append(i)
        picked: list[list[tuple[int, int]]] = [[] for _ in states]
        # One select_branches per fan-out (per state it cost ~0.3 ms, 64 states a round: a tenth of a round's CPU);
        # topk ranks each row alone, so a batch picks what each state would alone: bit for bit on CPU. On CUDA
        # topk's algorithm depends on the slice count (a full sort at <= 10 slices of V >= 100000, radix select
        # above), so tokens of exactly equal probability may come in another order than a per-state call's:
        # which of equals a tree caches is arbitrary either way, and the verifier is exact whatever it holds.
        for key, rows in by_fanout.items():
            whole = len(rows) == len(states)
            chosen = select_branches(ranking if whole else ranking[rows], spec if whole else spec[rows], fanouts[key])
            for i, ks, bonus in zip(rows, chosen.accepted.tolist(), chosen.bonus.tolist()):
                s = states[i]
                picked[i] = list(zip(ks[s.shard::s.num_shards], bonus[s.shard::s.num_shards]))
        return picked

    def _couples(self, s: DraftSeq) -> bool:
        """Whether s's tree draws its candidates for a coupled bonus (a sampled row, one worker's whole tree)."""
        return self.config.bonus_draw is BonusDraw.COUPLED and s.sampling.temperature > 0 and s.num_shards == 1

    @staticmethod
    def _sampled_candidates(states: list[DraftSeq], logits: torch.Tensor, spec: torch.Tensor,
                            fanouts: dict[int, list[int]]) -> list[list[tuple[int, int]]]:
        """Per state, (k, t) per branch: F_k candidates drawn from the draft's guess of outcome k's bonus, its
        sampling distribution there (spec/coupled.py); the guess, kept sparse, goes to the target with the plan.
        logits [C, R, V], spec [C, K]. One distribution pass for every state's rows (each row its own settings:
        row-wise, the same bits as one state at a time); the draws stay per state, each on its own stream."""
        if not states:
            return []
        c, r, v = logits.shape
        probs = sampling_probs(logits.reshape(c * r, v), RowSampling.of([s.sampling for s in states], logits.device,
                                                                         rows_per_seq=r))
        ids, kept = (x.cpu().view(c, r, -1) for x in sparse_guess(bonus_guess(probs.view(c, r, v), spec).flatten(0, 1)))
        uniforms = torch.empty(kept.shape, dtype=torch.float64)
        for s, s_ids, s_kept, s_uniforms in zip(states, ids, kept, uniforms.unbind(0)):
            s.guess = (s_ids.clone(), s_kept.clone())  # its own: a view would keep the batch's guesses alive
            s_uniforms.uniform_(generator=s.candidate_generator())  # torch.rand(out=)'s numbers, fewer checks
        return sampled_branches_of(ids, kept, [fanouts[fanout_key(s)] for s in states], uniforms)

    def _glue_logits(self, states: list[DraftSeq]) -> list[torch.Tensor]:
        """Draft logits [K+1, V] over [b, x_1..x_K] per state, from one forward: it runs first the committed
        tokens the KV lacks (after a fast-backup round), or x_K alone after a hit on its own branch."""
        missing = self._cut_back(states)
        for s, m in zip(states, missing):
            if m:  # a branch is adopted where the KV holds committed[:-1]; this KV lacks some of it
                s.hit = None
        adopted = [self._adopt_hit(s) for s in states]                             # [K, V] each, or None
        for s in states:  # an adopted branch holds x_1..x_{K-1}; the forward below runs the rest
            s.note_kv_tail(s.speculation)
        if self._skips_x_k(states, adopted):
            return adopted
        tokens = [m + s.committed[-1:] + s.speculation if a is None else s.speculation[-1:]
                  for s, m, a in zip(states, missing, adopted)]
        fresh = self.runner.extend([s.seq_id for s in states], tokens, [len(t) - len(m) for t, m in zip(tokens, missing)])
        return [f if a is None else torch.cat([a, f]) for f, a in zip(fresh, adopted)]

    def _skips_x_k(self, states: list[DraftSeq], adopted: list) -> bool:
        """Whether this glue forward, which would run x_K alone for every sequence (each hit its own
        branch), is left out: the trees then skip k = K (HitGlue; AUTO: while the target waits for trees and
        the hits at k = K are worth less than the forward). Never for cache-parallel shards, whose workers
        must slice one branch list alike."""
        policy = self.config.hit_glue
        if policy is HitGlue.ALWAYS or any(a is None or s.num_shards > 1 for s, a in zip(states, adopted)):
            return False
        return policy is HitGlue.SKIP or (self.budget.busy and full_acceptance_worth_skipping(
            self.stats.outcome_probs, self._fanout(), self.stats.hit_probability))

    def _adopt_hit(self, s: DraftSeq) -> torch.Tensor | None:
        """For a hit on this worker's own branch: its KV into the sequence, and the logits [K, V] its
        tokens were drawn from (the draft's distributions after b, x_1..x_{K-1})."""
        key, s.hit = s.hit, None
        if key is None:
            return None
        row = s.branch_rows[key]
        self.runner.adopt_branch(s.last_tree.state, row, self.k)
        return torch.stack([step[row] for step in s.last_tree.step_logits])

    def _decode_branches(self, states, fanouts, rows, stop: Callable[[], bool] | None = None) -> list[SpeculationTree]:
        """K steps for all branches at once; branch (k, t) attends to P + x_1..x_k, then t. Each state's
        rows are contiguous (_glue lists them state by state): its tree is a slice of the columns.
        Raises TreeAbandoned when stop() says so before a step."""
        if not rows:  # no candidate anywhere (every token barred: bad words, allowed tokens): empty trees
            for s in states:
                s.forget_tree()
            return [SpeculationTree(s.seq_id, s.round, [], [], None) for s in states]
        owners = [states[i] for i, _, _ in rows]
        prefix = [len(s.committed) + k for s, (_, k, _) in zip(owners, rows)]
        state, logits = self.runner.branch_start([s.seq_id for s in owners], prefix, [t for _, _, t in rows])
        paths = ([s.speculation[:k] + [t] for s, (_, k, t) in zip(owners, rows)]
                 if self.constraints.reads_paths(owners) else None)  # read only then

        def step(drawn):
            if stop is not None and stop():
                raise TreeAbandoned
            return self.runner.branch_step(state, drawn)
        columns, seen = self._draw_k(owners, [fanouts[fanout_key(s)] for s in owners], logits, step,
                                     lambda: tree_generators(states, rows), self.constraints.rows(owners, paths),
                                     self.constraints.row_grammars(owners, paths))
        self.runner.branch_end(state)
        last, token_lists, trees, lo = LastTree(state, seen), columns.tokens.tolist(), [], 0
        counts = Counter(i for i, _, _ in rows)
        for i, s in enumerate(states):
            hi = lo + counts[i]
            keys = [(k, t) for _, k, t in rows[lo:hi]]
            s.last_tree, s.branches = last, dict(zip(keys, token_lists[lo:hi]))
            s.branch_rows = {key: lo + j for j, key in enumerate(keys)}
            trees.append(SpeculationTree(s.seq_id, s.round, [k for k, _ in keys], [t for _, t in keys],
                                         self._rows_of(columns, owners, lo, hi) if hi > lo else None))
            lo = hi
        return trees
