"""Per row of an SSD round: its prompt-lookup proposal in place of the draft's (its tree, or a draft
made just in time), where that gains more.

Where the text repeats itself, an n-gram's continuation (spec.ngram_proposal) is often a better guess
than the draft's, and it costs no draft: a row that takes it need not wait for the draft. How good it
is shows in the n of the n-gram that matched: on the demo pair's greedy text (8 held-out prompts, 128
tokens each) a 1-gram match's K = 4 tokens gain 2.2 tokens a round (accepted + bonus), a 3-gram's 4.4,
the draft's rows 2.8. Which n beats the draft is the text's and the sampler's doing (at T = 0.7 hardly
any), so it is measured, not set: every row that could wait for the draft offers its proposal (as does
every fast-backup proposal), and once the tokens it guessed are
known (a round or two later) the proposal is scored as if it had been verified. That score has the
verifier's distribution: a one-hot proposal x is accepted with probability p(x), the chance that the
target's own draw is x. The choice reads only tokens already generated, so every token stays exactly
the target's (a lookup proposal is verified as the fast backup's is).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from saguaro_dist.spec.tree_gate import SECONDS_DECAY, TOKENS_DECAY, DecayedMean

MIN_SCORED = 8  # proposals of an n scored before that n's yield is trusted
RECHECK_ROUNDS = 16  # rounds at one (mode, sampled, batch size) after which its last measured wait is stale: the
                     # rounds whose every row took its lookup do not wait, so they cannot update it, and a wait
                     # measured during a stall kept every later round on lookups (b = 1, T = 0.7, trees only: 1.1
                     # tokens a round for 3500 rounds, session 57)
REST_PICKS = 4  # picks at one (mode, sampled, batch size) of which only the first offers, after a pick in which no
                # row could have gained by a lookup even at the best measured yield: an offer (the n-gram search,
                # its scoring) cost ~35 us a round at b = 1, and at T = 0.7 no row took one in 4762 rounds (session
                # 72); offering one pick in four keeps the yields measured, and a change shows within four rounds


def pick_lookup_rows(lookup_tokens: list[float | None], draft_tokens: float | None, hit_rate: float,
                     busy_s: float | None, wait_s: float | None) -> list[bool]:
    """Which rows take their lookup proposal. lookup_tokens: each row's expected tokens (accepted + bonus)
    from it, None where unmeasured; draft_tokens: a row's from the draft's proposal when it has one
    (hit_rate: a tree's branch on a hit; 1 for a draft made now), a miss falling back to the same
    lookup, so the draft yields t_draft = h d + (1 - h) l. A row gains by its lookup where l > d. The
    whole round also saves its wait for the draft (wait_s, over busy_s of the rest of such a round) when
    every row takes its lookup, so that is chosen when
        sum(l) / busy > sum(max(l, t_draft)) / (busy + wait)."""
    if draft_tokens is None:
        return [False] * len(lookup_tokens)
    each = [t is not None and t > draft_tokens for t in lookup_tokens]
    if busy_s and wait_s and all(t is not None for t in lookup_tokens):
        alone = sum(lookup_tokens) / busy_s
        mixed = sum(max(t, hit_rate * draft_tokens + (1.0 - hit_rate) * t) for t in lookup_tokens) / (busy_s + wait_s)
        if alone > mixed:
            return [True] * len(lookup_tokens)
    return each


def could_gain(best_tokens: float | None, rows: int, draft_tokens: float | None, hit_rate: float,
               busy_s: float | None, wait_s: float | None) -> bool:
    """Whether pick_lookup_rows could take any of `rows` rows' lookups were each at the best measured yield
    (True while that or the draft's is unknown). It takes more the more each row's lookup yields: alone minus
    mixed grows with every l, so no row at or below the best can be taken when none at the best is."""
    if best_tokens is None or draft_tokens is None:
        return True
    return any(pick_lookup_rows([best_tokens] * rows, draft_tokens, hit_rate, busy_s, wait_s))


def mean_at(table: dict, key, decay: float) -> DecayedMean:
    """table[key], made on first use (not setdefault: its default would build a DecayedMean every round)."""
    mean = table.get(key)
    if mean is None:
        mean = table[key] = DecayedMean(decay)
    return mean


@dataclass(frozen=True)
class Guess:
    """A lookup proposal offered at `position` (the index of the first token it guessed)."""
    position: int
    tokens: tuple[int, ...]
    key: tuple[int, bool]  # (n of the n-gram matched, whether the row is greedy)


def score(guess: Guess, tokens: list[int]) -> int | None:
    """Tokens the guess would have gained (accepted + bonus), or None while `tokens` (the sequence) does
    not yet show it: a mismatch, or every guessed token, must be known."""
    known = tokens[guess.position:guess.position + len(guess.tokens)]
    for j, (guessed, real) in enumerate(zip(guess.tokens, known)):
        if guessed != real:
            return j + 1
    return len(guess.tokens) + 1 if len(known) == len(guess.tokens) else None


@dataclass
class LookupPicker:
    """The measured yields behind pick_lookup_rows: lookup proposals' per (n, greedy), scored when their
    tokens are known; and per (round mode, sampled, batch size) a round's seconds apart from its wait for
    trees and drafts. A wait not measured for RECHECK_ROUNDS rounds there is stale: the next round makes
    the per-row choice, which waits, and measures it afresh."""
    yields: dict = field(default_factory=dict)   # (n, greedy) -> DecayedMean of tokens a proposal gained
    pending: dict = field(default_factory=dict)  # seq_id -> deque of Guess not yet scored
    busy: dict = field(default_factory=dict)     # (mode, sampled, batch size) -> DecayedMean of round seconds - wait
    waits: dict = field(default_factory=dict)    # (mode, sampled, batch size) -> DecayedMean of waits of rounds that waited
    rounds: dict = field(default_factory=dict)   # (mode, sampled, batch size) -> rounds recorded there
    resting: dict = field(default_factory=dict)  # (mode, sampled, batch size) -> picks left there that offer nothing

    def expected(self, key: tuple[int, bool]) -> float | None:
        mean = self.yields.get(key)
        return mean.mean if mean is not None and mean.count >= MIN_SCORED else None

    def pooled_yield(self, greedy: bool) -> float | None:
        """Tokens a K-token lookup proposal of a greedy (or a sampling) row gains, whatever its n: the mean over
        every scored proposal (None before MIN_SCORED): what a round of them alone would gain a row."""
        means = [m for (_, key_greedy), m in self.yields.items() if key_greedy == greedy]
        weight = sum(m.weight for m in means)
        if sum(m.count for m in means) < MIN_SCORED or not weight:
            return None
        return sum(m.total for m in means) / weight

    def best_yield(self, greedy: set[bool]) -> float | None:
        """The best measured yield of proposals for rows of these kinds (greedy, sampling), over every n seen;
        None while any of those is not yet trusted (it may be the better)."""
        means = [m for (_, key_greedy), m in self.yields.items() if key_greedy in greedy]
        if not means or any(m.count < MIN_SCORED for m in means):
            return None
        return max(m.mean for m in means)

    def rests(self, where: tuple) -> bool:
        """Whether this pick at `where` offers nothing (REST_PICKS); counts it."""
        left = self.resting.get(where, 0)
        if left:
            self.resting[where] = left - 1
        return left > 0

    def rest(self, where: tuple) -> None:
        """No row could have gained by its lookup at `where` (could_gain): the next picks there offer nothing."""
        self.resting[where] = REST_PICKS - 1

    def offer(self, seq_id: int, guess: Guess) -> None:
        """Score `guess` once its tokens are known; one guess a position (a row that did not take its lookup
        and then missed its tree is offered the same proposal again by the fallback)."""
        guesses = self.pending.setdefault(seq_id, deque())
        if not guesses or guesses[-1].position != guess.position:
            guesses.append(guess)

    def observe(self, seq_id: int, tokens: list[int]) -> None:
        """Score the sequence's guesses that its tokens now show, oldest first."""
        guesses = self.pending.get(seq_id)
        while guesses:
            gained = score(guesses[0], tokens)
            if gained is None:
                return
            mean_at(self.yields, guesses[0].key, TOKENS_DECAY).add(gained)
            guesses.popleft()

    def forget(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)

    def record_round(self, where: tuple, seconds: float, waited_s: float | None) -> None:
        """A round at `where` took `seconds`; waited_s: its wait for trees and drafts, None if none waited."""
        self.rounds[where] = self.rounds.get(where, 0) + 1
        mean_at(self.busy, where, SECONDS_DECAY).add_clipped(seconds - (waited_s or 0.0))
        if waited_s is not None:
            if self._stale_wait(where):  # the re-check: it starts the wait afresh
                del self.waits[where]
            wait = mean_at(self.waits, where, SECONDS_DECAY)
            wait.add_clipped(waited_s)
            wait.last_round = self.rounds[where]

    def round_times(self, where: tuple) -> tuple[float | None, float | None]:
        """(busy seconds, wait for trees and drafts) of a round at `where`, None before a measurement (the
        wait also once stale: RECHECK_ROUNDS)."""
        busy, wait = self.busy.get(where), self.waits.get(where)
        return (busy.mean if busy else None), (None if wait is None or self._stale_wait(where) else wait.mean)

    def _stale_wait(self, where: tuple) -> bool:
        wait = self.waits.get(where)
        return wait is not None and self.rounds[where] - wait.last_round > RECHECK_ROUNDS
