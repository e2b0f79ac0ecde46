"""`saguaro bench --request-rates`: our systems serving one stream of requests, as a server batches them.

The grid runs static batches: b prompts together, the next b once all are done, so a batch's last row
runs alone for its tail (b = 8: 18-27% of a pass, docs/benchmarks.md, session 57), and a policy that lets
rows race apart pays for it there. A server batches continuously: a finished row's slot goes to the next
request at once. Here every system gets the same requests (prompts, seeds, arrival times: a Poisson
stream of `rate` requests a second, or all at once for inf), at most max_batch_size running, and reports
what a server's users read (vLLM's benchmark_serving, in process): output tokens/s, time to first token,
time per output token after it, end-to-end latency. transformers' generate has no continuous batching,
so only our systems serve.
"""
from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from saguaro_dist import SamplingParams
from saguaro_dist.bench.config import OURS, BenchConfig, placement
from saguaro_dist.bench.departures import judge_cells
from saguaro_dist.bench.paired import paired_ratios
from saguaro_dist.bench.prompts import bench_prompts, resolve_pair
from saguaro_dist.bench.runner import SCHEMA_VERSION, Failed, close_quietly, context, rotated, vocab_size
from saguaro_dist.bench.systems import engine_delta, make_system, repin
from saguaro_dist.engine.metrics import RequestMetrics

SERVING_SYSTEMS = ("ar", "sd", "ngram", "ssd")  # --request-rates without --systems
SPREAD = (("mean", None), ("p50", 50), ("p99", 99))
SUMMED = ("failed_requests", "requests_without_usage")  # counts a cell sums over its repeats (a median hid a repeat's)
COUNTS = ("requests", "output_tokens")  # counts a cell takes a repeat's of (median_low: an int, as the JSON's others)


@dataclass(frozen=True)
class ServingConfig:
    """A serving run: `base` gives the pair, systems, settings, temperatures, max_new_tokens, repeats and
    seed, and max(base.batch_sizes) the slots (max_batch_size); each rate streams num_requests requests."""
    base: BenchConfig = field(default_factory=lambda: BenchConfig(systems=SERVING_SYSTEMS))
    rates: tuple[float, ...] = (math.inf,)  # requests a second; inf: all at once
    num_requests: int = 32

    def __post_init__(self):
        check_stream(self.rates, self.num_requests)
        others = [s for s in self.base.systems if s not in OURS]
        if others:
            raise ValueError(f"{others} cannot serve a stream (transformers' generate has no continuous batching); "
                             f"serving runs our systems: {', '.join(OURS)}")

    def to_dict(self) -> dict:
        return {"rates": [rate_label(r) for r in self.rates], "num_requests": self.num_requests,
                "max_batch_size": max(self.base.batch_sizes)}


def check_stream(rates: tuple[float, ...], num_requests: int) -> None:
    if not rates or not all(r > 0 for r in rates):  # (NaN fails r > 0 too)
        raise ValueError(f"request rates must be > 0 requests a second (inf: all at once), got {list(rates)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")


def rate_label(rate: float) -> float | str:
    """A rate as JSON holds it: "inf" for all at once (JSON has no infinity)."""
    return "inf" if math.isinf(rate) else rate


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the stream's start at which each of n requests arrives: a Poisson process of `rate` a
    second (exponential gaps, seeded; the first at 0), or every one at 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng, at, offsets = random.Random(seed), 0.0, []
    for _ in range(n):
        offsets.append(at)
        at += rng.expovariate(rate)
    return offsets


@dataclass
class Served:
    """One request's output and the engine's metrics of it (arrival to first token, to finish)."""
    tokens: list[int]        # the output's ids (in process; a server's stream gives text, so none)
    metrics: RequestMetrics  # num_generated_tokens counts the output either way
    # Seconds between successive streamed chunks (vLLM's ITL): a server's stream; none in process (one final delta)
    itl_s: list[float] = field(default_factory=list)
    counted: bool = True     # False: a server's stream said no token count (no usage), so its tokens read 0

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None for a one-token output."""
        m = self.metrics
        n = m.num_generated_tokens
        return (m.total_time_s - m.time_to_first_token_s) / (n - 1) if n > 1 else None


async def _request(llm, prompt: list[int], params, at: float) -> Served:
    """Submit at perf_counter time `at`, then wait for the whole output (one delta: FINAL_ONLY)."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    tokens, metrics = [], None
    async for delta in llm.stream(prompt_token_ids=prompt, sampling_params=params, output_kind="final_only"):
        tokens += delta.token_ids
        metrics = delta.metrics
    return Served(tokens, metrics)


