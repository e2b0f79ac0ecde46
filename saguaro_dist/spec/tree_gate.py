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

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

BURST = 8             # rounds a mode keeps once chosen; the first TRANSITION_ROUNDS are not measured
TRANSITION_ROUNDS = 2  # a mode's first round is partly the last one's; its second pays the catch-up of the
                       # draft that sat idle (the tree side's KV, or the just-in-time worker's, runs every token
                       # since its last forward): one-host b = 1 greedy, a tree round 5.1 ms there against 3.6
                       # from the third on, a just-in-time round 4.9 against 4.4 (session 42)
RETRY_BURST = 5       # rounds of a re-try of a mode that was far behind (more than 2 x CLOSE_GAP)
EXPLORE_EVERY = 96    # rounds at one batch size between re-tries of the slower mode, while the two are close
INHERIT_LEAD = 16     # rounds a new batch size runs the mode that won at the nearest measured one before it
                      # tries the others: longer than a shrinking batch's stay at one size (1-6 rounds, b = 8)
CLOSE_GAP = 0.1       # modes within 10% are close; a slower one g behind is re-tried (g / CLOSE_GAP)^2 ...
MAX_STRETCH = 8       # ... times less often, at most 8 times (a lost mode is never lost for good); and twice
                      # as rarely again for each further re-try in a row that it lost (explore_interval)
SECONDS_DECAY = 0.9   # per round at the batch size: a mode's round time follows its last ~10 rounds, and a
                      # re-try after 96 rounds of the other replaces what was measured before
TOKENS_DECAY = 0.99   # tokens per row, and the fast backup's share of rows, follow the last ~100 rounds
CLIP = 1.5            # a round is counted at most 1.5x its mode's mean round ...
CLIP_AFTER = 3        # ... once the mode has that many measured rounds (a stall is not the mode's cost)
MIN_DRAFT_ROWS = 16   # draft rows measured at a batch size before their yield is offered to the lookup picker
HOLD = 4              # rounds a mode chosen again keeps before the next choice: the choice (~10 us, plus the
                      # n-gram estimate's ~5) ran every round once the bursts ended, ~0.5% of a 4.5 ms SD round at
                      # b = 1 for a choice the ~10-round means move little between rounds


@dataclass(frozen=True)
class RoundYield:
    """What a round gained: `tokens` over its `rows` (sequences), of which `fast_tokens` over
    `fast_rows` rows whose proposals came from the fast backup (n-gram or random), and `lookup_tokens`
    over `lookup_rows` rows that took their n-gram proposal over the draft's (spec/lookup_pick.py)."""
    rows: int
    tokens: int
    fast_rows: int = 0
    fast_tokens: int = 0
    lookup_rows: int = 0
    lookup_tokens: int = 0

    @property
    def draft_rows(self) -> int:
        return self.rows - self.fast_rows - self.lookup_rows

    @property
    def draft_tokens(self) -> int:
        return self.tokens - self.fast_tokens - self.lookup_tokens


class RoundMode(str, enum.Enum):
    TREES = "trees"                # SSD: the draft prepares a tree while the target verifies
    JUST_IN_TIME = "just_in_time"  # SD: the draft drafts after each outcome, no tree
    FAST = "fast"                  # the fast backup (n-gram) proposes for every sequence: no draft, no tree


TWO_MODES = (RoundMode.TREES, RoundMode.JUST_IN_TIME)
Estimate = Callable[[], "float | None"] | None  # a rate estimated on demand (TreeGate.mode's fast_estimate)


@dataclass
class DecayedMean:
    """Mean of the values added, the older ones fading by `decay` per value."""
    decay: float
    total: float = 0.0
    weight: float = 0.0
    count: int = 0
    last_round: int = 0  # add_round's: the round of the last value added

    def add_clipped(self, value: float) -> None:
        """Winsorized: one stall of the box (another process, a page fault; tens of ms against a round of
        a few) would move a ~10-round mean by more than the modes differ, and a mode measured during a
        stall then lost for hundreds of rounds. A miss's round (a just-in-time draft, ~1.5x a hit's at
        b = 1) is mostly under the clip: trees are favoured only where misses cost more than that."""
        mean = self.mean
        self.add(min(value, CLIP * mean) if self.count >= CLIP_AFTER and mean else value)

    def add_round(self, value: float, round_no: int) -> None:
        """add_clipped a round's seconds, `round_no` rounds into its batch size, first fading the mean by
        the rounds since the last one added. Seconds decay by rounds, not by measurements: a way last run
        long ago was measured on another load and text, and a short re-try must be able to replace that,
        not nudge it."""
        self.fade(max(0, round_no - self.last_round - 1))
        self.last_round = round_no
        self.add_clipped(value)

    def add_share(self, value: float, weight: float, round_no: int) -> None:
        """add `value` of `weight` observations, first fading the mean by the rounds since the last one
        added (as add_round, unclipped): for a share that follows a policy that learns, like the lookup
        picker's, which an old burst's share would understate for its ~100-round life."""
        self.fade(max(0, round_no - self.last_round - 1))
        self.last_round = round_no
        self.add(value, weight)

    def fade(self, steps: int) -> None:
        """Age the values by `steps` more decays without adding any (the mean stays where it was)."""
        self.total, self.weight = self.total * self.decay ** steps, self.weight * self.decay ** steps

    def add(self, value: float, weight: float = 1.0) -> None:
        """`value` is the sum of `weight` observations (tokens over rows, say); the mean is per weight."""
        self.total, self.weight = self.decay * self.total + value, self.decay * self.weight + weight
        self.count += 1

    @property
    def mean(self) -> float | None:
        return self.total / self.weight if self.weight else None


