"""HTTP + Ray Serve overhead against in-process `LLM.generate`, measured in one run.

    python benchmarks/bench_serve.py [--model T --draft D] [--tokens 128] [--reps 5] [--stream-intervals 0,50]

Greedy decoding, so both paths generate the same tokens. Batch 1: mean end-to-end latency of one
request (in-process generate vs streamed over HTTP) and time to the first non-empty text (in-process
`LLM.stream` vs the first SSE chunk with text). Batch 8: wall time of
8 concurrent requests (one generate() call of 8 prompts vs 8 concurrent HTTP streams). The HTTP side
runs once per Serve stream batching interval (`stream_interval_ms`: deltas closer than it share one SSE
chunk; 0 sends one per engine round).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time

import httpx

PROMPTS = ["def add(a, b):", "class Stack:", "import os", "for i in range(10):", "the cat sat on the",
           "hello world", "while True:", "return x"]


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


def in_process(llm, tokens: int, reps: int) -> dict:
    from saguaro_dist import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens)
    llm.generate(PROMPTS[:1], params)  # warm-up
    single = [_timed(lambda: llm.generate(PROMPTS[:1], params)) for _ in range(reps)]
    ttft = [asyncio.run(_first_text(llm, params)) for _ in range(reps)]
    batch = [_timed(lambda: llm.generate(PROMPTS, params)) for _ in range(reps)]
    return {"b1_s": statistics.mean(single), "b1_ttft_s": statistics.mean(ttft), "b8_s": statistics.mean(batch)}


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> tuple[float, float]:
    """(time to first token, total) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    start, first = time.perf_counter(), None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


async def over_http(url: str, tokens: int, reps: int) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        await _stream(client, url, PROMPTS[0], tokens)  # warm-up
        single = [await _stream(client, url, PROMPTS[0], tokens) for _ in range(reps)]
        batch = []
        for _ in range(reps):
            start = time.perf_counter()
            await asyncio.gather(*(_stream(client, url, p, tokens) for p in PROMPTS))
            batch.append(time.perf_counter() - start)
    return {"b1_s": statistics.mean(t for _, t in single), "b1_ttft_s": statistics.mean(f for f, _ in single),
            "b8_s": statistics.mean(batch)}


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model"), p.add_argument("--draft")
    p.add_argument("--mode", default="ssd"), p.add_argument("--k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128), p.add_argument("--reps", type=int, default=5)
    p.add_argument("--num-cpus", type=int, default=4)
    p.add_argument("--stream-intervals", default="0,50", help="stream_interval_ms values to compare (comma-separated)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine, in both runs (a Serve "
                                                          "replica with num_cpus=1 gets 1 from Ray otherwise)")
    ns = p.parse_args()
    target, draft = (ns.model, ns.draft) if ns.model else tiny_pair(tempfile.mkdtemp())
    engine = {"model": target, "draft": draft, "mode": ns.mode, "k": ns.k, "max_batch_size": 8,
              "target_threads": ns.threads, "draft_threads": ns.threads}

    import ray
    from ray import serve

    from saguaro_dist import LLM
    from saguaro_dist.serve.app import build_app

    # One engine at a time, so neither run competes with the other for the CPU.
    with LLM(**engine) as llm:
        local = in_process(llm, ns.tokens, ns.reps)
    ray.init(address="local", num_cpus=ns.num_cpus, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    http = {}
    try:
        for ms in [float(x) for x in ns.stream_intervals.split(",")]:
            serve.run(build_app({**engine, "stream_interval_ms": ms}), name="bench", route_prefix="/")
            http[ms] = asyncio.run(over_http(f"http://127.0.0.1:{port}", ns.tokens, ns.reps))
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    report(local, http, ns)


def report(local: dict, http: dict[float, dict], ns) -> None:
    print(f"{ns.tokens}-token greedy outputs, mode {ns.mode}, k {ns.k}, {ns.reps} reps")
    print(f"{'':28}{'in-process':>12}" + "".join(f"{f'HTTP {ms:g} ms':>14}{'overhead':>10}" for ms in http))
    for key, label in (("b1_s", "batch 1 latency (s)"), ("b1_ttft_s", "batch 1 TTFT (s)"),
                       ("b8_s", "8 concurrent streams (s)")):
        cells = "".join(f"{h[key]:14.4f}{(h[key] / local[key] - 1) * 100 if local[key] else float('nan'):9.1f}%"
                        for h in http.values())
        print(f"{label:28}{local[key]:12.4f}" + cells)


if __name__ == "__main__":
    main()
