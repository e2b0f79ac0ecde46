"""`saguaro bench --url URL --request-rates ...`: the serving streams sent to a running server over HTTP.

bench/serving.py measures our engines in this process. A deployment (a RayService, `saguaro serve` on a
cluster) is measured from outside, as its users reach it (vLLM's benchmark_serving against a URL): the
same held-out prompts, tokenized by the server itself (/tokenize) and cut to --prompt-len tokens, sent
as token ids to /v1/completions and streamed; the same seeded Poisson arrivals and request seeds. As
benchmark_serving, a token is a streamed chunk with choices, its text "" or not (a special token, half a
UTF-8 character): TTFT is the first, E2E the last (not the usage chunk or [DONE] after it), ITL the gaps
between them, TPOT the time between over the tokens after the first (usage.completion_tokens); a stream
with none failed. Acceptance and hit rate come from the final chunk's `speculation` stats where the server
is ours (None elsewhere). A client-side figure
includes the network and the server's stream batching (`--stream-interval-ms`), as a user's does.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from saguaro_dist.bench.config import BenchConfig
from saguaro_dist.bench.runner import SCHEMA_VERSION, host_info
from saguaro_dist.bench.serving import (Served, annotate_serving, check_stream, rate_label, run_to_end, serving_cell,
                                        serving_errors, stream_plan, summarize)
from saguaro_dist.client import AsyncClient, SaguaroError
from saguaro_dist.client._common import served_api_root
from saguaro_dist.engine.metrics import RequestMetrics

log = logging.getLogger(__name__)

SYSTEM = "server"     # the one system a remote run measures (the cells' "system")
SETTING = "remote"    # and its setting: the server's own hardware and placement
TIMEOUT_S = 600.0     # one request's limit: a saturated stream's last request waits for all before it; connecting
                      # too (not the client's 5 s): a burst of connections may wait out the kernel's SYN retries


@dataclass(frozen=True)
class RemoteConfig:
    """A serving run against a server: each rate streams num_requests requests; `base` gives the temperatures,
    max_new_tokens, prompt_len, repeats, seed and out_dir (its systems, settings and batch sizes, which
    choose our systems here, are unused: the server runs as deployed)."""
    url: str                   # the server's root or its /v1
    base: BenchConfig = field(default_factory=BenchConfig)
    rates: tuple[float, ...] = (math.inf,)  # requests a second; inf: all at once
    num_requests: int = 32
    api_key: str | None = None
    model: str | None = None   # a served model name; None: the server's first

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must be an http:// or https:// address of a running server, got {self.url!r}")
        check_stream(self.rates, self.num_requests)

    def to_dict(self) -> dict:
        return {"rates": [rate_label(r) for r in self.rates], "num_requests": self.num_requests,
                "max_batch_size": None, "url": self.url, "model": self.model}  # (the server's own max_batch_size)


def run_remote(remote: RemoteConfig, progress: bool = True) -> dict:
    """Every temperature and rate streamed to the server, `repeats` times each, after an untimed warm-up."""
    return run_to_end(lambda: _run_remote(remote, progress))


async def _run_remote(remote: RemoteConfig, progress: bool) -> dict:
    cfg, rates = remote.base, remote.rates
    # No retries, as vLLM's benchmark_serving: a retried 429 / 503 would count as served, its backoff as latency.
    async with AsyncClient(served_api_root(remote.url), remote.api_key, model=remote.model, timeout=httpx.Timeout(TIMEOUT_S), max_retries=0) as client:
        model = remote.model or (await client.models())[0]
        prompts = await server_prompts(client, model, remote.num_requests, cfg.prompt_len)
        version = await server_version(client)
        place = {"where": f"{model} at {remote.url} (version {version})", "cores": None}
        cells = []
        with tqdm(total=len(cfg.temperatures) * len(rates), desc="saguaro bench remote", unit="cell",
                  disable=not progress) as bar:
            for temperature in cfg.temperatures:
                await warm_up(client, model, prompts, temperature, cfg)
                for rate in rates:
                    runs = [await stream_once(client, model, prompts, temperature, rate, cfg, r) for r in range(cfg.repeats)]
                    cells.append(serving_cell(SYSTEM, SETTING, temperature, rate, runs, place))
                    bar.update(1)
    annotate_serving(cells)
    return {"schema": SCHEMA_VERSION, "kind": "serving", "config": cfg.to_dict(), "serving": remote.to_dict(),
            **remote_context(remote, model, version, len(prompts), cfg.prompt_len), "cells": cells,
            "errors": serving_errors(cells)}  # the cells with failed requests: the CLI exits 1, as in process


async def server_version(client: AsyncClient) -> str:
    """The server's /version (ours and vLLM's have one); "unknown" where the server has none."""
    from saguaro_dist.client import NotFoundError
    try:
        return await client.version()
    except NotFoundError:
        return "unknown"


async def server_prompts(client: AsyncClient, model: str, n: int, length: int) -> list[list[int]]:
    """The first n held-out snippets the server's tokenizer makes at least `length` tokens of, cut to `length`."""
    from saguaro_dist.bench.prompts import len_of_demo_prompts, too_few_prompts
    from saguaro_dist.demo import demo_prompts
    prompts, texts = [], demo_prompts(len_of_demo_prompts())
    for text in texts:
        ids = await client.tokenize(text, model=model)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == n:
            return prompts
    raise too_few_prompts(len(prompts), n, len(texts), length, "--num-requests", "the server's tokenizer",
                          "requests a stream")


