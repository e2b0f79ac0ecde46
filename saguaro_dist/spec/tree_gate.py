"""Trees, just-in-time drafts or n-gram proposals, per batch size, by measurement.

SSD's tree pays only while the draft builds it within the target's verify. When it cannot (a big
batch, sampling at T > 0 where every branch carries a [K, V] distribution, or a draft that slows the
target by sharing its hardware), a round waits for the tree and plain speculative decoding (the draft
drafting K tokens after each outcome) is faster. And where the text repeats itself (code; the demo
pair's greedy loops), the fast backup's n-gram proposals, which cost no draft at all, can beat both
(RoundMode.FAST, offered where the config leaves the backup to the engine: fallback "auto"). Theorem 7
predicts this only from the times it is given; the gate measures instead: tokens per second of rounds
run each way, per batch size, running the fastest and re-trying the slower in short bursts, so a change
(load, text, batch mix) is noticed. Every token is verified exactly whichever way: the gate only
chooses where proposals come from.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from saguaro_dist.spec.decayed_mean import DecayedMean, first_mean
from saguaro_dist.spec.gate_maths import (  # noqa: F401 (re-exported: the old import path of the gate's rules)
    BURST, CLIP, CLIP_AFTER, CLOSE_GAP, EXPLORE_EVERY, HOLD, INHERIT_LEAD, MAX_STRETCH, MIN_DRAFT_ROWS, RETRY_BURST,
    SECONDS_DECAY, TOKENS_DECAY, TRANSITION_ROUNDS, TWO_MODES, Estimate, RoundMode, RoundYield, burst_length, choose_mode,
    clearly_slower, explore_interval, far_behind, nearest_first, relative_gap,
)


@dataclass
class _BatchGate:
    """One batch size's choice. A mode's rate is its expected tokens per round over its seconds per
    round. Tokens per row are pooled over the modes, per proposal source: the draft's rows (cache hits
    and just-in-time drafts) gain what the text allows whichever mode drafted them, so a mode's own
    count would compare the text of its bursts (a re-try on an easy stretch looked faster and kept a
    slower mode for ~100 rounds). Rows the fast backup proposed (a tree round's misses) are counted
    apart, with each mode's share of them: at T > 0 past the critical batch size they gain far less,
    and pooled with the draft's rows they made tree rounds look as productive as just-in-time ones. A FAST
    round's rows count apart from those too: they propose the length their match earns
    (spec/lookup_length.py), a miss K tokens after the draft's guess failed, and pooled, a burst of tree
    rounds' misses made FAST rounds look poor (docs/architecture.md, session 57's replays).
    Rows that took their n-gram proposal over the draft's (spec/lookup_pick.py) are chosen for a good
    match, so they are counted apart from both, with each mode's share of them too."""
    batch_size: int = 1
    mode: RoundMode = RoundMode.TREES
    modes: tuple = TWO_MODES     # the modes it chooses among, trees first
    left: int = BURST            # rounds the current mode still runs before the next choice
    since_explore: int = 0
    unmeasured: int = TRANSITION_ROUNDS  # rounds of the current mode still left out of its measurement
    bursts: dict = field(default_factory=lambda: {m: 0 for m in RoundMode})  # bursts each mode has run
    rounds: int = 0              # rounds at this batch size so far
    seconds: dict = field(default_factory=lambda: {m: DecayedMean(SECONDS_DECAY) for m in RoundMode})
    draft_yield: DecayedMean = field(default_factory=lambda: DecayedMean(TOKENS_DECAY))  # tokens per draft row
    draft_rows: int = 0          # rows the draft_yield was measured over
    fast_yield: DecayedMean = field(default_factory=lambda: DecayedMean(TOKENS_DECAY))   # tokens per fast row (a miss's)
    fast_round_yield: DecayedMean = field(default_factory=lambda: DecayedMean(TOKENS_DECAY))  # tokens per row of FAST rounds
    fast_share: dict = field(default_factory=lambda: {m: DecayedMean(TOKENS_DECAY) for m in RoundMode})
    lookup_yield: DecayedMean = field(default_factory=lambda: DecayedMean(TOKENS_DECAY))  # tokens per lookup row
    lookup_share: dict = field(default_factory=lambda: {m: DecayedMean(SECONDS_DECAY) for m in RoundMode})
    deferred: dict = field(default_factory=dict)  # mode -> rounds at this size before it is first tried (TreeGate._new_gate)
    inherited: RoundMode | None = None  # the winner at a size nearby that this one started with (TreeGate._new_gate)
    last_run: dict = field(default_factory=dict)  # mode -> the last round it ran (which slower mode to re-try)
    lost: dict = field(default_factory=lambda: {m: 0 for m in RoundMode})  # re-tries in a row each mode lost
    retrying: bool = False       # the current mode's burst is a re-try (an exploration) of a slower mode

    def __post_init__(self):
        self.bursts[self.mode] += 1  # the one it starts with

    def untreed_rates(self) -> dict:
        """mode -> rate of the measured modes without trees."""
        rates = {m: self.rate(m) for m in self.modes if m is not RoundMode.TREES}
        return {m: r for m, r in rates.items() if r is not None}

    def untreed_losers(self) -> set:
        """The modes without trees that run more than CLOSE_GAP slower than another mode without trees."""
        rates = self.untreed_rates()
        return {m for m, r in rates.items() if relative_gap(r, max(rates.values())) > CLOSE_GAP}

    def lead_over_trees(self) -> float | None:
        """How much faster the best rounds without trees run than tree rounds (negative: slower); None
        until trees and one other mode were measured."""
        trees, others = self.rate(RoundMode.TREES), self.untreed_rates()
        return None if trees is None or not others else max(others.values()) / trees - 1.0

    def rate(self, mode: RoundMode) -> float | None:
        """Tokens per second of `mode`; None until a burst's worth of its rounds was measured."""
        seconds = self.seconds[mode]
        if seconds.count < BURST - TRANSITION_ROUNDS or not seconds.mean:
            return None
        return self.batch_size * self.tokens_per_row(mode) / seconds.mean

    def tokens_per_row(self, mode: RoundMode) -> float:
        """Expected tokens per row of a `mode` round: its shares of fast-backup and lookup rows at their
        yields, the rest at the draft's (a yield not yet seen takes the draft's, or the fast backup's)."""
        own = (self.fast_round_yield, self.fast_yield) if mode is RoundMode.FAST else (self.fast_yield, self.fast_round_yield)
        draft = first_mean(self.draft_yield, *own, self.lookup_yield)
        fast = first_mean(*own, self.draft_yield, self.lookup_yield)
        lookup = first_mean(self.lookup_yield, self.draft_yield, *own)
        fast_share, lookup_share = self.fast_share[mode].mean or 0.0, self.lookup_share[mode].mean or 0.0
        # The two shares decay apart (the lookup share faster: it follows the picker as it learns), so they can sum
        # past 1 after the rows move from the fast backup to lookups; the fresher lookup share is kept and the fast
        # share capped to the rest, so the three weights stay a distribution (the draft's never negative).
        fast_share = min(fast_share, 1.0 - lookup_share)
        return (1.0 - fast_share - lookup_share) * draft + fast_share * fast + lookup_share * lookup

    def next_round(self, fast_estimate: Estimate = None) -> RoundMode:
        """fast_estimate: tokens per second that rounds of n-gram proposals alone would run at here, estimated
        without running one (TreeGate.mode): asked for only while those rounds are unmeasured here."""
        self.since_explore += 1
        self.rounds += 1
        if self.left > 0:
            self.left -= 1
            return self.mode
        rates = self._candidates(fast_estimate)
        best = max((r for r in rates.values() if r is not None), default=None)
        slower = choose_mode(rates, True, self.last_run)  # (while one is unmeasured, the interval ignores it)
        explore = self.since_explore >= explore_interval(best, rates[slower], self.bursts[slower], self.lost[slower])
        mode = choose_mode(rates, explore, self.last_run)
        if explore:
            self.since_explore = 0
        self._count_lost(rates, mode)
        if mode is not self.mode:
            self.mode, self.unmeasured, self.left = mode, TRANSITION_ROUNDS, burst_length(best, rates[mode], explore) - 1
            self.bursts[mode] += 1
            self.retrying = explore
        else:
            self.left, self.retrying = HOLD - 1, False
        self.last_run[mode] = self.rounds
        return mode

    def _count_lost(self, rates: dict, mode: RoundMode) -> None:
        """A re-try that ends without its mode chosen again was lost (one more in a row); the fastest mode
        has lost none. (A mode overtaken while it ran lost no re-try: explore_interval.)"""
        measured = {m: r for m, r in rates.items() if r is not None}
        if measured:
            self.lost[max(measured, key=measured.get)] = 0
        if self.retrying and mode is not self.mode:
            self.lost[self.mode] += 1

    def _candidates(self, fast_estimate: Estimate = None) -> dict:
        """mode -> rate (None: unmeasured) of the modes this choice may take: all but the deferred ones not
        yet measured, before their rounds, and unmeasured n-gram rounds while their estimate clearly loses."""
        rates = {m: self.rate(m) for m in self.modes}
        rates = {m: r for m, r in rates.items() if not (r is None and self.rounds <= self.deferred.get(m, 0))}
        if rates.get(RoundMode.FAST, 0.0) is None and fast_estimate and clearly_slower(fast_estimate(), rates):
            del rates[RoundMode.FAST]
        return rates

    def winner(self) -> RoundMode | None:
        """The mode of the highest rate once two or more were measured; before, the winner this size
        inherited, if any (a shrinking batch's sizes run it and pass it on), else None. A mode measured
        alone won nothing: the first one tried (trees) is all a few rounds at a size measure, such as a
        warm-up's, and inherited as a winner it ran INHERIT_LEAD rounds at every new size nearby before
        the others were tried (b = 8, T = 0.7: 16 tree rounds of 52 ms against 31 for SD's, session 60)."""
        rates = {m: r for m in self.modes if (r := self.rate(m)) is not None}
        return max(rates, key=rates.get) if len(rates) >= 2 else self.inherited

    def record(self, mode: RoundMode, gained: RoundYield, seconds: float) -> None:
        if mode is not self.mode:
            return
        if self.unmeasured:  # a transition: its cost is the switch's, not the mode's (TRANSITION_ROUNDS)
            self.unmeasured -= 1
            return
        self.seconds[mode].add_round(seconds, self.rounds)
        if gained.draft_rows:
            self.draft_yield.add(gained.draft_tokens, gained.draft_rows)
            self.draft_rows += gained.draft_rows
        if gained.fast_rows:
            (self.fast_round_yield if mode is RoundMode.FAST else self.fast_yield).add(gained.fast_tokens, gained.fast_rows)
        if gained.lookup_rows:
            self.lookup_yield.add(gained.lookup_tokens, gained.lookup_rows)
        self.fast_share[mode].add(gained.fast_rows, gained.rows)
        self.lookup_share[mode].add_share(gained.lookup_rows, gained.rows, self.rounds)