def serve_stream(llm, prompts: list[list[int]], params: list, offsets: list[float]) -> tuple[list[Served], float]:
    """Every request at its offset from now; (the requests in prompt order, seconds to the last one's end)."""
    async def stream():
        start = time.perf_counter()
        served = await asyncio.gather(*(_request(llm, p, sp, start + o) for p, sp, o in zip(prompts, params, offsets)))
        return list(served), time.perf_counter() - start
    return run_to_end(stream)


def run_to_end(make_coroutine):
    """make_coroutine() run to its end on a fresh event loop. Inside a running loop (a notebook cell, an
    async caller) asyncio.run refuses, so the fresh loop runs on a helper thread while the caller waits:
    the engine's streams only need some loop to deliver to, not the caller's."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coroutine())
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="saguaro-bench-stream") as helper:
        return helper.submit(asyncio.run, make_coroutine()).result()


def spread(name: str, seconds: list[float]) -> dict:
    """{name_mean, name_p50, name_p99} in ms (None without values)."""
    if not seconds:
        return {f"{name}_{label}": None for label, _ in SPREAD}
    ms = np.asarray(seconds) * 1e3
    return {f"{name}_{label}": float(ms.mean() if q is None else np.percentile(ms, q)) for label, q in SPREAD}


def summarize(served: list[Served], seconds: float) -> dict:
    """A stream's figures: throughput over its whole time, latencies per request, speculation counts."""
    ms = [s.metrics for s in served]
    tokens = sum(m.num_generated_tokens for m in ms)
    drafted, accepted = sum(m.drafted_tokens for m in ms), sum(m.accepted_tokens for m in ms)
    lookups = sum(m.cache_hits + m.cache_misses for m in ms)
    return {"requests": len(served), "output_tokens": tokens, "seconds": seconds,
            "output_tokens_per_s": tokens / seconds, "requests_per_s": len(served) / seconds,
            **spread("ttft_ms", [m.time_to_first_token_s for m in ms]),
            **spread("tpot_ms", [t for s in served if (t := s.tpot_s) is not None]),
            **spread("itl_ms", [gap for s in served for gap in s.itl_s]),  # every gap of every request, as vLLM's
            **spread("e2e_ms", [m.total_time_s for m in ms]),
            "acceptance_rate": accepted / drafted if drafted else None,
            "cache_hit_rate": sum(m.cache_hits for m in ms) / lookups if lookups else None}


def run_serving(serving: ServingConfig, progress: bool = True) -> dict:
    """Every system under every setting serves the same streams, per temperature and rate."""
    cfg = serving.base
    target, draft = resolve_pair(cfg.target, cfg.draft)
    prompts, _ = bench_prompts(target, serving.num_requests, cfg.prompt_len, cfg.seed, vocab_size(target))
    source = f"{serving.num_requests} requests of {cfg.prompt_len} prompt tokens (held-out stdlib snippets, or random ids)"
    total = len(cfg.settings) * len(cfg.temperatures) * len(serving.rates) * len(cfg.systems)
    cells = []
    with tqdm(total=total, desc="saguaro bench serving", unit="cell", disable=not progress) as bar:
        for setting in cfg.settings:
            cells += serve_setting(serving, setting, target, draft, prompts, bar)
    # request i of every repeat is prompt i: each repeat's outputs, one after another, are rows of prompts x repeats
    judge_cells(cells, prompts * cfg.repeats, target, cfg.dtype, cfg.device, group=("setting", "rate"),
                rows=lambda cell: [out for run in cell["outputs"] for out in run])
    annotate_serving(cells)
    return {"schema": SCHEMA_VERSION, "kind": "serving", "config": cfg.to_dict(), "serving": serving.to_dict(),
            **context(target, draft, source, cfg), "cells": cells, "errors": serving_errors(cells)}


