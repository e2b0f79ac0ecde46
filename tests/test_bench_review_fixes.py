"""`saguaro bench`'s core budgets made real: SSD refuses a one-core budget (it runs two processes), and the
settings' placements pin the processes to CPUs (they only set torch thread counts, and the processes floated)."""
from __future__ import annotations

import os

import pytest

from saguaro_dist.bench import BenchConfig, SweepConfig, run_grid
from saguaro_dist.bench.config import placement
from saguaro_dist.bench.report import render
from saguaro_dist.bench.systems import make_system
from saguaro_dist.engine.draft_process_parent import CHILD_MODULE

CPUS = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_setaffinity") else ()
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="pinning needs sched_setaffinity and 2 CPUs")


# ---- --cores 1 -------------------------------------------------------------------------------------

def test_one_core_is_refused_when_an_ssd_system_runs():
    """--cores 1 gave ar 1 core under *equal* and ssd its 2 processes (2 cores) all the same."""
    with pytest.raises(ValueError, match="--cores 1: ssd"):
        BenchConfig(cores=1, systems=("ar", "ssd"))
    with pytest.raises(ValueError, match="--cores 1: ssd-ray"):
        SweepConfig(base=BenchConfig(cores=1, systems=("ar",)), system="ssd-ray")
    assert BenchConfig(cores=1, systems=("ar", "sd", "hf")).cores == 1  # one process each: one core is a budget


def test_the_cli_says_why_it_refuses_one_core(tiny_llama_pair, tmp_path, capsys):
    from saguaro_dist.cli import main
    code = main(["bench", "--preset", "quick", "--target", str(tiny_llama_pair[0]), "--draft", str(tiny_llama_pair[1]),
                 "--out", str(tmp_path), "--no-progress", "--systems", "ar,ssd", "--cores", "1"])
    assert code == 2 and "--cores 1: ssd run the target and the draft on a core each" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


# ---- pinning ---------------------------------------------------------------------------------------

def test_the_pinning_plan_says_where_it_cannot_pin():
    from saguaro_dist.bench.affinity import plan_pinning
    assert plan_pinning("ssd", "paper", 2, True, (4, 5, 6)).text == "target cpu4, draft process cpu5"
    assert plan_pinning("sd", "equal", 2, True, (0, 1, 2)).text == "target + draft cpu0-1"
    assert plan_pinning("ar", "paper", 1, False, (0, 1)).target_cpus == (0,)
    assert plan_pinning("ssd-thread", "paper", 2, True, (0, 1)).text == "target + draft cpu0-1"
    for args, why in ((("ssd", "paper", 2, True, ()), "this OS cannot set CPU affinity"),
                      (("ssd", "paper", 2, True, (0,)), "1 CPU(s) available to the bench, 2 needed"),
                      (("ssd-ray", "paper", 2, True, (0, 1)), "Ray's actor processes are not the bench's children")):
        pinning = plan_pinning(*args)
        assert pinning.text == f"not pinned ({why})" and pinning.target_cpus == pinning.draft_cpus == ()


def process_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of `pid`, as the kernel has them."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def draft_children_of_this_process() -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if ppid == os.getpid() and CHILD_MODULE.encode() in cmdline:
            found.append(int(entry))
    return found


@needs_two_cpus
@pytest.mark.slow
def test_paper_pins_the_target_to_one_cpu_and_the_draft_child_to_the_other(tiny_llama_pair):
    own, others = process_cpus(os.getpid()), set(draft_children_of_this_process())  # (earlier tests' children)
    runner = make_system("ssd", *tiny_llama_pair, dict(k=2, fan_out=6, device="cpu", dtype="float32", max_batch_size=1))
    try:
        runner.open(placement("ssd", "paper"))
        (child,) = set(draft_children_of_this_process()) - others
        assert runner.run([[3, 4, 5, 6, 7]], 0.0, 8, 0).tokens == 8
        assert process_cpus(os.getpid()) == {frozenset(CPUS[:1])}  # every thread, the engine's too
        assert process_cpus(child) == {frozenset(CPUS[1:2])}  # its threads started after the pin too
        assert f"draft pid {child} cpu{CPUS[1]}" in runner.pinned
    finally:
        runner.close()
    assert process_cpus(os.getpid()) == own  # the next system does not inherit ssd's pins


@needs_two_cpus
@pytest.mark.slow
def test_a_grid_records_and_prints_its_pinning_and_gives_the_cpus_back(tiny_llama_pair, tmp_path):
    """Interleaved: every system open at once, each re-pinning the bench process before its passes."""
    own = process_cpus(os.getpid())
    cfg = BenchConfig(target=tiny_llama_pair[0], draft=tiny_llama_pair[1], systems=("ar", "ssd", "hf"),
                      settings=("paper", "equal"), batch_sizes=(1,), temperatures=(0.0,), max_new_tokens=6, prompt_len=5,
                      k=2, fan_out=6, num_prompts=1, out_dir=str(tmp_path), plots=False, interleave=True)
    results = run_grid(cfg, progress=False)
    assert process_cpus(os.getpid()) == own
    c0, c1 = CPUS[:2]
    text = render(results)
    assert "placement paper/ssd: " in text and f"CPUs: target cpu{c0}, draft process cpu{c1}" in text
    assert f"CPUs: target cpu{c0}-{c1}" in text  # equal/ar [2 thread(s)]
    pinning = results["placements"]["paper/ssd"]["pinning"]
    assert (pinning["target_cpus"], pinning["draft_cpus"]) == ((c0,), (c1,))
    cells = {(c["setting"], c["system"]): c for c in results["cells"]}
    assert cells[("paper", "hf")]["placement"]["pinning"]["target_cpus"] == (c0,)
    assert cells[("equal", "ssd")]["placement"]["pinning"]["draft_cpus"] == (c0, c1)
    assert results["errors"] == [] and cells[("paper", "ssd")]["greedy_same_as_ar"] == 1.0
