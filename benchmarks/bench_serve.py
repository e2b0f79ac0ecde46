"""HTTP + Ray Serve overhead against in-process `LLM.generate`, measured in one run.

    python benchmarks/bench_serve.py [--model T --draft D | --tiny-pair] [--tokens 128] [--reps 8]
    python benchmarks/bench_serve.py --stream-intervals 0,50      # SSE batching compared, proxy only

Greedy decoding, so every path generates the same tokens; by default the pair `saguaro serve` serves
(the demo pair). Batch 1: mean end-to-end latency of one request (in-process generate vs streamed
over HTTP, streamed, and on the direct ingress answered in one piece too, the request that matches
generate()) and time to the first non-empty text (in-process `LLM.stream` vs the first SSE chunk with
text). Batch 8: wall time of 8 concurrent requests (one generate() call of 8 prompts vs 8 concurrent
HTTP requests). The systems run interleaved in one Ray session, the order rotating every rep: measured
one after the other, minutes apart, the box's drift (20-30% here) swamped the difference. One Serve app
per stream batching interval (`stream_interval_ms`: deltas closer than it share one SSE chunk). With one
app, both ingresses are measured: Serve's proxy, and the replica's own HTTP server (direct ingress, what
`saguaro serve` runs on its embedded cluster). Last, the cores each process kept busy while each system ran.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import statistics
import tempfile
import time

import httpx

PROMPTS = ["def add(a, b):", "class Stack:", "import os", "for i in range(10):", "the cat sat on the",
           "hello world", "while True:", "return x"]


def demo() -> tuple[str, str]:
    from saguaro_dist.demo import demo_pair

    return demo_pair()


def tiny_pair(root: str) -> tuple[str, str]:
    """A small random target/draft pair with a byte-level tokenizer (no downloads)."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(PROMPTS * 20, vocab_size=300, special_tokens=["<s>", "</s>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")
    paths = []
    for name, hidden, layers in (("target", 256, 4), ("draft", 64, 1)):
        torch.manual_seed(len(name))
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512, bos_token_id=0, eos_token_id=None)
        LlamaForCausalLM(cfg).save_pretrained(f"{root}/{name}")
        tok.save_pretrained(f"{root}/{name}")
        paths.append(f"{root}/{name}")
    return paths[0], paths[1]


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> tuple[float, float]:
    """(time to first token, total) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    start, first = time.perf_counter(), None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


class InProcess:
    """`LLM.generate` in the benchmark's own process (TTFT: the first text of `LLM.stream`)."""

    def __init__(self, llm, tokens: int):
        from saguaro_dist import SamplingParams

        self.llm, self.params = llm, SamplingParams(temperature=0, max_tokens=tokens)

    async def single(self) -> tuple[float, float]:
        ttft = await _first_text(self.llm, self.params)
        return ttft, await asyncio.to_thread(_timed, lambda: self.llm.generate(PROMPTS[:1], self.params))

    async def batch(self) -> float:
        return await asyncio.to_thread(_timed, lambda: self.llm.generate(PROMPTS, self.params))


class InProcessStream(InProcess):
    """`LLM.stream` consumed by this process's event loop: the engine's streaming path without Serve."""

    async def single(self) -> tuple[float, float]:
        start, first = time.perf_counter(), None
        async for delta in self.llm.stream(PROMPTS[0], self.params):
            if first is None and delta.text:
                first = time.perf_counter() - start
        return first or 0.0, time.perf_counter() - start

    async def batch(self) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(_drain(self.llm.stream(p, self.params)) for p in PROMPTS))
        return time.perf_counter() - start


async def _drain(deltas) -> None:
    async for _ in deltas:
        pass


async def _complete(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> tuple[float, float]:
    """(no TTFT: nan, total) of one completion answered in one piece."""
    start = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0}
    (await client.post(url + "/v1/completions", json=body)).raise_for_status()
    return math.nan, time.perf_counter() - start


class OverHttp:
    """Completions from an OpenAI-compatible endpoint: streamed (SSE), or answered in one piece."""

    def __init__(self, client: httpx.AsyncClient, url: str, tokens: int, stream: bool = True):
        self.client, self.url, self.tokens, self.request = client, url, tokens, _stream if stream else _complete

    async def single(self) -> tuple[float, float]:
        return await self.request(self.client, self.url, PROMPTS[0], self.tokens)

    async def batch(self) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(self.request(self.client, self.url, p, self.tokens) for p in PROMPTS))
        return time.perf_counter() - start