def first_mean(*means: DecayedMean) -> float:
    """The mean of the first of `means` with any weight; 1 if none has (a row gains at least its bonus token)."""
    return next((m.mean for m in means if m.weight), 1.0)


def choose_mode(rates: dict, explore: bool, last_run: dict | None = None) -> RoundMode:
    """The first unmeasured mode (in the gate's order: trees first), then the fastest, or when it is time
    to explore a slower one: the one run least lately (so a mode that lost once is not lost for good)."""
    unmeasured = [m for m, rate in rates.items() if rate is None]
    if unmeasured:
        return unmeasured[0]
    fastest = max(rates, key=rates.get)
    slower = [m for m in rates if m is not fastest]
    if not explore or not slower:
        return fastest
    return min(slower, key=lambda m: (last_run or {}).get(m, 0))


def nearest_first(batch_sizes, batch_size: int) -> list[int]:
    """The measured batch sizes, nearest to `batch_size` first, the smaller on a tie: what a new batch size
    learns from (a shrinking batch meets b - 1 after b; the gates' priors read the nearest)."""
    return sorted(batch_sizes, key=lambda b: (abs(b - batch_size), b))


def relative_gap(a: float, b: float) -> float:
    """How far the slower of two rates (or round times) is behind the faster, as a share of the faster."""
    return 1.0 - min(a, b) / max(a, b)


def far_behind(best: float, rate: float) -> bool:
    """Whether `rate` is more than 2 x CLOSE_GAP below `best` (noise and drift rarely close such a gap)."""
    return rate < best and relative_gap(best, rate) > 2 * CLOSE_GAP


def clearly_slower(estimate: float | None, rates: dict) -> bool:
    """Whether an estimated rate is far behind the best measured one (False without both)."""
    best = max((r for r in rates.values() if r is not None), default=None)
    return bool(estimate is not None and best and far_behind(best, estimate))


def burst_length(best_per_s: float | None, explored_per_s: float | None, explore: bool) -> int:
    """Rounds a newly chosen mode keeps: BURST, or RETRY_BURST for a re-try of a mode far behind. Such a
    re-try costs in proportion to its length and only has to notice that the gap closed (then the next
    re-try comes sooner, and is a full burst); three measured rounds do, against a gap over 20%."""
    if not explore or not best_per_s or not explored_per_s:
        return BURST
    return RETRY_BURST if far_behind(best_per_s, explored_per_s) else BURST


def explore_interval(best_per_s: float | None, slower_per_s: float | None, slower_bursts: int,
                     lost_in_a_row: int) -> float:
    """Rounds between re-tries of a slower mode: EXPLORE_EVERY while it is close to the best, up to
    MAX_STRETCH times that when it is far behind, as in a bandit's schedule: a re-try costs in proportion
    to the gap and is needed less the larger it is (noise and drift rarely close a 40% gap). But a gap
    counts only once a re-try of the mode confirmed it (lost_in_a_row: its re-tries in a row that did not
    win): a mode overtaken while it ran may have been measured in a stall of the box, and a gap read from
    it alone kept the mode that stalled out for ~700 rounds (b = 1, T = 0.7, session 73). Each further
    re-try lost doubles the stretch, as an arm's re-tries thin out while it keeps losing (UCB: log t of
    them by round t): a re-try also pays its two switches, which the rates leave out (TRANSITION_ROUNDS;
    there ~3 ms over a 6.4 ms round each). And a gap seen in few bursts may be a fluke (a cold start), so
    the stretch grows by at most one EXPLORE_EVERY per burst the slower mode has run."""
    if not best_per_s or not slower_per_s or lost_in_a_row < 1:
        return EXPLORE_EVERY
    by_gap = max(1.0, (relative_gap(best_per_s, slower_per_s) / CLOSE_GAP) ** 2) * 2 ** (lost_in_a_row - 1)
    return EXPLORE_EVERY * min(MAX_STRETCH, max(1, slower_bursts), by_gap)


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
