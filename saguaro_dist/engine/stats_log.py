"""vLLM's periodic engine log line: what the engine did in the last interval, for operators reading logs."""
from __future__ import annotations

import dataclasses
import logging
import time

from saguaro_dist.engine.metrics import EngineLoad, EngineMetrics

log = logging.getLogger("saguaro_dist.engine.stats")


class Throttle:
    """due() at most once every `every_s` (the first call always): a warning a broken peer or a stalled
    draft side would otherwise repeat every round."""

    def __init__(self, every_s: float):
        self.every_s, self._last = every_s, -float("inf")

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return False
        self._last = now
        return True


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


class StatsLogger:
    """Every `interval_s` (0: never) while the engine works, one INFO line of the interval's throughput,
    queue and speculation figures, from the engine's own counters (differences since the last line); then,
    as vLLM's, once more an interval after the engine went idle (the burst's tail), and no more while idle."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last = EngineMetrics()
        self._owed = False  # work since the last line, or it showed requests: one more line is due

    def working(self) -> None:
        """Before a step with work: after a quiet idle the interval starts now (not averaged over the gap)."""
        if not self._owed:
            self._last_time, self._owed = time.monotonic(), True

    def maybe_log(self, metrics: EngineMetrics, load: EngineLoad) -> None:
        """After a step, or while idle: the line, if an interval has passed and one is owed."""
        now = time.monotonic()
        if not self._owed or not self.interval_s or now - self._last_time < self.interval_s:
            return
        log.info(self.line(metrics, load, now - self._last_time))
        self._last_time, self._last = now, dataclasses.replace(metrics, fallbacks=metrics.fallbacks.copy())
        self._owed = bool(load.num_running or load.num_waiting)

    def idle_wait_s(self) -> float | None:
        """How long the idle loop may wait for work before the owed line is due (None: no line is owed)."""
        if not self._owed or not self.interval_s:
            return None
        return max(0.0, self._last_time + self.interval_s - time.monotonic())

    def line(self, metrics: EngineMetrics, load: EngineLoad, seconds: float) -> str:
        d = {f: getattr(metrics, f) - getattr(self._last, f) for f in (
            "prompt_tokens", "prefix_cache_queries", "prefix_cache_hits", "generated_tokens", "drafted_tokens", "accepted_tokens",
            "rounds", "cache_hits", "cache_misses")}
        fallbacks = dict(metrics.fallbacks - self._last.fallbacks)
        return (f"Avg prompt throughput: {d['prompt_tokens'] / seconds:.1f} tokens/s, "
                f"Avg generation throughput: {d['generated_tokens'] / seconds:.1f} tokens/s, "
                f"Running: {load.num_running} reqs, Waiting: {load.num_waiting} reqs, "
                f"KV cache usage: {100 * load.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * _ratio(d['prefix_cache_hits'], d['prefix_cache_queries']):.1f}%, "
                f"Speculation: acceptance {100 * _ratio(d['accepted_tokens'], d['drafted_tokens']):.1f}%, "
                f"tokens per step {_ratio(d['generated_tokens'], d['rounds']):.2f}, "
                f"tree hit rate {100 * _ratio(d['cache_hits'], d['cache_hits'] + d['cache_misses']):.1f}%, "
                f"fallbacks {fallbacks or 0}" + _draft_workers(load))


def _draft_workers(load: EngineLoad) -> str:
    """Said only when some are down (restarting, or gone for good)."""
    if load.draft_workers_live >= load.draft_workers:
        return ""
    return f", draft workers live: {load.draft_workers_live} of {load.draft_workers}"