class TreeGate:
    """Per batch size, apart for batches that sample (any row at T > 0) and greedy ones: which RoundMode the
    next round runs, from the measured rounds of each. `modes`: those it may choose, trees first (FAST
    where the config leaves the backup to the engine). Why apart: at T > 0 a tree carries a q per branch
    and n-gram proposals are rarely accepted (tokens a row 3.0 greedy, 1.1 at T = 0.7 on the demo pair), so
    one batch size's rates from greedy traffic misled sampled traffic for the ~100 rounds they take to fade."""

    def __init__(self, modes: tuple = TWO_MODES):
        self.modes = modes
        self._gates: dict[tuple[bool, int], _BatchGate] = {}  # (sampled, batch size) -> its choice

    def mode(self, batch_size: int, sampled: bool = False, fast_estimate: Estimate = None) -> RoundMode:
        """The next round's mode. fast_estimate(), asked for only while it can matter: the tokens per second
        rounds of n-gram proposals alone would run at, from every row's n-gram proposal scored against the text
        (spec/lookup_pick.py) and a verify's time (engine/ssd_loop.py: sampled batches); while those rounds are
        unmeasured at this size and it is clearly slower than the best measured mode, they are not tried: at
        T = 0.7 they gain ~1.1 tokens a row against the draft's ~3.5, and their first burst was 2-16% of a
        pass's rounds at b = 1..8 in the bench (session 60)."""
        gate = self._gates.get((sampled, batch_size))
        if gate is None:  # not setdefault: that would build a _BatchGate every round
            gate = self._gates[sampled, batch_size] = self._new_gate(batch_size, sampled)
        return gate.next_round(fast_estimate)

    def _new_gate(self, batch_size: int, sampled: bool) -> _BatchGate:
        """What the batch sizes measured before (of the same kind, sampled or greedy) say of this one. The
        mode that won at the nearest of them (against another: winner) starts and keeps INHERIT_LEAD rounds
        before the others are tried: a batch shrinking as its sequences end meets b - 1, b - 2, ... for a few
        rounds each, and a burst of each mode at each size used to cost more than those rounds gained (b = 8,
        T = 0.7: trees, first at every new size, ran 28 ms rounds against 17 of the cohorts that won at b = 8,
        and the tree side's catch-up after 30 rounds without trees took 60-80 ms more; a third of a pass's time
        went to its tail). Modes that clearly lost nearby wait longer (_clear_losers)."""
        gates = {b: g for (kind, b), g in self._gates.items() if kind == sampled}
        near = nearest_first(gates, batch_size)
        losers = self._clear_losers(gates, near, batch_size)
        deferred = dict.fromkeys(losers, EXPLORE_EVERY)
        inherited = next((m for b in near if (m := gates[b].winner()) is not None), None)
        if inherited is None or inherited in losers:
            start = next(m for m in self.modes if m not in losers)
        else:
            start = inherited
            deferred.update({m: INHERIT_LEAD for m in self.modes if m not in losers and m is not inherited})
        return _BatchGate(batch_size, mode=start, modes=self.modes, deferred=deferred,
                          inherited=start if start is inherited else None)

    def _clear_losers(self, gates: dict[int, _BatchGate], near: list[int], batch_size: int) -> set[RoundMode]:
        """The modes that wait for the exploration schedule at a new batch size instead of costing a burst
        up front. Trees, when they clearly lost at the nearest smaller measured batch size: a tree's
        draft work grows with the batch faster than a verify's (b x B branch rows a step against b x (K + 1)
        rows scored over the same weights), so trees that lost at b' lose at b > b' too (Saguaro's critical
        batch size). A mode without trees, when it clearly lost to another without trees at the nearest
        measured batch size, either side: which of the draft's and n-gram proposals gains more is the
        text's doing, not the batch's."""
        losers = set()
        leads = {b: g.lead_over_trees() for b, g in gates.items() if b < batch_size}
        measured = [b for b, lead in leads.items() if lead is not None]
        if measured and leads[max(measured)] > CLOSE_GAP:
            losers.add(RoundMode.TREES)
        compared = [b for b in near if len(gates[b].untreed_rates()) >= 2]
        if compared:
            losers |= gates[compared[0]].untreed_losers()
        return losers

    def record(self, batch_size: int, mode: RoundMode, gained: RoundYield, seconds: float, sampled: bool = False) -> None:
        """A finished round of `mode` at `batch_size`: `gained` in `seconds` (prepare + verify)."""
        gate = self._gates.get((sampled, batch_size))
        if gate is not None:
            gate.record(mode, gained, seconds)

    def draft_tokens_per_row(self, batch_size: int, sampled: bool = False) -> float | None:
        """Tokens a row gains from the draft's proposal (a cache hit, a just-in-time draft) at this batch
        size; None until MIN_DRAFT_ROWS rows were measured. Why wait: the lookup picker takes a row's n-gram
        proposal over the draft's on this figure, and a whole round's when it beats the draft's less the
        round's wait for it; at T = 0.7 a row's tokens spread over 1..K + 1, so a few rows' mean can read
        half the true one (1.6 against 3.4, b = 1), and then every row took its lookup (~1 token) and the
        draft, never run, was not measured again: just-in-time rounds were rated as lookup rounds and lost to
        trees and n-gram rounds for ~140 rounds (session 60)."""
        gate = self._gates.get((sampled, batch_size))
        return gate.draft_yield.mean if gate is not None and gate.draft_rows >= MIN_DRAFT_ROWS else None

    def rates(self, batch_size: int, sampled: bool = False) -> dict[str, float | None]:
        gate = self._gates.get((sampled, batch_size))
        return {m.value: gate.rate(m) if gate else None for m in self.modes}
