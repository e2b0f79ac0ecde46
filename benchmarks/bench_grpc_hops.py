"""Where a just-in-time draft's time over gRPC goes, hop by hop: which thread hands the message to which.

    python benchmarks/bench_grpc_hops.py [--target T --draft D] [--rounds 200] [--verify-ms 20]

The demo draft is served by a DraftService in a child process, called through GrpcDraftBackend from this
one (as on Ray, over loopback). Both sides stamp each just-in-time draft with time.perf_counter (one
system-wide monotonic clock on Linux) at each hand-off, by wrapping the functions that run there:

    send     the engine thread queues the request         (GrpcDraftBackend.jit_draft -> grpc_link.Link.call_jit)
    consume  gRPC's request thread takes it                (grpc_link.Outbox.requests)
    read     the server's event loop has it                (DraftServicer._replies)
    work     the worker starts drafting                    (worker.jit_draft)
    drafted  the worker is done (its answer goes to gRPC)  (worker.jit_draft returns)
    recv     the client's reader thread has the answer     (grpc_link.Link.answer)
    woke     jit_draft returns on the engine thread

Between rounds this thread computes for --verify-ms (the target's verify); keep it longer than the
server's tree build, or the next draft queues behind that build. Instrumentation, not an API: if a
wrapped function is renamed this script fails loudly (tests/test_benchmark_scripts.py runs it).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench_grpc_jit import busy_verify, parse_args  # this script's directory is on sys.path

CLIENT_STAMPS = ["send", "consume", "recv", "woke"]
SERVER_STAMPS = ["read", "work", "drafted"]
CHAIN = ["send", "consume", "read", "work", "drafted", "recv", "woke"]


def _is_jit(msg) -> bool:
    return hasattr(msg, "WhichOneof") and msg.WhichOneof("kind") == "jit_draft"


def _wrap(owner, name: str, stamp_before, when=lambda *a: True, stamp_after=None) -> None:
    """Replace owner.name by a function that stamps (when its arguments qualify), calls the original,
    and stamps again after it (stamp_after, if given)."""
    original = getattr(owner, name)

    def stamped(*args, **kwargs):
        if when(*args):
            stamp_before()
        result = original(*args, **kwargs)
        if stamp_after is not None:
            stamp_after()
        return result
    setattr(owner, name, stamped)


def serve(target: str, draft: str, port_file: str, stamps_file: str) -> None:
    """Child process: the DraftService with its hand-offs stamped; writes the stamps on SIGTERM."""
    import torch
    torch.set_num_threads(1)
    from saguaro_dist.config import Config
    from saguaro_dist.distributed import draft_service as ds
    from saguaro_dist.engine.build import build_draft_worker
    stamps = {k: [] for k in SERVER_STAMPS}

    def at(key):
        return lambda: stamps[key].append(time.perf_counter())
    _wrap(ds.DraftServicer, "_replies", at("read"), when=lambda self, msg: _is_jit(msg))
    worker = build_draft_worker(Config(model=target, draft=draft, mode="ssd", k=4, fan_out=12))
    _wrap(worker, "jit_draft", at("work"), stamp_after=at("drafted"))

    def dump(*_):
        with open(stamps_file, "w") as f:
            json.dump(stamps, f)
        os._exit(0)
    signal.signal(signal.SIGTERM, dump)
    server, port = ds.serve_draft(worker, "127.0.0.1", 0)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(port_file + ".tmp", port_file)
    server.wait_for_termination()


def _instrument_client(stamps: dict) -> None:
    from saguaro_dist.distributed import grpc_link
    original_requests = grpc_link.Outbox.requests

    def requests(outbox):
        for item in original_requests(outbox):
            if _is_jit(item):
                stamps["consume"].append(time.perf_counter())
            yield item
    grpc_link.Outbox.requests = requests
    _wrap(grpc_link.Link, "answer", lambda: stamps["recv"].append(time.perf_counter()))


def _start_server(target: str, draft: str) -> tuple[subprocess.Popen, str, str]:
    port_file, stamps_file = tempfile.mktemp(prefix="saguaro-hops-port-"), tempfile.mktemp(prefix="saguaro-hops-")
    proc = subprocess.Popen([sys.executable, __file__, "--serve", target, draft, port_file, stamps_file])
    while not os.path.exists(port_file):
        if proc.poll() is not None:
            raise SystemExit("the DraftService process failed to start")
        time.sleep(0.05)
    with open(port_file) as f:
        address = f"127.0.0.1:{f.read()}"
    os.unlink(port_file)
    return proc, address, stamps_file


def _drive(address: str, rounds: int, verify_s: float, stamps: dict) -> None:
    from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
    from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest, Release
    backend = GrpcDraftBackend([address])
    greedy = DraftSampling(temperature=0.0, top_k=0, top_p=1.0, seed=1)
    try:
        for seq_id in range(max(1, rounds // 50)):
            backend.prefill([PrefillRequest(seq_id, list(range(5, 69)), greedy)])
            for r in range(min(50, rounds)):
                stamps["send"].append(time.perf_counter())
                backend.jit_draft([JitDraftRequest(seq_id, r, 0, 7 + r)])
                stamps["woke"].append(time.perf_counter())
                busy_verify(verify_s)
            backend.release([Release(seq_id)])
    finally:
        backend.close()


def report(stamps: dict) -> list[str]:
    """Median and p90 ms of each hop, after the first tenth of the rounds (warm-up)."""
    n = min(len(v) for v in stamps.values())
    skip = n // 10

    def line(name, a, b):
        ms = sorted((stamps[b][i] - stamps[a][i]) * 1e3 for i in range(skip, n))
        return f"{name:<18} median {statistics.median(ms):7.3f} ms  p90 {ms[int(len(ms) * 0.9)]:7.3f} ms"
    lines = [line(f"{a} -> {b}", a, b) for a, b in zip(CHAIN, CHAIN[1:])]
    lines.append(line("total", "send", "woke"))
    lines.append(line("draft (work)", "work", "drafted"))
    return lines


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(*sys.argv[2:6])
        return
    args = parse_args(__doc__, rounds=200)
    import torch
    torch.set_num_threads(1)
    stamps = {k: [] for k in CLIENT_STAMPS}
    _instrument_client(stamps)
    print(f"placement: client (this process, 1 torch thread, computing between rounds); DraftService process "
          f"(1 torch thread); {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    proc, address, stamps_file = _start_server(args.target, args.draft)
    try:
        _drive(address, args.rounds, args.verify_ms / 1e3, stamps)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    with open(stamps_file) as f:
        stamps.update(json.load(f))
    os.unlink(stamps_file)
    print("\n".join(report(stamps)))


if __name__ == "__main__":
    main()
