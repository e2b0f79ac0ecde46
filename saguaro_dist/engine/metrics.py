"""Per-request and engine-wide speculation metrics."""
from __future__ import annotations

import dataclasses
import enum
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """One request's counters and times. Durations are in seconds on the engine's clock (time.perf_counter),
    from the request's arrival at the engine (on Ray, at rank 0's): arrival -> first scheduled (time_in_queue_s)
    -> first token (prefill_time_s; time_to_first_token_s is the two together) -> last token (decode_time_s).
    vLLM's phases (its request_queue / prefill / decode / inference_time_seconds histograms and span attributes)."""
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    rounds: int = 0                  # verification rounds (AR: decode steps)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)  # fallback kind -> times used
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds that accepted draft token i+1
    time_to_first_token_s: float = 0.0
    first_token_time: float = 0.0    # wall clock (time.time()) when the first token came, vLLM's name
    total_time_s: float = 0.0
    num_cached_tokens: int = 0       # prompt tokens whose KV the prefix cache supplied (vLLM's name)
    first_scheduled_time: float = 0.0  # wall clock (time.time()) when first scheduled, vLLM's name; 0: never
    time_in_queue_s: float = 0.0
    """Arrival -> first scheduled: the first engine step that ran part of its prompt (with chunked prefill, the
    first chunk's start; a prompt the prefix cache holds whole, its last token's). Later chunks change nothing."""
    prefill_time_s: float = 0.0
    """First scheduled -> first token (vLLM's prefill interval): every chunk of its prompt, and the steps of
    other requests' rounds between them."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per round, the bonus token included."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def cache_hit_rate(self) -> float:
        lookups = self.cache_hits + self.cache_misses
        return self.cache_hits / lookups if lookups else 0.0

    @property
    def scheduled(self) -> bool:
        """Whether any of its prompt ran (an abort in the queue: never)."""
        return self.first_scheduled_time > 0

    @property
    def decode_time_s(self) -> float:
        """First token -> last (vLLM's decode interval; an aborted request's: to its abort); 0 before a first token."""
        return max(0.0, self.total_time_s - self.time_to_first_token_s) if self.first_token_time else 0.0

    @property
    def inference_time_s(self) -> float:
        """First scheduled -> last token (vLLM's inference interval: prefill and decode)."""
        return self.prefill_time_s + self.decode_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def record_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def record_scheduled(self, since_arrival_s: float) -> None:
        """Its prompt starts to run, since_arrival_s after it arrived: the end of its wait in the queue. Only
        the first time counts (vLLM's first SCHEDULED event): a chunked prompt's later parts are its prefill."""
        if not self.scheduled:
            self.first_scheduled_time = time.time()
            self.time_in_queue_s = since_arrival_s

    def record_first_token(self, since_arrival_s: float) -> None:
        """Its first token came, since_arrival_s after it arrived: the end of its prefill."""
        self.time_to_first_token_s = since_arrival_s
        self.first_token_time = time.time()
        self.prefill_time_s = since_arrival_s - self.time_in_queue_s if self.scheduled else 0.0

    def record_fallback(self, kind: str) -> None:
        self.fallbacks[kind] = self.fallbacks.get(kind, 0) + 1

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for name in ("acceptance_rate", "mean_accepted_length", "cache_hit_rate", "tokens_per_s", "decode_time_s",
                     "inference_time_s"):
            out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds at one moment (vLLM's scheduler gauges: the signals autoscalers read)."""
    num_running: int = 0               # requests holding a batch slot (generating or prefilling)
    num_waiting: int = 0               # requests queued for a slot
    kv_cache_tokens: int = 0           # positions of the running requests' KV in the target's pool ...
    kv_cache_capacity_tokens: int = 0  # ... of max_batch_size x max_model_len, the worst case sized at start-up
    draft_workers_live: int = 0        # draft workers taking sequences (a draft process, actor or thread) ...
    draft_workers: int = 0             # ... of all the engine has (0 without a draft: ar, ngram)
    # vLLM's lora_requests_info: the adapters (lora_name) of running and of waiting requests, by first
    # appearance, and the adapters a batch may run (max_loras; 0: LoRA off)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Share of the KV budget in use, 0..1 (vLLM's kv_cache_usage_perc). The pool is a row per batch
        slot, so a full batch of short requests reads low here and is bounded by num_running instead."""
        return self.kv_cache_tokens / self.kv_cache_capacity_tokens if self.kv_cache_capacity_tokens else 0.0


@dataclass
class EngineMetrics:
    """Wall time split of the round loop, summed over rounds (seconds)."""
    rounds: int = 0
    verify_s: float = 0.0        # target forwards + verification
    draft_wait_s: float = 0.0    # target side waiting for trees / just-in-time drafts ...
    plan_wait_s: float = 0.0     # ... of it, SSD's coupled bonus draws: after a verify's forward, for the plans of the trees built beside it
    coupled_draws: int = 0       # SSD: sampled rows whose bonus was drawn against their tree's candidates (spec/coupled.py)
    prefill_s: float = 0.0
    step_s: float = 0.0          # whole steps; coordination = step - verify - draft_wait - prefill
    cache_hits: int = 0
    cache_misses: int = 0
    just_in_time_rounds: int = 0  # SSD rounds the tree gate ran without trees (spec/tree_gate.py) ...
    cohort_rounds: int = 0        # ... of them, those verified as two cohorts, one drafted beside the other's verify (spec/cohorts.py)
    fast_rounds: int = 0          # SSD rounds the tree gate ran on the fast backup's n-gram proposals alone (RoundMode.FAST) ...
    fast_round_tokens: int = 0    # ... and the tokens they verified (no tree or draft waited for: outside Theorem 7)
    lookup_rows: int = 0          # SSD: rows that took their n-gram proposal over the draft's, a tree or a draft made now (spec/lookup_pick.py) ...
    lookup_rounds: int = 0        # ... the rounds in which every row did (so none waited for the draft) ...
    lookup_round_tokens: int = 0  # ... and the tokens those verified (one verify each, as fast_rounds: outside Theorem 7)
    jit_rounds: int = 0          # rounds that waited for a just-in-time draft (SD: all; SSD: Theorem 7's 1 - p) ...
    jit_round_tokens: int = 0    # ... and the tokens those rounds verified (Theorem 7's E[tokens | miss])
    tree_build_s: float = 0.0    # SSD: the draft's own build time of the trees the target took, summed ...
    tree_builds: int = 0         # ... over the rounds that took trees (Theorem 7's T_p, measured in the run)
    late_trees: int = 0          # SSD: trees the target stopped waiting for after tree_timeout_s (a miss each)
    prompt_tokens: int = 0         # every admitted prompt's tokens
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (not with it off, nor prompt_logprobs) ...
    prefix_cache_hits: int = 0     # ... and of them, tokens whose KV it supplied (vLLM's counters)
    generated_tokens: int = 0    # output tokens of every request
    drafted_tokens: int = 0      # speculated tokens the target verified ...
    accepted_tokens: int = 0     # ... and of them, those it accepted
    drafts: int = 0              # speculations (rows of >= 1 token) verified, vLLM's spec_decode_num_drafts ...
    accepted_lengths: list[int] = field(default_factory=list)  # ... [k]: those of which it accepted exactly k tokens
    fallbacks: Counter = field(default_factory=Counter)

    def record_draft(self, drafted: int, accepted: int) -> None:
        """One row's verified speculation, aborted requests' too (vLLM counts per engine step). One add per
        row for the positions: accepted_per_position sums the lengths when read."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if not drafted:
            return
        self.drafts += 1
        if accepted >= len(self.accepted_lengths):
            self.accepted_lengths += [0] * (accepted + 1 - len(self.accepted_lengths))
        self.accepted_lengths[accepted] += 1

    @property
    def accepted_per_position(self) -> PositionCounts:
        """[i]: speculations whose draft token at position i (from 0, vLLM's spec_decode_num_accepted_tokens_per_pos)
        was accepted: those accepting more than i tokens. A snapshot: the engine thread counts on."""
        return PositionCounts(accepted_per_position(list(self.accepted_lengths)))

    @property
    def fallback_counts(self) -> Counter:
        """fallbacks (kind -> rounds) as a snapshot: `later - earlier` is their growth by kind (the serving
        reporter's delta). Counter(...) copies in one C call, so the engine thread cannot change it mid-copy."""
        return Counter(self.fallbacks)

    @property
    def coordination_s(self) -> float:
        return max(0.0, self.step_s - self.verify_s - self.draft_wait_s - self.prefill_s)

    def to_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "fallbacks"}
        out["fallbacks"] = dict(self.fallbacks)
        out["coordination_s"] = self.coordination_s
        return out


def accepted_per_position(accepted_lengths: list[int]) -> list[int]:
    """Counts of speculations by tokens accepted -> counts accepting each position: suffix sums past [0]."""
    out, running = [], 0
    for count in reversed(accepted_lengths[1:]):
        running += count
        out.append(running)
    return out[::-1]


class PositionCounts(tuple):
    """Per-position counts; `later - earlier` is their growth (the serving reporter's delta of each counter)."""

    def __sub__(self, earlier: tuple) -> PositionCounts:
        return PositionCounts(now - (earlier[i] if i < len(earlier) else 0) for i, now in enumerate(self))


class RoundTokens(str, enum.Enum):
    """The EngineMetrics counters of the tokens one kind of round emitted."""
    JIT = "jit_round_tokens"
    FAST = "fast_round_tokens"
    LOOKUP = "lookup_round_tokens"


class EmittedTokens:
    """Counts rounds' tokens into EngineMetrics once the engine has appended them: only what the sequences
    emitted. A round verifies past an EOS, a stop token or string, max_tokens or a grammar failure, and the
    engine drops what follows the end; counted at verify time, those made tokens per round (Theorem 7's
    E[tokens | miss] in the bench) too high. A round is settled once metrics.rounds has passed it (the engine
    counts a step after appending its tokens), at the loop's next verify or release: counters read while
    requests run lag one step."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics
        self._pending: list[tuple[int, RoundTokens, object, int]] = []  # (round, counter, sequence, output length before)

    def note(self, seqs: list, counter: RoundTokens) -> None:
        """seqs' tokens of the round being verified now count into `counter`, once appended."""
        at = self.metrics.rounds
        self._pending += [(at, RoundTokens(counter), s, len(s.output_token_ids)) for s in seqs]

    def settle(self) -> None:
        """Count the tokens of the rounds the engine has finished appending."""
        done = [p for p in self._pending if p[0] < self.metrics.rounds]
        if not done:
            return
        self._pending = [p for p in self._pending if p[0] >= self.metrics.rounds]
        for _, counter, s, before in done:
            name = counter.value
            setattr(self.metrics, name, getattr(self.metrics, name) + max(0, len(s.output_token_ids) - before))