async def stream_once(client: AsyncClient, model: str, prompts, temperature: float, rate: float, cfg, repeat: int) -> dict:
    """One stream, stream_plan's (the in-process systems' seeds and arrivals). As vLLM's benchmark_serving, a request
    the server fails is counted (failed_requests) and left out of every other figure; the run goes on."""
    replies, seconds = await _stream(client, model, prompts, temperature, rate, cfg, repeat)
    served, failed = [r for r in replies if isinstance(r, Served)], [r for r in replies if not isinstance(r, Served)]
    if failed:
        log.warning("%d of %d requests failed (T=%s, rate %s); the first: %s", len(failed), len(replies), temperature,
                    rate_label(rate), failed[0])
    uncounted = sum(not s.counted for s in served)
    if uncounted:
        log.warning("%d of %d streams ended without usage (T=%s, rate %s): their tokens read 0, and output tok/s and "
                    "TPOT with them; the server ignores stream_options.include_usage", uncounted, len(served),
                    temperature, rate_label(rate))
    error = f"{len(failed)} of {len(replies)} requests failed (repeat {repeat}); the first: {failed[0]}" if failed else None
    return {**summarize(served, seconds), "failed_requests": len(failed), "requests_without_usage": uncounted,
            "outputs": [[] for _ in served], "error": error}


async def warm_up(client: AsyncClient, model: str, prompts, temperature: float, cfg) -> None:
    """The untimed stream of every request at once. A server that fails every one refuses the run (a wrong model
    name, a max_tokens beyond its context), as vLLM's initial test request does: its first error raised."""
    replies, _ = await _stream(client, model, prompts, temperature, math.inf, cfg, repeat=0)
    if not any(isinstance(r, Served) for r in replies):
        raise replies[0]


async def _stream(client: AsyncClient, model: str, prompts, temperature: float, rate: float, cfg,
                  repeat: int) -> tuple[list, float]:
    """(each request's Served or error, in prompt order; seconds from the first arrival to the last end)."""
    seeds, offsets = stream_plan(len(prompts), rate, cfg, repeat)
    start = time.perf_counter()
    replies = await asyncio.gather(*(_request(client, model, p, temperature, cfg.max_new_tokens, seed, start + o)
                                     for p, seed, o in zip(prompts, seeds, offsets)))
    return list(replies), time.perf_counter() - start


async def _request(client: AsyncClient, model: str, prompt: list[int], temperature: float, max_tokens: int, seed: int,
                   at: float) -> Served | Exception:
    """Sent at perf_counter time `at`; timed to its first and last token (ChunkClock). The error, if the server
    refused it, the stream broke or it streamed no token."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    try:
        return await _timed(client, model, prompt, temperature, max_tokens, seed)
    except (SaguaroError, ValueError) as err:  # ValueError: a chunk that is no JSON
        return err


class ChunkClock:
    """When each chunk with choices arrived, read through the stream's chunks(): its text loop skips a token whose
    text is "" (a special token, half a UTF-8 character), which benchmark_serving times as any other."""

    def __init__(self):
        self.token_times: list[float] = []

    async def read(self, stream) -> None:
        """The whole stream (its usage and speculation filled as a text loop fills them)."""
        async for chunk in stream.chunks():
            if chunk.get("choices"):  # (the usage chunk's are [])
                self.token_times.append(time.perf_counter())


async def _timed(client: AsyncClient, model: str, prompt: list[int], temperature: float, max_tokens: int,
                 seed: int) -> Served:
    sent = time.perf_counter()
    stream = await client.complete(prompt, model=model, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                   stream=True, ignore_eos=True, stream_options={"include_usage": True})
    clock = ChunkClock()
    await clock.read(stream)
    times = clock.token_times
    if not times:
        raise ValueError("the stream ended without a chunk with choices (no token): a failed request, as "
                         "benchmark_serving counts it")
    tokens = completion_tokens(stream.usage)
    metrics = _client_metrics(stream, tokens or 0, times[0] - sent, times[-1] - sent)
    return Served([], metrics, itl_s=gaps(times), counted=tokens is not None)


def completion_tokens(usage: dict | None) -> int | None:
    """usage.completion_tokens; None without usage or a count in it (`null`: the stream is not counted)."""
    tokens = (usage or {}).get("completion_tokens")
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


def gaps(times: list[float]) -> list[float]:
    """Seconds between successive times (inter-token latency of the chunks that arrived at `times`)."""
    return [b - a for a, b in itertools.pairwise(times)]


def _client_metrics(stream, tokens: int, ttft_s: float, total_s: float) -> RequestMetrics:
    """A RequestMetrics from what the stream said: its tokens (usage) and, from our servers, the speculation counts."""
    spec = stream.speculation or {}
    return RequestMetrics(num_generated_tokens=tokens,
                          drafted_tokens=spec.get("drafted_tokens", 0), accepted_tokens=spec.get("accepted_tokens", 0),
                          cache_hits=spec.get("cache_hits", 0), cache_misses=spec.get("cache_misses", 0),
                          time_to_first_token_s=ttft_s, total_time_s=total_s)


def remote_context(remote: RemoteConfig, model: str, version: str, n: int, length: int) -> dict:
    """What render() prints above the table: the server in place of the pair, this client's host."""
    return {"pair": {"target": f"{model} (served at {remote.url}, version {version})", "draft": "the server's"},
            "prompts": f"{n} held-out stdlib snippets, tokenized by the server, first {length} tokens",
            "host": {**host_info(), "note": "the client's host (the server runs elsewhere)"},
            "systems": {SYSTEM: "the server at --url, as deployed"},
            "settings": {SETTING: "the server's own hardware and placement"}, "placements": {}}
