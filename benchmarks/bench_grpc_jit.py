"""What a just-in-time draft costs over gRPC: the demo draft served by a DraftService in another process
(as a Ray draft actor serves it), called through DraftPool -> GrpcDraftBackend on loopback, against
the same DraftWorker called in-process.

    python benchmarks/bench_grpc_jit.py [--target T --draft D] [--rounds 400] [--verify-ms 20]

Every round is a miss: a just-in-time draft of K tokens, then `--verify-ms` of matmuls on this process's
thread (the target's verify: a computing target, not a sleeping one, whose halted vCPU would be slower
to wake), during which the server builds the next tree; the round then takes that tree as the engine
does (wait_trees) and records how long it waited and the server's build time. A verify shorter than the
build makes the next draft queue behind it: the script says so. Both sides use 1 torch thread. The
difference between the two draft medians is the transport: thread hand-offs, gRPC, encode and decode.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

SERVER = """
import os, sys, torch
torch.set_num_threads(1)
from saguaro_dist.config import Config
from saguaro_dist.distributed.draft_service import local_address, serve_draft
from saguaro_dist.engine.build import build_draft_worker
worker = build_draft_worker(Config(model=sys.argv[1], draft=sys.argv[2], mode="ssd", k=4, fan_out=12))
local = local_address()
server, port = serve_draft(worker, "127.0.0.1", 0, local=local)
with open(sys.argv[3] + ".tmp", "w") as f:
    f.write(f"{port} {local or ''}")
os.replace(sys.argv[3] + ".tmp", sys.argv[3])
server.wait_for_termination()
"""


def busy_verify(seconds: float) -> None:
    """Keep this thread computing for `seconds`, as the target's verify does."""
    import torch
    a, end = torch.ones(128, 128), time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def _rounds(backend, rounds: int, verify_s: float, trees: bool) -> tuple[list[float], list[float], list[float]]:
    """Seconds per just-in-time draft, per wait for the tree after the verify, and per server tree build
    (the last two only with `trees`); a fresh sequence every 50 rounds keeps inside the context."""
    from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest, Release
    greedy = DraftSampling(temperature=0.0, top_k=0, top_p=1.0, seed=1)
    drafts, waits, builds = [], [], []
    for seq_id in range(rounds // 50):
        backend.prefill([PrefillRequest(seq_id, list(range(5, 69)), greedy)])
        for r in range(50):
            start = time.perf_counter()
            backend.jit_draft([JitDraftRequest(seq_id, r, 0, 7 + r % 50)])
            drafts.append(time.perf_counter() - start)
            busy_verify(verify_s)
            if trees:
                start = time.perf_counter()
                tree = backend.wait_trees([(seq_id, r)], timeout_s=1.0).get(seq_id)
                waits.append(time.perf_counter() - start)
                builds += [tree.build_s] if tree is not None else []
        backend.release([Release(seq_id)])
    return drafts, waits, builds


def _served(target: str, draft: str) -> tuple[subprocess.Popen, str, str | None]:
    """A DraftService process; returns it, its loopback address and its local socket (None: not Linux)."""
    port_file = tempfile.mktemp(prefix="saguaro-jit-port-")
    proc = subprocess.Popen([sys.executable, "-c", SERVER, target, draft, port_file])
    while not os.path.exists(port_file):
        if proc.poll() is not None:
            raise SystemExit("the DraftService process failed to start")
        time.sleep(0.05)
    with open(port_file) as f:
        port, *local = f.read().split()
    os.unlink(port_file)
    return proc, f"127.0.0.1:{port}", local[0] if local else None


def _summary(name: str, times: list[float]) -> str:
    ms = sorted(t * 1e3 for t in times[len(times) // 10:])  # the first tenth warms up
    return f"{name}: median {statistics.median(ms):.3f} ms, p90 {ms[int(len(ms) * 0.9)]:.3f} ms"


def parse_args(doc: str, rounds: int, verify_ms: float = 20.0) -> argparse.Namespace:
    """The options this script, bench_grpc_hops.py and bench_tree_trip.py share."""
    from saguaro_dist.demo import demo_pair
    default_target, default_draft = demo_pair()
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(default_target))
    ap.add_argument("--draft", default=str(default_draft))
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--verify-ms", type=float, default=verify_ms)
    return ap.parse_args()


def main() -> None:
    args = parse_args(__doc__, rounds=400)

    import torch
    torch.set_num_threads(1)
    from saguaro_dist.config import Config
    from saguaro_dist.distributed.draft_pool import DraftPool
    from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
    from saguaro_dist.engine.build import build_draft_worker

    print(f"placement: client (this process, 1 torch thread); DraftService process (1 torch thread); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()}")
    local = build_draft_worker(Config(model=args.target, draft=args.draft, mode="ssd", k=4, fan_out=12))
    proc, address, _ = _served(args.target, args.draft)
    pool = DraftPool([GrpcDraftBackend([address])], max_batch_size=1)
    try:
        in_process, _, _ = _rounds(local, args.rounds, args.verify_ms / 1e3, trees=False)
        over_grpc, waits, builds = _rounds(pool, args.rounds, args.verify_ms / 1e3, trees=True)
    finally:
        pool.close()
        proc.kill()
    print(_summary("just-in-time draft, DraftWorker in-process", in_process))
    print(_summary("just-in-time draft, DraftPool -> gRPC -> DraftService", over_grpc))
    print(_summary("server's tree build after it", builds))
    print(_summary("wait for that tree after the verify", waits))
    print(f"transport: {statistics.median(over_grpc) * 1e3 - statistics.median(in_process) * 1e3:.3f} ms a call (median difference)")
    if statistics.median(builds) * 1e3 > args.verify_ms:
        print(f"note: the tree build outlasts the {args.verify_ms} ms verify, so each draft queued behind it and "
              "the transport above includes that queueing; raise --verify-ms")


if __name__ == "__main__":
    main()
