"""`saguaro bench` code paths in a tiny configuration: results schema, JSON, PNGs, CLI, sweep."""
from __future__ import annotations

import json
import warnings

import pytest

from saguaro_dist.bench import BenchConfig, SweepConfig, run_grid, run_sweep
from saguaro_dist.bench.config import candidate_placements, placement
from saguaro_dist.bench.plots import speedup_vs_batch, write_plots
from saguaro_dist.bench.report import render, round_mix, write_json
from saguaro_dist.bench.runner import measure_interleaved, run_batches
from saguaro_dist.bench.systems import Measurement
from saguaro_dist.cli import main

CELL_KEYS = {"system", "setting", "batch", "temperature", "tokens", "seconds", "tokens_per_s", "cores",
             "tokens_per_s_per_core", "placement", "acceptance_rate", "cache_hit_rate", "speedup_vs_ar",
             "speedup_vs_sd", "greedy_same_as_ar", "theorem7", "engine", "prompts", "repeat_tokens_per_s",
             "paired_vs_ar", "paired_vs_sd"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_config(pair, tmp_path, **kw) -> BenchConfig:
    base = dict(target=pair[0], draft=pair[1], systems=("ar", "sd", "ngram", "ssd", "hf", "hf-assisted"), settings=("paper",),
                batch_sizes=(1, 2), temperatures=(0.0, 0.7), max_new_tokens=8, prompt_len=6, k=2, fan_out=6,
                num_prompts=2, out_dir=str(tmp_path))
    return BenchConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def grid(tiny_llama_pair, tmp_path_factory):
    return run_grid(tiny_config(tiny_llama_pair, tmp_path_factory.mktemp("grid")), progress=False)


def test_grid_cells_cover_the_grid_with_the_schema(grid):
    assert grid["kind"] == "grid" and grid["schema"] == 1
    assert len(grid["cells"]) == 6 * 2 * 2
    for cell in grid["cells"]:
        assert CELL_KEYS <= set(cell), CELL_KEYS - set(cell)
        assert cell["prompts"] == 2 and cell["tokens"] == 8 * 2  # every batch size runs the same two prompts
        assert cell["tokens_per_s"] > 0 and cell["tokens_per_s_per_core"] == cell["tokens_per_s"] / cell["cores"]
    assert set(grid["placements"]) == {f"paper/{s}" for s in ("ar", "sd", "ngram", "ssd", "hf", "hf-assisted")}


def test_greedy_outputs_match_ours_ar_and_ssd_cells_carry_theorem7(grid):
    for cell in grid["cells"]:
        if cell["temperature"] == 0:
            assert cell["greedy_same_as_ar"] == 1.0, cell["system"]
            assert cell["system"] == "ar" or cell["greedy_departures"] == [], cell["system"]
        if cell["system"] == "ssd":
            t = cell["theorem7"]
            assert t["predicted_tokens_per_s"] > 0
            # no hit rate only when the tree gate ran the whole cell without trees (no lookups)
            assert (t["hit_rate"] is None) == (cell["cache_hit_rate"] is None)
            assert t["hit_rate"] is None or 0 <= t["hit_rate"] <= 1
            assert t["measured_tokens_per_s"] == pytest.approx(cell["tokens_per_s"])
            assert t["predicted_run_tokens_per_s"] > 0 and t["prefill_s"] > 0  # the run's: its prefills' time added
            assert t["best_case_tokens_per_s"] >= t["predicted_run_tokens_per_s"] * (1 - 1e-9) and t["best_case_vs_sd"] > 0
        else:
            assert cell["theorem7"] is None


def test_json_round_trips_and_table_and_plot_are_written(grid, tmp_path):
    path = write_json(grid, tmp_path / "results.json")
    assert json.loads(path.read_text())["cells"][0]["system"] == "ar"
    text = render(grid)
    assert "| paper | ssd | 1 | 0.0 |" in text and "Theorem 7 paper/ssd b=1 T=0.0: predicted" in text
    assert "best case:" in text
    assert "placement paper/ssd:" in text
    (png,) = write_plots(grid, tmp_path)
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_sweep_points_plots_and_predictions(tiny_llama_pair, tmp_path):
    # Each point opens its own SSD engine (a draft child process): one budget a kind shows the fan-out axis, the
    # least one kept (k + 1 = 3); budget 2, under it, is left out of the sweep.
    sweep = SweepConfig(base=tiny_config(tiny_llama_pair, tmp_path), ks=(2,), budgets=(2, 3), cs=(1.0, 0.5),
                        fallbacks=("fast",), temperature=0.7)
    results = run_sweep(sweep, progress=False)
    axes = [p["axis"] for p in results["points"]]
    assert axes == ["k"] + ["fan_out"] * 3 + ["saguaro_c", "saguaro_c", "fallback"]  # 1 budget x 3 kinds
    assert {p["fan_out"] for p in results["points"] if p["axis"] == "fan_out"} == {3}
    assert all(p["theorem7"]["predicted_tokens_per_s"] > 0 for p in results["points"])
    assert all(p["calibration"]["batch"] == sweep.batch_size for p in results["points"])  # not every prompt at once
    pngs = write_plots(results, tmp_path)
    assert [p.name for p in pngs] == ["hit_rate_vs_budget.png", "acceptance_hit_vs_c.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)


def test_cli_quick_run_writes_results(tiny_llama_pair, tmp_path, capsys):
    code = main(["bench", "--preset", "quick", "--target", str(tiny_llama_pair[0]), "--draft", str(tiny_llama_pair[1]),
                 "--out", str(tmp_path), "--no-progress", "--systems", "ar,ssd", "--batch", "1", "--k", "2",
                 "--fan-out", "6", "--prompt-len", "4", "--max-new-tokens", "6"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| paper | ssd | 1 | 0.0 |" in out and "Theorem 7" in out
    assert json.loads((tmp_path / "results.json").read_text())["config"]["systems"] == ["ar", "ssd"]
    assert (tmp_path / "speedup_vs_batch.png").is_file()


def test_cli_runs_every_system_in_the_dtype_asked_for(tiny_llama_pair, tmp_path, capsys):
    """--device / --dtype reach ours and transformers alike (benchmarks/gpu_check.sh passes cuda, bf16)."""
    code = main(["bench", "--preset", "quick", "--target", str(tiny_llama_pair[0]), "--draft", str(tiny_llama_pair[1]),
                 "--out", str(tmp_path), "--no-progress", "--no-plots", "--systems", "sd,hf-assisted", "--batch", "1",
                 "--settings", "equal", "--k", "2", "--prompt-len", "4", "--max-new-tokens", "6",
                 "--device", "cpu", "--dtype", "bfloat16"])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["config"]["device"], results["config"]["dtype"]) == ("cpu", "bfloat16")
    assert {c["system"] for c in results["cells"]} == {"sd", "hf-assisted"}
    assert "| equal | hf-assisted | 1 | 0.0 |" in capsys.readouterr().out


def test_bad_options_are_value_errors(tiny_llama_pair, tmp_path):
    with pytest.raises(ValueError, match="unknown systems"):
        BenchConfig(systems=("vllm",))
    with pytest.raises(ValueError, match="unknown preset"):
        BenchConfig.preset("huge")
    with pytest.raises(ValueError, match="dtype"):
        BenchConfig(dtype="int8")
    # the engine's checks of the SSD knobs, and the cores, before any cell loads a model (they came after one)
    for bad, message in ((dict(k=0), "k must be"), (dict(fan_out_kind="bogus"), "fan_out_kind"),
                         (dict(saguaro_c=1.5), "saguaro_c"), (dict(cores=0), "cores")):
        with pytest.raises(ValueError, match=message):
            BenchConfig(**bad)
    assert main(["bench", "--preset", "quick", "--target", str(tiny_llama_pair[0]), "--out", str(tmp_path)]) == 2


def test_placement_counts_cores_per_setting():
    assert placement("ar", "paper").cores == 1 and placement("ar", "equal").cores == 2
    assert placement("sd", "equal").target_threads == 2
    assert placement("ssd-ray", "paper") == placement("ssd-ray", "equal")
    assert placement("ssd-ray", "paper").cores == 2 and "Ray actor" in placement("ssd-ray", "paper").where


def test_interleaved_grid_runs_every_system_in_turn(tiny_llama_pair, tmp_path):
    cfg = tiny_config(tiny_llama_pair, tmp_path, systems=("ar", "sd", "ssd"), temperatures=(0.0,), repeats=3,
                      interleave=True)
    cells = run_grid(cfg, progress=False)["cells"]
    assert [(c["system"], c["batch"]) for c in cells] == [(s, b) for b in (1, 2) for s in ("ar", "sd", "ssd")]
    for c in cells:
        assert c["greedy_same_as_ar"] == 1.0 and c["prompts"] == 2 and c["tokens"] == 8 * 2  # every b: the same prompts
        assert c["system"] == "ar" or c["engine"]["rounds"] > 0
        assert len(c["repeat_tokens_per_s"]) == 3 and max(c["repeat_tokens_per_s"]) == c["tokens_per_s"]
        assert c["paired_vs_sd"]["n"] == 3 and c["paired_vs_sd"]["low"] <= c["paired_vs_sd"]["median"] <= c["paired_vs_sd"]["high"]
    sd = next(c for c in cells if c["system"] == "sd")
    assert sd["paired_vs_sd"] == {"median": 1.0, "low": 1.0, "high": 1.0, "n": 3}


def test_interleaved_repeats_rotate_the_order():
    calls = []

    class Recorder:  # stands in for a benched system: only the call order is under test
        def __init__(self, name):
            self.name = name

        def run(self, prompts, temperature, max_new_tokens, seed):
            calls.append((self.name, max_new_tokens))
            return Measurement(tokens=max_new_tokens, seconds=1.0, outputs=[])

    cfg = BenchConfig(max_new_tokens=16, repeats=3)
    best = measure_interleaved({n: Recorder(n) for n in "abc"}, [[1]], 1, 0.0, cfg)
    names = [name for name, _ in calls]
    assert names[:3] == ["a", "b", "c"]  # warm-ups first: one whole pass each (the gates learn in it)
    assert names[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert set(best) == {"a", "b", "c"}
    assert all(r.tokens_per_s == [16.0] * 3 and r.best.tokens == 16 for r in best.values())


def test_the_warm_up_is_two_whole_untimed_passes_on_a_gpu_one_elsewhere():
    calls = []

    class Recorder:  # only the calls are under test: a GPU captures a graph per shape a pass meets
        def run(self, prompts, temperature, max_new_tokens, seed):
            calls.append((len(prompts), max_new_tokens))
            return Measurement(tokens=max_new_tokens, seconds=1.0, outputs=[])

    prompts = [[0], [1], [2], [3]]
    measure_interleaved({"a": Recorder()}, prompts, 2, 0.0, BenchConfig(max_new_tokens=16, device="cuda"))
    assert calls == [(2, 16)] * 6  # two whole passes warm up (graphs, then the pass after them), one is timed
    calls.clear()
    measure_interleaved({"a": Recorder()}, prompts, 2, 0.0, BenchConfig(max_new_tokens=16))
    assert calls == [(2, 16)] * 4  # on the CPU one whole pass (SSD's gates learn the batch size in it), one timed


def test_a_cell_runs_every_prompt_in_batches_seeded_by_prompt():
    calls = []

    class Recorder:
        def run(self, prompts, temperature, max_new_tokens, seed):
            calls.append((prompts, seed))
            return Measurement(tokens=len(prompts), seconds=0.5, outputs=prompts, drafted=2, fallbacks={"fast": 1},
                               engine={"rounds": 3, "fallbacks": {"fast": 1}})

    m = run_batches(Recorder(), [[0], [1], [2], [3], [4]], 2, 0.0, BenchConfig(seed=7))
    assert calls == [([[0], [1]], 7), ([[2], [3]], 9)]  # the remainder short of a batch is left out
    assert (m.tokens, m.seconds, m.outputs, m.drafted) == (4, 1.0, [[0], [1], [2], [3]], 4)
    assert m.fallbacks == {"fast": 2} and m.engine == {"rounds": 6, "fallbacks": {"fast": 2}}
    calls.clear()
    run_batches(Recorder(), [[0], [1], [2], [3], [4]], 2, 0.7, BenchConfig(seed=7), repeat=2)
    assert calls == [([[0], [1]], 17), ([[2], [3]], 19)]  # repeat 2: the seeds after repeats 0 and 1's five


def test_num_prompts_must_cover_the_largest_batch():
    assert BenchConfig(batch_sizes=(1, 4)).prompt_count == 8  # never one prompt by default (--batch 1 alone)
    assert BenchConfig(batch_sizes=(1,)).prompt_count == 8 and BenchConfig(batch_sizes=(16,)).prompt_count == 32
    assert BenchConfig(batch_sizes=(1, 2, 4, 8)).prompt_count == 16  # two batches of the largest a pass
    assert BenchConfig(batch_sizes=(1, 4), num_prompts=4).prompt_count == 4
    with pytest.raises(ValueError, match="num_prompts"):  # when the grid reads it (a sweep runs other sizes)
        BenchConfig(batch_sizes=(1, 4), num_prompts=2).prompt_count


def test_ssd_on_ray_cell(tiny_llama_pair, tmp_path, ray_cluster):
    cfg = tiny_config(tiny_llama_pair, tmp_path, systems=("ar", "ssd-ray"), batch_sizes=(1,), temperatures=(0.0,),
                      interleave=True)  # as bench_distributed.py runs it: a one-host engine beside the Ray one
    cells = {c["system"]: c for c in run_grid(cfg, progress=False)["cells"]}
    ray_cell = cells["ssd-ray"]
    assert ray_cell["greedy_same_as_ar"] == 1.0 and ray_cell["theorem7"]["predicted_tokens_per_s"] > 0
    assert ray_cell["engine"]["rounds"] > 0 and ray_cell["cores"] == 2


def test_equal_tries_one_process_systems_on_one_thread_too():
    two, one = candidate_placements("sd", "equal")
    assert (two.target_threads, one.target_threads, one.draft_threads) == (2, 1, 1)
    assert two.cores == one.cores == 2  # the budget counts both cores, used or idle
    assert candidate_placements("ar", "equal")[1].draft_threads is None
    assert candidate_placements("sd", "paper") == [placement("sd", "paper")]
    assert candidate_placements("ssd", "equal") == [placement("ssd", "equal")]


@pytest.mark.parametrize("interleave", [True, False])
def test_an_equal_cell_keeps_the_faster_thread_count(tiny_llama_pair, tmp_path, interleave):
    cfg = tiny_config(tiny_llama_pair, tmp_path, systems=("ar", "sd", "ssd"), settings=("equal",), batch_sizes=(1,),
                      temperatures=(0.0,), interleave=interleave)
    results = run_grid(cfg, progress=False)
    cells = {c["system"]: c for c in results["cells"]}
    for name in ("ar", "sd"):
        candidates = cells[name]["candidates"]
        assert sorted(c["target_threads"] for c in candidates) == [1, 2]
        fastest = max(candidates, key=lambda c: c["tokens_per_s"])
        assert cells[name]["tokens_per_s"] == fastest["tokens_per_s"]
        assert cells[name]["placement"]["target_threads"] == fastest["target_threads"]
        assert cells[name]["cores"] == 2 and cells[name]["greedy_same_as_ar"] == 1.0
    assert "candidates" not in cells["ssd"]
    assert {"equal/sd [1 thread(s)]", "equal/sd [2 thread(s)]", "equal/ssd"} <= set(results["placements"])


@pytest.mark.parametrize("systems, field", [(("ar", "sd", "ssd"), "speedup_vs_ar"), (("sd", "ssd"), "speedup_vs_sd"),
                                            (("ssd",), "tokens_per_s")])
def test_the_batch_plot_draws_every_system_over_the_baseline_that_ran(tmp_path, systems, field):
    """`--systems sd,ssd` has no ar to divide by: the plot is over sd then, not an empty panel."""
    cells = [{"system": s, "setting": "paper", "temperature": 0.0, "batch": b, "tokens_per_s": 100.0 * b,
              "speedup_vs_ar": 1.5 if "ar" in systems else None, "speedup_vs_sd": 1.2 if "sd" in systems else None}
             for s in systems for b in (1, 8)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns of a legend with no lines
        path = speedup_vs_batch({"cells": cells}, tmp_path / "speedup.png")
    assert path.read_bytes()[:8] == PNG_MAGIC and all(c[field] for c in cells)


def test_round_mix_splits_an_ssd_cells_rounds_by_kind():
    engine = {"rounds": 200, "just_in_time_rounds": 50, "fast_rounds": 30, "lookup_rounds": 10}
    assert round_mix(engine) == "trees 55%, SD's 25%, n-gram 15%, rounds whose rows all took n-gram proposals 5%"
    assert round_mix({"rounds": 0}) == "no rounds"
