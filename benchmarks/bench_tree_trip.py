"""What a speculation tree's trip costs besides its build: one-host pipe against gRPC, on hit rounds.

    python benchmarks/bench_tree_trip.py [--target T --draft D] [--rounds 320] [--verify-ms 4]

Each round is a hit, as in SSD's steady state: the outcome goes out naming a branch of the last tree,
this thread computes for --verify-ms (the target's verify: keep it shorter than the tree build, so the
round waits for the tree and the whole trip is timed), then it takes the next tree. Reported per round:
outcome sent -> tree in hand, minus the draft's own build time (SpeculationTree.build_s): the transport,
both sides' message handling and every thread hand-off on the way. Backends: DraftProcess (the
one-host engine's draft child over a pipe) and GrpcDraftBackend -> a DraftService in another process
over loopback TCP and over its local (abstract unix) socket, as a Ray target reaches a draft actor on
another node and on its own; blocks of rounds alternate between them. The drafts use 1 torch thread.
"""
from __future__ import annotations

import os
import statistics
import time

from bench_grpc_jit import _served, busy_verify, parse_args  # this script's directory is on sys.path


def hit_rounds(backend, seq_id: int, rounds: int, verify_s: float) -> list[float]:
    """Seconds per round beyond the tree's build; the sequence starts with a just-in-time draft."""
    from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Release
    backend.prefill([PrefillRequest(seq_id, list(range(5, 69)), DraftSampling(0.0, 0, 1.0, 1))])
    backend.jit_draft([JitDraftRequest(seq_id, 0, 0, 7)])
    backend.send_outcomes([])  # the one-host draft builds the first tree on this (the engine sends it too)
    tree, extra = backend.wait_trees([(seq_id, 0)], 10.0)[seq_id], []
    for r in range(rounds):
        i = r % tree.num_branches
        start = time.perf_counter()
        backend.send_outcomes([Outcome(seq_id, tree.round, *tree.keys()[i], next_tokens=tree.proposal(i).tokens.tolist(),
                                       cache_hit=True)])
        busy_verify(verify_s)
        tree = backend.wait_trees([(seq_id, tree.round + 1)], 10.0)[seq_id]
        extra.append(time.perf_counter() - start - tree.build_s)
    backend.release([Release(seq_id)])
    return extra[3:]  # the first rounds warm up


def summary(name: str, seconds: list[float]) -> str:
    ms = sorted(s * 1e3 for s in seconds)
    return (f"{name}: mean {statistics.mean(ms):.3f} ms, median {statistics.median(ms):.3f} ms, "
            f"p90 {ms[int(len(ms) * 0.9)]:.3f} ms ({len(ms)} rounds)")


def main() -> None:
    args = parse_args(__doc__, rounds=320, verify_ms=4.0)
    import torch
    torch.set_num_threads(1)
    from saguaro_dist.config import Config
    from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
    from saguaro_dist.engine.draft_process import DraftProcess
    print(f"placement: target side (this process, 1 torch thread, computing {args.verify_ms} ms a round); draft: "
          f"child process over a pipe, or DraftService process over gRPC (1 torch thread); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()}")
    proc, address, local = _served(args.target, args.draft)
    backends = {"pipe (DraftProcess)": DraftProcess(Config(model=args.target, draft=args.draft, mode="ssd", k=4,
                                                           fan_out=12, draft_threads=1)),
                "gRPC over TCP loopback": GrpcDraftBackend([address])}
    if local is not None:
        backends["gRPC over the local socket"] = GrpcDraftBackend([local])
    extra = {name: [] for name in backends}
    block = 40
    try:
        for i in range(max(1, args.rounds // block)):
            for j, (name, backend) in enumerate(backends.items()):
                extra[name] += hit_rounds(backend, len(backends) * i + j, block, args.verify_ms / 1e3)
    finally:
        for backend in backends.values():
            backend.close()
        proc.kill()
    print("outcome sent -> next tree in hand, minus the draft's build:")
    print("\n".join(summary(name, seconds) for name, seconds in extra.items()))


if __name__ == "__main__":
    main()
