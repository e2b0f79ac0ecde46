"""Serving metrics through Ray's metrics (exported by each Ray node's Prometheus endpoint).

Created per replica (never at import). Names follow vLLM's where one exists, prefixed `saguaro_`;
Ray adds its own `ray_` prefix on export.

Ray's histograms export a `_sum` rebuilt from bucket midpoints (Ray 2.47+'s OpenTelemetry recorder; +Inf counts
as twice the last boundary), not the observed sum, so each histogram has a counter beside it,
`<name>_exact_sum` (exported `ray_<name>_exact_sum_total`), of the seconds it observed: mean = its rate over
the histogram's `_count` rate.
"""
from __future__ import annotations

import logging
import time

_LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0]
# Whole requests and first tokens (queueing, long prompts, long outputs) run to minutes: vLLM's tails, so one
# slower than 40 s lands in a finite bucket rather than only in +Inf, where quantiles read it as 40 s.
_TTFT_BUCKETS = [*_LATENCY_BUCKETS, 80.0, 160.0, 640.0, 2560.0]
_E2E_BUCKETS = [*_LATENCY_BUCKETS, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# vLLM's REQUEST_LATENCY_BUCKETS (vllm/v1/metrics/buckets.py), which its request phase histograms share
_PHASE_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0]
# vLLM's request phase histograms: RequestMetrics property -> name, help text (vLLM's)
REQUEST_PHASES = (
    ("time_in_queue_s", "saguaro_request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
    ("prefill_time_s", "saguaro_request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
    ("decode_time_s", "saguaro_request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
    ("inference_time_s", "saguaro_request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request."),
)


# EngineMetrics field -> counter name and help text.
ENGINE_TIME_COUNTERS = (
    ("rounds", "saguaro_rounds", "Engine steps that ran a round (verification) for the running requests"),
    ("step_s", "saguaro_round_seconds", "Wall time of those steps"),
    ("verify_s", "saguaro_verify_seconds", "Of it, target forwards and verification"),
    ("draft_wait_s", "saguaro_draft_wait_seconds", "Of it, the target waiting for trees or just-in-time drafts"),
    ("prefill_s", "saguaro_prefill_seconds", "Of it, prefills"),
)

# EngineMetrics field -> ServeMetrics attribute: engine-wide counts, reported as they grow (vLLM counts per
# engine step), so an aborted request's drafts, lookups and prefix-cache tokens count too.
ENGINE_COUNTERS = (
    ("drafted_tokens", "drafted"),
    ("accepted_tokens", "accepted"),
    ("drafts", "num_drafts"),
    ("cache_hits", "cache_hits"),
    ("cache_misses", "cache_misses"),
    ("prefix_cache_hits", "cached_prompt_tokens"),
    ("prefix_cache_queries", "prefix_cache_queries"),
)
# Every EngineMetrics field the replica's reporter reads and reports the growth of (the per-position counts:
# a snapshot whose difference is elementwise, engine/metrics.py's PositionCounts; the fallbacks: a Counter
# snapshot, whose difference is by kind).
ENGINE_REPORTED_FIELDS = (tuple(f for f, _, _ in ENGINE_TIME_COUNTERS) + tuple(f for f, _ in ENGINE_COUNTERS)
                          + ("accepted_per_position", "fallback_counts"))


class _Noop:
    """Stands in for a Ray metric when the app runs outside Ray (plain uvicorn)."""

    def inc(self, value=1.0, tags=None):
        pass

    def observe(self, value, tags=None):
        pass

    def set(self, value, tags=None):
        pass


class ServeMetrics:
    def __init__(self, model_name: str, enabled: bool = True):
        self._tags = {"model": model_name}
        self.enabled = enabled
        make = _ray_factories() if enabled else None
        self.requests = self._make(make, "counter", "saguaro_requests", "HTTP requests by route and status",
                                   ("model", "route", "status"))
        self.running = self._make(make, "gauge", "saguaro_num_requests_running", "Requests holding a batch slot")
        self.waiting = self._make(make, "gauge", "saguaro_num_requests_waiting", "Requests queued for a batch slot")
        self.kv_usage = self._make(make, "gauge", "saguaro_kv_cache_usage_perc",
                                   "Share of the KV budget (max_batch_size x max_model_len) in use, 0-1")
        # Below draft_workers: a draft worker died and is restarting (or gone): speed is lost, not tokens.
        self.draft_live = self._make(make, "gauge", "saguaro_draft_workers_live", "Draft workers taking sequences")
        self.drafts = self._make(make, "gauge", "saguaro_draft_workers", "Draft workers the engine has")
        # vLLM's lora_requests_info: its tags say which adapters run and wait; its value, when (Unix time), so
        # the newest series is the one to read
        self.lora_info = self._make(make, "gauge", "saguaro_lora_requests_info", "Running stats on LoRA requests",
                                    ("model", "max_lora", "waiting_lora_adapters", "running_lora_adapters"))
        self.prompt_tokens = self._make(make, "counter", "saguaro_prompt_tokens", "Prompt tokens processed")
        self.cached_prompt_tokens = self._make(make, "counter", "saguaro_prefix_cache_hits",
                                               "Prompt tokens whose KV the prefix cache supplied")
        self.prefix_cache_queries = self._make(make, "counter", "saguaro_prefix_cache_queries",
                                               "Prompt tokens looked up in the prefix cache")
        self.generation_tokens = self._make(make, "counter", "saguaro_generation_tokens", "Tokens generated")
        self.ttft = self._make(make, "histogram", "saguaro_time_to_first_token_seconds", "Time to first token",
                               buckets=_TTFT_BUCKETS)
        self.itl = self._make(make, "histogram", "saguaro_inter_token_latency_seconds", "Time per output token")
        self.e2e = self._make(make, "histogram", "saguaro_e2e_request_latency_seconds", "Request latency",
                              buckets=_E2E_BUCKETS)
        self.phases = {field: self._make(make, "histogram", name, doc, buckets=_PHASE_BUCKETS)
                       for field, name, doc in REQUEST_PHASES}
        self.success = self._make(make, "counter", "saguaro_request_success", "Generations finished, by reason "
                                  "(stop, length, abort, ...)", ("model", "finished_reason"))
        # vLLM's spec_decode counters: acceptance rate = accepted / draft tokens, mean acceptance length
        # = 1 + accepted / drafts, per-position acceptance rate = accepted_tokens_per_pos / drafts
        self.drafted = self._make(make, "counter", "saguaro_spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted = self._make(make, "counter", "saguaro_spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.num_drafts = self._make(make, "counter", "saguaro_spec_decode_num_drafts",
                                     "Speculations verified (rows of one or more draft tokens)")
        self.accepted_at = self._make(make, "counter", "saguaro_spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the speculation", ("model", "position"))
        self.cache_hits = self._make(make, "counter", "saguaro_speculation_cache_hits", "Speculation cache hits")
        self.cache_misses = self._make(make, "counter", "saguaro_speculation_cache_misses", "Speculation cache misses")
        self.fallbacks = self._make(make, "counter", "saguaro_fallbacks", "Fallbacks by kind", ("model", "kind"))
        # The round loop's time split: draft_wait over round seconds is the share the target waited for the
        # draft side (trees or just-in-time drafts): the signal that the draft pool is too small or slow.
        self.engine_time = {field: self._make(make, "counter", name, doc) for field, name, doc in ENGINE_TIME_COUNTERS}

    def _make(self, make, kind: str, name: str, doc: str, tag_keys=("model",), buckets=_LATENCY_BUCKETS):
        if make is None:
            return _Noop()
        metric = make[kind](name, doc, tag_keys, buckets)
        metric.set_default_tags({k: v for k, v in self._tags.items() if k in tag_keys})
        if kind == "histogram":
            return _WithExactSum(metric, self._make(make, "counter", f"{name}_exact_sum",
                                                    f"{doc}: the sum of the observed values", tag_keys))
        return metric

    # ---- recording --------------------------------------------------------------------------
    def load(self, load) -> None:
        """The engine's scheduler gauges (an EngineLoad), as vLLM exports them."""
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_usage.set(load.kv_cache_usage)
        self.draft_live.set(load.draft_workers_live)
        self.drafts.set(load.draft_workers)
        if load.max_lora:  # LoRA on
            self.lora_info.set(time.time(), {"max_lora": str(load.max_lora),
                                             "waiting_lora_adapters": ",".join(load.waiting_lora_adapters),
                                             "running_lora_adapters": ",".join(load.running_lora_adapters)})

    def request(self, route: str, status: int) -> None:
        self.requests.inc(1, {"route": route, "status": str(status)})

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, count: int, seconds_since_last: float | None) -> None:
        """A delta of `count` tokens; speculation delivers several at once, so latency is per token."""
        if count <= 0:
            return
        self.generation_tokens.inc(count)
        if seconds_since_last is not None:
            for _ in range(count):
                self.itl.observe(seconds_since_last / count)

    def engine_times(self, delta: dict[str, float]) -> None:
        """Engine-wide counters' growth since the last report (ENGINE_REPORTED_FIELDS -> increments)."""
        for field, metric in self.engine_time.items():
            self._inc_positive(metric, delta.get(field))
        for field, attribute in ENGINE_COUNTERS:
            self._inc_positive(getattr(self, attribute), delta.get(field))
        # position from 0, as vLLM's spec_decode_num_accepted_tokens_per_pos
        for position, count in enumerate(delta.get("accepted_per_position") or ()):
            self._inc_positive(self.accepted_at, count, {"position": str(position)})
        for kind, count in (delta.get("fallback_counts") or {}).items():
            self._inc_positive(self.fallbacks, count, {"kind": str(kind)})

    def speculation_positions(self, k: int) -> None:
        """The per-position series of positions 0..k-1 made now, at 0, as vLLM makes them at start-up: a
        position nothing was accepted at reads a rate of 0, not no data."""
        for position in range(k):
            _create_series(self.accepted_at, {"position": str(position)})

    def finished(self, engine_metrics, seconds: float, finish_reason: str | None = None) -> None:
        self.e2e.observe(seconds)
        self.success.inc(1, {"finished_reason": str(finish_reason)})
        if engine_metrics is None:
            return
        self._phases(engine_metrics)
        self.prompt_tokens.inc(engine_metrics.num_prompt_tokens)
        # (drafts, drafted and accepted tokens and their positions, speculation and prefix cache counts,
        # fallbacks: engine-wide, engine_times, so an aborted request's count too)

    def _phases(self, m) -> None:
        """vLLM's phase histograms: the queue's once its prompt ran, the others' once its first token came (one
        the engine ended in the queue counts in none; one it ended during its prefill, in the queue's alone)."""
        if not m.scheduled:
            return
        fields = [field for field, _, _ in REQUEST_PHASES] if m.first_token_time else ["time_in_queue_s"]
        for field in fields:
            self.phases[field].observe(getattr(m, field))

    def aborted(self, seconds: float, prompt_tokens: int) -> None:
        """A generation that ended unfinished (its client went away, its stream was closed early): counted as
        vLLM counts an aborted request, finished_reason "abort", with its latency and the prompt tokens its
        prefill processed (0 where none is known to have run)."""
        self.e2e.observe(seconds)
        self.success.inc(1, {"finished_reason": "abort"})
        self._inc_positive(self.prompt_tokens, prompt_tokens)

    @staticmethod
    def _inc_positive(metric, value, tags=None) -> None:
        # Ray counters reject non-positive increments.
        if value and value > 0:
            metric.inc(value, tags)


class _WithExactSum:
    """A Ray histogram and the counter of the values it observed (see the module's docstring)."""

    def __init__(self, histogram, exact_sum):
        self.histogram, self.exact_sum = histogram, exact_sum

    def observe(self, value, tags=None):
        self.histogram.observe(value, tags)
        if value > 0:  # Ray counters reject non-positive increments
            self.exact_sum.inc(value, tags)


def _create_series(counter, tags: dict) -> None:
    """A counter's series made at 0 (prometheus_client's labels() does it). Ray's inc() refuses 0, so this
    records through _record, what inc() calls; _Noop has none."""
    record = getattr(counter, "_record", None)
    try:
        if record is not None:
            record(0, tags=tags)
    except Exception:  # noqa: BLE001 - a private API: a Ray that changed it only loses the zero series
        logging.getLogger(__name__).debug("could not create the series %s at 0", tags, exc_info=True)


def _ray_factories() -> dict:
    from ray.util import metrics

    def histogram(name, doc, tag_keys, buckets):
        return metrics.Histogram(name, doc, boundaries=buckets, tag_keys=tag_keys)

    return {  # (buckets: histograms only)
        "counter": lambda name, doc, tag_keys, _: metrics.Counter(name, doc, tag_keys=tag_keys),
        "gauge": lambda name, doc, tag_keys, _: metrics.Gauge(name, doc, tag_keys=tag_keys),
        "histogram": histogram,
    }