def serving_errors(cells: list[dict]) -> list[dict]:
    """The cells whose system failed, and why (empty when every stream was served)."""
    return [{k: c[k] for k in ("system", "setting", "temperature", "rate", "error")} for c in cells if c.get("error")]


def serve_setting(serving: ServingConfig, setting: str, target: str, draft: str, prompts, bar) -> list[dict]:
    """Per temperature fresh engines, every system open at once (the grid's --interleave): an untimed stream
    of every request at once first, then each repeat streams to every system in turn, the order rotating.
    A system that fails (loading, a stream) reports it in its cells from there on; the others go on (one
    system's crash lost every cell of the run)."""
    cfg, cells = serving.base, []
    places = {s: placement(s, setting, cfg.cores) for s in cfg.systems}
    for temperature in cfg.temperatures:
        systems = {s: make_system(s, target, draft, cfg.engine_kwargs()) for s in cfg.systems}
        broken: dict[str, Failed] = {}  # system -> its failure, for every rate from it on
        try:
            for name, system in systems.items():
                bar.set_postfix_str(f"{setting}/{name}: loading")
                attempt(broken, name, f"{name} T={temperature}, loading", warmed_up, system, places[name], prompts,
                        temperature, cfg)
            for rate in serving.rates:
                bar.set_postfix_str(f"{setting} T={temperature} rate={rate_label(rate)}")
                runs = serve_interleaved(systems, prompts, temperature, rate, cfg, broken)
                cells += [serving_error_cell(name, setting, temperature, rate, places[name].to_dict(), broken[name].error)
                          if name in broken else
                          serving_cell(name, setting, temperature, rate, runs[name], places[name].to_dict())
                          for name in systems]
                bar.update(len(systems))
        finally:
            for name, system in systems.items():
                close_quietly(system, name)
    return cells


def warmed_up(system, place, prompts, temperature: float, cfg: BenchConfig) -> None:
    """Open `system` and serve it one untimed stream of every request at once."""
    system.open(place)
    run_one(system, prompts, temperature, math.inf, cfg, repeat=0)


def attempt(broken: dict, name: str, where: str, work, *args):
    """work(*args), or None with the failure recorded in broken[name] (None at once if already broken)."""
    if name in broken:
        return None
    try:
        return work(*args)
    except Exception as err:  # noqa: BLE001 - reported in the cells; the other systems go on
        broken[name] = Failed.of(err, where)
        return None


def serve_interleaved(systems: dict, prompts, temperature: float, rate: float, cfg: BenchConfig,
                      broken: dict | None = None) -> dict[str, list[dict]]:
    """Repeat r: every system serves stream r (its own arrivals and seeds), in the order rotated by r; one that
    fails is recorded in `broken` and left out of the streams after it."""
    names, runs, broken = list(systems), {name: [] for name in systems}, {} if broken is None else broken
    for r in range(cfg.repeats):
        for name in rotated(names, r):
            run = attempt(broken, name, f"{name} T={temperature} rate={rate_label(rate)} repeat {r}",
                          run_one, systems[name], prompts, temperature, rate, cfg, r)
            if run is not None:
                runs[name].append(run)
    return runs


def stream_plan(n: int, rate: float, cfg: BenchConfig, repeat: int) -> tuple[list[int], list[float]]:
    """Repeat r's request seeds and arrival offsets: request i seeded as the grid's prompt i (seed + r x n + i),
    the arrivals by seed + r (every system, in process or behind a URL, gets the same stream)."""
    first = cfg.seed + repeat * n
    return [first + i for i in range(n)], arrival_offsets(n, rate, cfg.seed + repeat)