async def interleaved(systems: dict, reps: int) -> tuple[dict, dict]:
    """Every system once per rep, the order rotating, so the box's drift and Ray's background work
    fall on all of them alike. Returns each system's mean figures and the cores each role kept busy."""
    names = list(systems)
    for system in systems.values():  # warm-up
        await system.single()
    samples = {n: collections.defaultdict(list) for n in names}
    usage = {n: Usage() for n in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            with usage[name]:
                ttft, total = await systems[name].single()
                samples[name]["b1_s"].append(total), samples[name]["b1_ttft_s"].append(ttft)
                samples[name]["b8_s"].append(await systems[name].batch())
    means = {n: {key: statistics.mean(v) for key, v in samples[n].items()} for n in names}
    base = samples[names[0]]["b1_s"]
    for n in names:  # each rep's request against the in-process one of the same rep: the box's drift cancels
        means[n]["b1_paired"] = statistics.median(x / b for x, b in zip(samples[n]["b1_s"], base))
    return means, {n: usage[n].cores() for n in names}


async def _first_text(llm, params) -> float:
    """Time to the first non-empty text delta, as the HTTP side measures it (not the engine's first
    token: the detokenizer may hold a partial character back)."""
    start = time.perf_counter()
    async for delta in llm.stream(PROMPTS[0], params):
        if delta.text:
            return time.perf_counter() - start
    return time.perf_counter() - start


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of this process and its descendants (Ray's daemons and
    workers, the engines' draft processes), by pid, with each one's role."""
    import psutil

    me = psutil.Process()
    seconds = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                seconds[proc.pid] = (_role(proc, me.pid), times.user + times.system)
        except psutil.Error:
            continue  # exited (or unreadable) between the listing and the read
    return seconds


def _role(proc, driver_pid: int) -> str:
    if proc.pid == driver_pid:
        return "bench process (client; in-process engine)"
    cmd = proc.cmdline()
    if cmd and cmd[0].startswith("ray::"):  # a Ray worker's title names its task: keep the actor class
        return cmd[0].split()[0].split(".")[0][:40]
    if "saguaro_dist.engine.draft_process" in cmd:  # an engine's draft child
        parent = proc.parent()
        owner = "bench process" if parent is None or parent.pid == driver_pid else _role(parent, driver_pid)
        return f"  {owner}'s child (draft)"
    return proc.name()


class Usage:
    """CPU seconds per role and wall seconds, summed over every `with` block."""

    def __init__(self):
        self.cpu: collections.Counter = collections.Counter()
        self.wall = 0.0

    def __enter__(self):
        self._before, self._start = cpu_seconds(), time.perf_counter()

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._start
        for pid, (role, t) in cpu_seconds().items():  # by pid: a Ray worker's title changes with its task
            self.cpu[role] += t - self._before.get(pid, (role, 0.0))[1]

    def cores(self) -> dict[str, float]:
        """The cores each role kept busy on average: CPU seconds / wall seconds."""
        return {role: t / self.wall for role, t in self.cpu.items()}


def start_ray(num_cpus: int, direct: bool) -> str | None:
    """Ray, with Serve's direct ingress on a spare port when asked (its URL), as `saguaro serve` runs it."""
    import ray

    from saguaro_dist.serve.ingress import enable_direct_ingress, free_port

    port = free_port() if direct else None
    if port:
        enable_direct_ingress(port)  # before Ray starts: Serve's processes read it from their environment
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    return f"http://127.0.0.1:{port}" if port else None


async def run_all(llm, proxy_urls: dict[float, str], direct_url: str | None, ns) -> tuple[dict, dict]:
    async with httpx.AsyncClient(timeout=300) as client:
        systems = {"in-process": InProcess(llm, ns.tokens), "in-process stream": InProcessStream(llm, ns.tokens)}
        systems.update({f"proxy, {ms:g} ms": OverHttp(client, url, ns.tokens) for ms, url in proxy_urls.items()})
        if direct_url:
            systems["direct"] = OverHttp(client, direct_url, ns.tokens)
            systems["direct, no stream"] = OverHttp(client, direct_url, ns.tokens, stream=False)
        return await interleaved(systems, ns.reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target (default: the demo pair)"), p.add_argument("--draft")
    p.add_argument("--tiny-pair", action="store_true", help="a random tiny pair with a byte-level tokenizer instead")
    p.add_argument("--mode", default="ssd"), p.add_argument("--k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128), p.add_argument("--reps", type=int, default=24)
    p.add_argument("--num-cpus", type=int, default=4)
    p.add_argument("--stream-intervals", default="50",
                   help="Serve stream batching intervals in ms, one app each, comma-separated (0: a chunk per "
                        "round); with one, the direct ingress is measured too")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine, in both runs (a Serve "
                                                          "replica with num_cpus=1 gets 1 from Ray otherwise)")
    ns = p.parse_args()
    target, draft = (ns.model, ns.draft) if ns.model else tiny_pair(tempfile.mkdtemp()) if ns.tiny_pair else demo()
    engine = {"model": target, "draft": draft, "mode": ns.mode, "k": ns.k, "max_batch_size": 8,
              "target_threads": ns.threads, "draft_threads": ns.threads,
              "enable_prefix_caching": False}  # repeated prompts: every request prefills, as before it existed

    import ray
    from ray import serve

    from saguaro_dist import LLM
    from saguaro_dist.serve.app import build_app
    from saguaro_dist.serve.ingress import free_port

    intervals = [float(x) for x in ns.stream_intervals.split(",")]
    direct = start_ray(ns.num_cpus, direct=len(intervals) == 1)  # one port: one ingress replica
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        prefixes = {ms: "" if len(intervals) == 1 else f"/i{ms:g}" for ms in intervals}
        for ms in intervals:  # one app per interval; every engine stays up, only the one measured has work
            serve.run(build_app({**engine, "stream_interval_ms": ms}), name=f"bench-{ms:g}", route_prefix=prefixes[ms] or "/")
        urls = {ms: f"http://127.0.0.1:{port}{prefixes[ms]}" for ms in intervals}
        with LLM(**engine) as llm:
            means, cores = asyncio.run(run_all(llm, urls, direct, ns))
    finally:
        serve.shutdown()
        ray.shutdown()
    report(means, ns)
    report_cores(cores)


def report_cores(busy: dict[str, dict[str, float]]) -> None:
    """Which processes kept the box's cores busy while each system ran (CPU seconds / wall seconds)."""
    roles = sorted({r for cores in busy.values() for r in cores})
    print(f"\ncores busy while each system ran, {os.cpu_count()} cores on this box")
    print(f"{'':46}" + "".join(f"{run:>20}" for run in busy))
    for role in roles:
        if max(cores.get(role, 0.0) for cores in busy.values()) >= 0.005:
            print(f"{role:46}" + "".join(f"{cores.get(role, 0.0):20.3f}" for cores in busy.values()))
    print(f"{'total':46}" + "".join(f"{sum(cores.values()):20.3f}" for cores in busy.values()))


def report(means: dict[str, dict], ns) -> None:
    base = means["in-process"]
    print(f"{ns.tokens}-token greedy outputs, mode {ns.mode}, k {ns.k}, {ns.reps} interleaved reps "
          "(HTTP: through Serve's proxy with each stream batching interval; direct: the replica's own port)")
    print(f"{'':28}" + "".join(f"{name:>20}{'overhead':>10}" for name in means))
    for key, label in (("b1_s", "batch 1 latency (s)"), ("b1_paired", "batch 1, paired (median)"),
                       ("b1_ttft_s", "batch 1 TTFT (s)"),
                       ("b8_s", "8 concurrent requests (s)")):
        print(f"{label:28}" + "".join(_cell(m[key], base[key]) for m in means.values()))


def _cell(value: float, base: float) -> str:
    if math.isnan(value):  # a completion answered in one piece has no time to first token
        return f"{'-':>20}{'-':>10}"
    return f"{value:20.4f}{(value / base - 1) * 100:9.1f}%"


if __name__ == "__main__":
    main()
