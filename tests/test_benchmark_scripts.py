"""The benchmark scripts that have no CLI twin run, in a tiny configuration (seconds)."""
from __future__ import annotations

import json
import os
import pathlib
import runpy
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
# Seconds on an idle box; a loaded 2-core CI box stretches a fresh interpreter's torch import and engine builds
# far more, and a script's timeout only needs to end a hang before pytest's does.
SCRIPT_TIMEOUT_S = 280
pytestmark = pytest.mark.timeout(SCRIPT_TIMEOUT_S + 20)


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _run_here(monkeypatch, capsys, script: str, *args: str) -> str:
    """The script's __main__ run in this process, as `python script args` runs it, for the scripts that only parse
    and compute (no engine, process or thread of their own to leak): a fresh interpreter and its torch import cost
    seconds of CPU each, more than these scripts' work. The process-wide state a script sets (torch's thread
    count, the global RNGs) is put back for the tests after it. Returns what it printed."""
    import random

    import torch
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), *args])
    capsys.readouterr()  # what earlier steps printed is not this run's
    threads, torch_rng, py_rng = torch.get_num_threads(), torch.get_rng_state(), random.getstate()
    try:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(torch_rng)
        random.setstate(py_rng)
    return capsys.readouterr().out


def _children() -> set[int]:
    """This process's live child processes (zombies reaped first: a Popen not yet waited on is not a leak)."""
    import psutil
    subprocess._cleanup()  # reaps the killed-but-unwaited Popens the subprocess module keeps
    return {c.pid for c in psutil.Process().children() if c.status() != psutil.STATUS_ZOMBIE}


def _run_engine_script(monkeypatch, capsys, script: str, *args: str, exits: int | str = 0) -> str:
    """_run_here for a script that opens engines, draft children or threads and closes them all before it ends
    (its own child processes, a bench's fresh process per setting, stay): the fresh interpreter `python script`
    costs (its torch import, ~3 s of CPU) was most of these tiny runs' cost beside their own children's. What it
    must leave behind is checked: no child process and no thread of its own still running after it (threads get
    a grace to finish, as a closed engine's may still be exiting), and the CPUs a bench pins its process to
    given back. `exits`: the sys.exit code a script that
    ends with sys.exit(main()) raises (a message: in the one it raises). Returns what it printed."""
    import threading
    import time
    threads, children, cpus = set(threading.enumerate()), _children(), os.sched_getaffinity(0)
    try:
        out = _run_here(monkeypatch, capsys, script, *args)
    except SystemExit as exit_:
        assert (exit_.code or 0) == exits or (isinstance(exits, str) and exits in str(exit_.code)), exit_.code
        out = capsys.readouterr().out
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [t for t in set(threading.enumerate()) - threads if t.is_alive() and t.name != "tqdm_monitor"]  # tqdm's
        if not left and not _children() - children:
            break
        time.sleep(0.1)
    assert not left and not _children() - children, (left, _children() - children)
    assert os.sched_getaffinity(0) == cpus
    return out


def test_tree_gate_replay_reports_the_gate_against_the_better_kind(tmp_path, monkeypatch, capsys):
    # Trees rounds: 4 tokens in 1 s; just-in-time: 4 tokens in 2 s. Two passes, one prompt group.
    rounds = {"trees": [[[[4, 1.0]] * 60]] * 2, "just_in_time": [[[[4, 2.0]] * 60]] * 2}
    path = tmp_path / "rounds.json"
    path.write_text(json.dumps({"temperature": 0.0, "batch": 1, "rounds": rounds}))
    out = _run_here(monkeypatch, capsys, "bench_tree_gate.py", "replay", str(path), "--trials", "5")
    assert "trees 4, just-in-time 2 tok/s" in out
    mean = float(out.split("mean ")[1].split(",")[0])
    assert 0.8 < mean < 1.0  # one burst of the slower kind, then trees


def test_tree_gate_record_logs_every_forced_mode_and_replays(tmp_path, monkeypatch, capsys):
    """record drives the real SSD loop with its gate forced (one short pass), and replay reads what it wrote."""
    path = tmp_path / "rounds.json"
    out = _run(str(BENCH / "bench_tree_gate.py"), "record", "--passes", "1", "--prompts", "1", "--max-tokens", "12",
               "--out", str(path))
    rounds = json.loads(path.read_text())["rounds"]
    assert set(rounds) == {"trees", "just_in_time", "fast"}
    for mode, passes in rounds.items():
        logged = passes[0][0]
        assert logged and all(len(r) == 7 for r in logged), mode
        assert f"{mode}: {len(logged)} rounds" in out
    assert "gate / better on the same draws" in _run_here(monkeypatch, capsys, "bench_tree_gate.py", "replay", str(path),
                                                          "--trials", "2")


def test_grpc_jit_bench_times_both_paths(monkeypatch, capsys):
    out = _run_engine_script(monkeypatch, capsys, "bench_grpc_jit.py", "--rounds", "50", "--verify-ms", "1")
    assert "DraftWorker in-process: median" in out and "DraftService: median" in out and "transport:" in out


def test_grpc_hops_bench_stamps_every_hand_off():
    out = _run(str(BENCH / "bench_grpc_hops.py"), "--rounds", "20", "--verify-ms", "1")
    hops = [line.split(" median")[0].strip() for line in out.splitlines() if " median " in line]
    assert hops == ["send -> consume", "consume -> read", "read -> work", "work -> drafted", "drafted -> recv",
                    "recv -> woke", "total", "draft (work)"]