def run_one(system, prompts, temperature: float, rate: float, cfg: BenchConfig, repeat: int) -> dict:
    """One stream (stream_plan's) served by one of our systems: its summary, engine counters and outputs."""
    seeds, offsets = stream_plan(len(prompts), rate, cfg, repeat)
    params = [SamplingParams(temperature=temperature, max_tokens=cfg.max_new_tokens, ignore_eos=True, seed=seed)
              for seed in seeds]
    torch.set_num_threads(system.threads)  # process-wide: the systems open beside it may differ
    repin(system.bench_cpus)  # every system is open at once, each open() pinned the process to its own CPUs
    before = system.llm.metrics.to_dict()
    served, seconds = serve_stream(system.llm, prompts, params, offsets)
    # (no request fails alone in process: a failure fails the system's cell; every output is counted)
    return {**summarize(served, seconds), "failed_requests": 0, "requests_without_usage": 0,
            "engine": engine_delta(before, system.llm.metrics.to_dict()), "outputs": [s.tokens for s in served]}


def serving_cell(system: str, setting: str, temperature: float, rate: float, runs: list[dict], place: dict) -> dict:
    """The median of every figure over the repeats (a stream's latencies are its own, so no best pass), but the
    counts of requests that went wrong (SUMMED), which add up; every repeat's summary kept, its outputs until
    annotate_serving has compared them. place: where the system ran (Placement.to_dict(); a server's URL).
    A run's "error" (a server's stream whose requests failed) is the cell's, the first repeat's that has one."""
    skip = ("engine", "outputs", "error")
    figures = [k for k, v in runs[0].items() if k not in skip and (v is None or isinstance(v, (int, float)))]
    return {"system": system, "setting": setting, "temperature": temperature, "rate": rate_label(rate),
            "cores": place.get("cores"), "placement": place, **{k: _over_repeats(k, runs) for k in figures},
            "repeat_output_tokens_per_s": [run["output_tokens_per_s"] for run in runs],
            "repeats": [{k: v for k, v in run.items() if k != "outputs"} for run in runs],
            "outputs": [run["outputs"] for run in runs], "error": next((e for r in runs if (e := r.get("error"))), None)}


def _over_repeats(key: str, runs: list[dict]):
    values = [run[key] for run in runs]
    if key in SUMMED:
        return sum(values)
    return statistics.median_low(values) if key in COUNTS else _median(values)


def serving_error_cell(system: str, setting: str, temperature: float, rate: float, place: dict, error: str) -> dict:
    """A cell whose system failed: serving_cell's fields, no figures (None), and the error."""
    return {"system": system, "setting": setting, "temperature": temperature, "rate": rate_label(rate),
            "cores": place.get("cores"), "placement": place, **dict.fromkeys([*summarize([], 1.0), *SUMMED]),
            "repeat_output_tokens_per_s": [], "repeats": [], "outputs": [], "error": error}


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def annotate_serving(cells: list[dict]) -> None:
    """Throughput over our sd's of the same stream (medians, and paired by repeat); greedy outputs against
    our ar's, request by request (continuous batching and arrivals must not change a token)."""
    index = {(c["system"], c["setting"], c["temperature"], c["rate"]): c for c in cells}
    for c in cells:
        key = (c["setting"], c["temperature"], c["rate"])
        sd, ar = index.get(("sd",) + key), index.get(("ar",) + key)
        measured = sd and sd["output_tokens_per_s"] and c["output_tokens_per_s"] is not None  # 0: a stream without usage
        c["speedup_vs_sd"] = c["output_tokens_per_s"] / sd["output_tokens_per_s"] if measured else None
        c["paired_vs_sd"] = paired_ratios(c["repeat_output_tokens_per_s"], sd["repeat_output_tokens_per_s"]) if sd else None
        c["greedy_same_as_ar"] = _same_share(c["outputs"], ar["outputs"]) if ar and c["temperature"] == 0 else None
    for c in cells:
        c.pop("outputs")


def _same_share(outputs: list[list[list[int]]], reference: list[list[list[int]]]) -> float | None:
    """Share of requests, over every repeat, whose output equals the reference's (None without any: a failed cell)."""
    pairs = [(a, b) for run, ref in zip(outputs, reference) for a, b in zip(run, ref)]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


__all__ = ["ServingConfig", "SERVING_SYSTEMS", "arrival_offsets", "summarize", "run_serving", "Served", "rate_label"]
