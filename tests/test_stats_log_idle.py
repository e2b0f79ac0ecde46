"""The stats line when traffic stops (vLLM's): once more as the engine goes idle, over its own interval, then quiet."""
from __future__ import annotations

import logging
import re
import time

from saguaro_dist import LLM, SamplingParams

INTERVAL_S = 0.2
STATS = "saguaro_dist.engine.stats"


def _lines_since(caplog, t0: float) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == STATS and r.created >= t0]


def _generation_throughput(line: str) -> float:
    return float(re.search(r"Avg generation throughput: ([\d.]+) tokens/s", line).group(1))


def _burst(llm, tokens: int) -> float:
    """One short generation; when it ended (time.time(), as log records' `created`)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=params)
    return time.time()


def test_the_tail_of_a_burst_is_logged_once_as_the_engine_goes_idle(tiny_checkpoint, caplog):
    caplog.set_level(logging.INFO, logger=STATS)
    with LLM(model=tiny_checkpoint("llama"), mode="ar", log_stats_interval_s=INTERVAL_S) as llm:
        for tokens in (12, 4):  # the second burst comes after an idle gap of many intervals
            started = time.time()
            ended = _burst(llm, tokens)
            # The burst's tail is logged (the old line waited for the next request, which never comes here), as
            # its interval ends: an interval, and seconds more on a loaded box, after the burst ...
            tail = _first_idle_line(caplog, started, timeout_s=10)
            assert "Running: 0 reqs, Waiting: 0 reqs" in tail.getMessage()
            assert _generation_throughput(tail.getMessage()) > 0
            assert tail.created - ended < 5.0
            # ... once: no line of zeros every interval while idle.
            time.sleep(3 * INTERVAL_S)
            lines = _lines_since(caplog, started)
            assert sum("Running: 0 reqs" in r.getMessage() for r in lines) == 1, [r.getMessage() for r in lines]
            # Over its own interval, not the idle gap before the burst: a burst within one line is reported at
            # about its tokens over (its time + at most an interval), as the line's clock starts with the burst.
            if len(lines) == 1:
                assert _generation_throughput(tail.getMessage()) > 0.5 * 2 * tokens / (tail.created - started)


def _first_idle_line(caplog, t0: float, timeout_s: float) -> logging.LogRecord:
    deadline = time.monotonic() + timeout_s
    while True:
        idle = [r for r in _lines_since(caplog, t0) if "Running: 0 reqs" in r.getMessage()]
        if idle:
            return idle[0]
        assert time.monotonic() < deadline, "no stats line for the burst's tail"
        time.sleep(0.05)
