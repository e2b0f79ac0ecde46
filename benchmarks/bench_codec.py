"""What a pushed speculation tree batch costs on the gRPC path: encode (dataclasses -> protobuf ->
bytes, on the draft side) and decode (bytes -> protobuf -> dataclasses, on the target side's reader
thread, often while the target's round loop waits for the tree).

    python benchmarks/bench_codec.py [--k 4] [--fan-out 12] [--vocab 2048] [--reps 300]

Trees as the draft worker builds them: `fan-out` branches per sequence, each K tokens; greedy
(no q on the wire), T > 0 (a dense [K, V] q per branch) and top-k 20 (a sparse q). Medians over
`reps`, one torch thread (the actors' setting).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from saguaro_dist.distributed import codec
from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.engine.messages import Proposal, SpeculationTree


def tree(seq_id: int, k: int, fan_out: int, vocab: int, q: str, gen: torch.Generator) -> SpeculationTree:
    rows = []
    for i in range(fan_out):
        tokens = torch.randint(0, vocab, (k,), generator=gen)
        probs = None
        if q != "greedy":
            logits = torch.randn(k, vocab, generator=gen)
            if q == "top-k 20":
                logits[logits < logits.topk(20, -1).values[:, -1:]] = float("-inf")
            probs = logits.softmax(-1)
            tokens = torch.multinomial(probs, 1, generator=gen)[:, 0]  # drawn from q, as a draft's (the codec checks)
        rows.append((i % (k + 1), int(torch.randint(0, vocab, (1,), generator=gen)), Proposal(tokens, probs)))
    return SpeculationTree.from_rows(seq_id, 3, rows)


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(trees: list[SpeculationTree], reps: int) -> tuple[float, float, int]:
    """(encode ms, decode ms, bytes) of one SpeculateReply carrying the batch."""
    def encode() -> bytes:
        return pb.SpeculateReply(trees=codec.tree_batch_to_proto(trees)).SerializeToString()
    wire = encode()

    def decode():
        return codec.tree_batch_from_proto(pb.SpeculateReply.FromString(wire).trees)
    assert [t.keys() for t in decode()] == [t.keys() for t in trees]
    return median_ms(encode, reps), median_ms(decode, reps), len(wire)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--fan-out", type=int, default=12)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--reps", type=int, default=300)
    ns = p.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"K {ns.k}, {ns.fan_out} branches a sequence, vocab {ns.vocab}, median of {ns.reps}, 1 torch thread")
    print(f"{'q':>10} {'batch':>6} {'encode ms':>10} {'decode ms':>10} {'bytes':>10}")
    for q in ("greedy", "top-k 20", "dense"):
        for batch in (1, 8):
            trees = [tree(s, ns.k, ns.fan_out, ns.vocab, q, gen) for s in range(batch)]
            enc, dec, size = measure(trees, ns.reps if q != "dense" else max(10, ns.reps // 10))
            print(f"{q:>10} {batch:>6} {enc:10.3f} {dec:10.3f} {size:10d}")


if __name__ == "__main__":
    main()