def test_tree_trip_bench_times_every_backend(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports bench_grpc_jit, as `python script` finds it beside it
    try:
        out = _run_engine_script(monkeypatch, capsys, "bench_tree_trip.py", "--rounds", "40", "--verify-ms", "1")
    finally:
        sys.modules.pop("bench_grpc_jit", None)
    assert "pipe (DraftProcess): mean" in out and "gRPC over TCP loopback: mean" in out
    assert ("gRPC over the local socket: mean" in out) == (sys.platform == "linux")


def test_codec_bench_times_every_kind_of_tree(monkeypatch, capsys):
    out = _run_here(monkeypatch, capsys, "bench_codec.py", "--reps", "3", "--vocab", "64")
    rows = out.splitlines()[2:]
    assert len(rows) == 6 and [row.count(q) for row in rows for q in ("greedy", "top-k 20", "dense")].count(1) == 6


def test_cuda_graph_bench_dry_runs_on_the_cpu(tiny_checkpoint, monkeypatch, capsys):
    """Without a GPU the graph column runs the static forward uncaptured: the script itself is checked."""
    out = _run_engine_script(monkeypatch, capsys, "bench_cuda_graphs.py", "--device", "cpu", "--models", str(tiny_checkpoint("llama")),
               "--batch", "1,3", "--tokens", "1,5", "--reps", "2")
    rows = [row.split(" | ")[2] for row in out.splitlines() if row.startswith("| ") and "model" not in row]
    assert rows == ["1", "5", "tree"] * 2  # per batch size: two extend steps, then a tree


def test_prefill_chunk_bench_reports_every_budget(monkeypatch, capsys):
    out = _run_engine_script(monkeypatch, capsys, "bench_prefill_chunks.py", "--tokens", "40", "--budgets", "64,8", "--layers", "1")
    rows = [row.split(" | ") for row in out.splitlines() if row.startswith("| 40 ")]
    assert [r[1] for r in rows] == ["64", "8"] * 2 and all(r[-1].startswith("True") for r in rows[:2])


def test_structured_bench_reports_every_system_plain_and_under_a_schema(monkeypatch, capsys):
    from saguaro_dist.engine.draft_constraints import DraftConstraints
    # the script blinds sd's draft by patching this class, and puts it back when it ends well: back in any case
    monkeypatch.setattr(DraftConstraints, "grammar_state", DraftConstraints.grammar_state)
    out = _run_engine_script(monkeypatch, capsys, "bench_structured.py", "--max-new-tokens", "6", "--num-prompts", "1", "--repeats", "1")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "system" not in line]
    assert len(rows) == 7 and "ssd / sd" in out and "sd told / untold" in out


def test_prefix_cache_bench_reports_both_workloads_with_the_cache_on_and_off(monkeypatch, capsys):
    out = _run_engine_script(monkeypatch, capsys, "bench_prefix_cache.py", "--prefix-tokens", "24", "--requests", "2", "--max-new-tokens", "3",
               "--repeats", "1")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "workload" not in line]
    assert len(rows) == 12 and "chat ssd: off / on TTFT" in out and "batch ar: off / on" in out
    reused = {(r.split("|")[1].strip(), r.split("|")[2].strip(), r.split("|")[3].strip()): float(r.split("|")[6]) for r in rows}
    assert reused[("chat", "ar", "off")] == 0 and reused[("chat", "ar", "on")] > 24


def test_kv_narrowing_bench_times_the_wide_and_the_narrowed_pool(monkeypatch, capsys):
    out = _run_engine_script(monkeypatch, capsys, "bench_kv_narrowing.py", "--batch", "2", "--long", "1100", "--steps", "3")
    assert "KV capacity 1100)" in out and out.count("KV capacity 128)") == 2 and "wide / narrowed" in out


def test_bench_configs_runs_configs_side_by_side_and_rates_them_against_the_first(monkeypatch, capsys):
    out = _run_engine_script(monkeypatch, capsys, "bench_configs.py", "--passes", "2", "--prompts", "1", "--max-tokens", "16",
               "--temperature", "0.7", "sd", 'trees=ssd:{"tree_policy": "always"}')
    assert "sd: sd {}; target + draft: bench process" in out and 'trees: ssd {"tree_policy": "always"}' in out
    lines = {line.split()[0]: line for line in out.splitlines() if "x first" in line}
    assert set(lines) == {"sd", "trees"} and "x first 1.00 (1.00-1.00)" in lines["sd"]
    assert len(lines["trees"].split("tok/s")[1].split("x first")[0].split()) == 2  # one figure a pass
    assert "trees 0;" in lines["sd"] and "trees 0;" not in lines["trees"]


@pytest.mark.parametrize("config, reason", [("x=foo", "system must be one of"), ("ssd:{bad", "not JSON"),
                                            ("ssd:[1]", "must be a JSON object"), ("sd", "share a label")])
def test_bench_configs_refuses_a_bad_config_before_it_opens_anything(config, reason, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error, before any engine is built
        _run_here(monkeypatch, capsys, "bench_configs.py", "sd", config)
    assert exit_.value.code == 2 and reason in capsys.readouterr().err


def test_bench_configs_reports_an_engine_kwarg_the_engine_refuses(monkeypatch, capsys):
    # SystemExit of a message: the interpreter prints it to stderr and exits 1, as `python bench_configs.py` did;
    # the engine opened before it (sd) is closed (_run_engine_script's check)
    _run_engine_script(monkeypatch, capsys, "bench_configs.py", "--passes", "1", "--prompts", "1", "--max-tokens", "4",
                       "sd", 'ssd:{"k": 0}', exits="error: ssd: k must be an integer >= 1")


def test_coupled_bonus_bench_rates_top_f_against_coupled_draws(monkeypatch, capsys):
    out = _run_here(monkeypatch, capsys, "bench_coupled_bonus.py", "--rounds", "4", "--draws", "8", "--budgets", "5")
    assert "4 rounds, T = 0.7" in out and "top-F" in out and "coupled (whole guess)" in out
