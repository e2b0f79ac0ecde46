"""`saguaro bench` against what it claims: transformers' baselines sample as ours do, a system that fails
costs its own cells only, plots are drawn whatever cells ran, and the progress bar says what runs."""
from __future__ import annotations

import json
import shutil
import warnings

import pytest

from saguaro_dist.bench import BenchConfig, SweepConfig, run_grid, run_sweep
from saguaro_dist.bench import runner as bench_runner
from saguaro_dist.bench.config import placement
from saguaro_dist.bench.plots import acceptance_hit_vs_c, hit_rate_vs_budget, speedup_vs_batch, write_plots
from saguaro_dist.bench.report import render, write_json
from saguaro_dist.bench.runner import measure_batches
from saguaro_dist.bench.systems import make_system

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny(pair, tmp_path, **kw) -> BenchConfig:
    base = dict(target=pair[0], draft=pair[1], systems=("ar", "sd"), settings=("paper",), batch_sizes=(1, 2),
                temperatures=(0.0,), max_new_tokens=6, prompt_len=5, k=2, fan_out=6, num_prompts=2, out_dir=str(tmp_path),
                plots=True)
    return BenchConfig(**{**base, **kw})


# ---- transformers' baselines -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair_with_sampling_defaults(tiny_llama_pair, tmp_path_factory):
    """The tiny pair, each checkpoint's generation_config.json setting sampling defaults as real ones do
    (Qwen2.5's repetition_penalty 1.05, top_k 20): generate() applies them to every call that leaves them unset."""
    root = tmp_path_factory.mktemp("pair_with_defaults")
    paths = []
    for src, name in zip(tiny_llama_pair, ("target", "draft")):
        dst = shutil.copytree(src, root / name)
        config_path = dst / "generation_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        config.update({"repetition_penalty": 3.0, "no_repeat_ngram_size": 2, "do_sample": True, "temperature": 0.3,
                       "top_k": 5, "num_assistant_tokens": 9, "num_assistant_tokens_schedule": "heuristic"})
        config_path.write_text(json.dumps(config))
        paths.append(str(dst))
    return tuple(paths)


def greedy_outputs(system: str, pair, prompts) -> list[list[int]]:
    runner = make_system(system, pair[0], pair[1], dict(k=2, fan_out=6, device="cpu", dtype="float32", max_batch_size=2))
    runner.open(placement(system, "paper"))
    try:
        m = runner.run(prompts, 0.0, 12, 0)
    finally:
        runner.close()
    assert m.tokens == 12 * len(prompts)  # the prompt left out, no EOS: max_new_tokens each
    return m.outputs


def test_transformers_baselines_sample_as_ours_do_not_as_the_checkpoint_says(pair_with_sampling_defaults):
    """Ours run plain SamplingParams (the generation config only fills requests that give none); transformers'
    generate() filled repetition_penalty and no_repeat_ngram_size from the checkpoint, greedy runs too, so hf
    and hf-assisted ran another sampler (and their greedy tokens departed from ar's)."""
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    ours = greedy_outputs("ar", pair_with_sampling_defaults, prompts)
    assert greedy_outputs("hf", pair_with_sampling_defaults, prompts) == ours
    assert greedy_outputs("hf-assisted", pair_with_sampling_defaults, prompts) == ours


def drafted_per_round(monkeypatch) -> list[tuple[int, int]]:
    """(tokens the assistant drafted, sequence length before) per round of transformers' assisted generation."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator
    rounds, real = [], AssistedCandidateGenerator.get_candidates

    def counted(self, input_ids, *args, **kwargs):
        out = real(self, input_ids, *args, **kwargs)
        rounds.append((out[0].shape[1] - input_ids.shape[1], input_ids.shape[1]))
        return out
    monkeypatch.setattr(AssistedCandidateGenerator, "get_candidates", counted)
    return rounds


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_assistant_drafts_k_tokens_a_round_whatever_the_draft_checkpoint_says(pair_with_sampling_defaults,
                                                                                   monkeypatch, temperature):
    """Fixed-K SD, as ours: the checkpoint's heuristic schedule (9 tokens) and transformers' default confidence
    stop (an assistant token under probability 0.4 ends the draft) drafted ~1 token a round, not K."""
    rounds = drafted_per_round(monkeypatch)
    runner = make_system("hf-assisted", *pair_with_sampling_defaults, dict(k=3, device="cpu", dtype="float32"))
    runner.open(placement("hf-assisted", "paper"))
    try:
        prompt, new = [3, 4, 5, 6, 7, 8], 16
        assert runner.run([prompt], temperature, new, 0).tokens == new
        assert runner.model.generation_config.no_repeat_ngram_size in (None, 0)
    finally:
        runner.close()
    assert len(rounds) > 1
    # K a round; at the end what fits before max_new_tokens (transformers keeps room for the bonus token)
    assert [n for n, _ in rounds] == [max(0, min(3, len(prompt) + new - length - 1)) for _, length in rounds]


# ---- a system that fails ---------------------------------------------------------------------------

class Failing:
    """A real system that raises where asked: when it opens, or when a pass runs `fail_batch` prompts."""

    def __init__(self, inner, fail_open: bool = False, fail_batch: int | None = None):
        self.inner, self.fail_open, self.fail_batch = inner, fail_open, fail_batch

    def open(self, place):
        if self.fail_open:
            raise RuntimeError("no room for the draft")
        self.inner.open(place)

    def run(self, prompts, temperature, max_new_tokens, seed):
        if len(prompts) == self.fail_batch:
            raise RuntimeError("engine died")
        return self.inner.run(prompts, temperature, max_new_tokens, seed)

    def close(self):
        self.inner.close()


def failing(monkeypatch, system: str, **how) -> None:
    real = bench_runner.make_system
    monkeypatch.setattr(bench_runner, "make_system",
                        lambda name, *a: Failing(real(name, *a), **how) if name == system else real(name, *a))


@pytest.mark.parametrize("interleave", [False, True])
def test_a_system_failing_at_one_batch_size_costs_only_its_cells(tiny_llama_pair, tmp_path, monkeypatch, interleave):
    failing(monkeypatch, "sd", fail_batch=2)
    cfg = tiny(tiny_llama_pair, tmp_path, interleave=interleave)
    results = run_grid(cfg, progress=False)  # raised, losing ar's cells and sd's b = 1
    cells = {(c["system"], c["batch"]): c for c in results["cells"]}
    assert set(cells) == {("ar", 1), ("ar", 2), ("sd", 1), ("sd", 2)}
    for key in (("ar", 1), ("ar", 2), ("sd", 1)):
        assert cells[key]["error"] is None and cells[key]["tokens"] == 6 * 2 and cells[key]["tokens_per_s"] > 0
    assert cells[("sd", 1)]["greedy_same_as_ar"] == 1.0 and cells[("sd", 1)]["speedup_vs_ar"] > 0
    bad = cells[("sd", 2)]
    assert "engine died" in bad["error"] and "b=2" in bad["error"]
    assert set(cells[("sd", 1)]) <= set(bad)  # the same fields, figures None
    assert (bad["tokens_per_s"], bad["speedup_vs_ar"], bad["greedy_same_as_ar"], bad["theorem7"]) == (None,) * 4
    assert cells[("ar", 2)]["speedup_vs_sd"] is None  # no ratio to a cell that did not run
    assert results["errors"] == [{"system": "sd", "setting": "paper", "batch": 2, "temperature": 0.0, "error": bad["error"]}]
    text = render(results)
    assert "FAILED paper/sd b=2 T=0.0:" in text and "engine died" in text
    assert json.loads(write_json(results, tmp_path / "results.json").read_text())["errors"] == results["errors"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (png,) = write_plots(results, tmp_path)
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("interleave", [False, True])
def test_a_system_that_cannot_open_reports_every_cell_and_the_others_run(tiny_llama_pair, tmp_path, monkeypatch,
                                                                          interleave):
    failing(monkeypatch, "ssd", fail_open=True)
    cfg = tiny(tiny_llama_pair, tmp_path, systems=("ar", "ssd", "sd"), batch_sizes=(1,), interleave=interleave)
    results = run_grid(cfg, progress=False)
    cells = {c["system"]: c for c in results["cells"]}
    assert "no room for the draft" in cells["ssd"]["error"] and "loading" in cells["ssd"]["error"]
    assert cells["ssd"]["theorem7"] is None and results["calibration"] == []  # no SSD cell ran: none calibrated
    assert cells["sd"]["error"] is None and cells["sd"]["greedy_same_as_ar"] == 1.0
    assert [e["system"] for e in results["errors"]] == ["ssd"]


def test_a_failing_sweep_point_keeps_the_others(tiny_llama_pair, tmp_path, monkeypatch):
    real = bench_runner.make_system

    def make(name, target, draft, engine_kwargs):
        inner = real(name, target, draft, engine_kwargs)
        return Failing(inner, fail_batch=1) if engine_kwargs["saguaro_c"] == 0.5 else inner
    monkeypatch.setattr(bench_runner, "make_system", make)
    sweep = SweepConfig(base=tiny(tiny_llama_pair, tmp_path), ks=(2,), budgets=(6,), kinds=("uniform",), cs=(1.0, 0.5),
                        fallbacks=(), temperature=0.7)
    results = run_sweep(sweep, progress=False)
    points = {(p["axis"], p["saguaro_c"]): p for p in results["points"]}
    assert [p["axis"] for p in results["points"]] == ["k", "fan_out", "saguaro_c", "saguaro_c"]
    assert "engine died" in points[("saguaro_c", 0.5)]["error"] and points[("saguaro_c", 0.5)]["theorem7"] is None
    assert points[("saguaro_c", 1.0)]["error"] is None and points[("saguaro_c", 1.0)]["theorem7"]["predicted_tokens_per_s"] > 0
    assert [e["overrides"] for e in results["errors"]] == [{"saguaro_c": 0.5}]
    assert "FAILED" in render(results)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pngs = write_plots(results, tmp_path)
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)


# ---- plots -----------------------------------------------------------------------------------------

def test_the_batch_plot_is_drawn_when_every_cell_failed_or_none_ran(tmp_path):
    from saguaro_dist.bench.runner import error_cell
    failed = [{**error_cell(s, "paper", placement(s, "paper"), 1, 0.0, "boom"), "speedup_vs_ar": None,
               "speedup_vs_sd": None} for s in ("ar", "sd", "ssd")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns of a legend with no lines
        for n, cells in enumerate((failed, [])):
            path = speedup_vs_batch({"cells": cells}, tmp_path / f"speedup{n}.png")
            assert path.read_bytes()[:8] == PNG_MAGIC


def test_the_batch_plot_falls_back_to_sd_when_ar_failed(tmp_path):
    cells = [{"system": "ar", "setting": "paper", "temperature": 0.0, "batch": 1, "tokens_per_s": None,
              "speedup_vs_ar": None, "speedup_vs_sd": None},
             {"system": "ssd", "setting": "paper", "temperature": 0.0, "batch": 1, "tokens_per_s": 90.0,
              "speedup_vs_ar": None, "speedup_vs_sd": 1.2},
             {"system": "sd", "setting": "paper", "temperature": 0.0, "batch": 1, "tokens_per_s": 75.0,
              "speedup_vs_ar": None, "speedup_vs_sd": 1.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        speedup_vs_batch({"cells": cells}, tmp_path / "speedup.png")


def test_sweep_plots_without_points_of_their_axis_or_with_failed_ones(tmp_path):
    failed = {"axis": "saguaro_c", "saguaro_c": 0.5, "fan_out": 6, "fan_out_kind": "uniform",
              "acceptance_rate": None, "cache_hit_rate": None, "error": "boom"}
    results = {"sweep": {"temperature": 0.7}, "points": [failed, {**failed, "axis": "fan_out"}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for plot, name in ((hit_rate_vs_budget, "hit.png"), (acceptance_hit_vs_c, "c.png")):
            assert plot(results, tmp_path / name).read_bytes()[:8] == PNG_MAGIC
            assert plot({**results, "points": []}, tmp_path / name).read_bytes()[:8] == PNG_MAGIC


# ---- the progress bar ------------------------------------------------------------------------------

class Bar:
    def __init__(self):
        self.postfixes = []

    def set_postfix_str(self, text):
        self.postfixes.append(text)


def test_the_progress_bar_says_which_batch_size_runs_not_loading(tiny_llama_pair, tmp_path):
    cfg = tiny(tiny_llama_pair, tmp_path, systems=("ar",))
    bar = Bar()
    timed = measure_batches(cfg, "ar", placement("ar", "paper"), *tiny_llama_pair, [[1, 2, 3, 4, 5]] * 2, 0.0, bar)
    assert len(timed) == 2
    assert "loading" in bar.postfixes[0]
    assert [p for p in bar.postfixes if "loading" not in p] and "b=2" in bar.postfixes[-1]


# ---- serving ratios --------------------------------------------------------------------------------

def test_a_serving_ratio_over_an_sd_stream_that_counted_no_tokens_is_none():
    """A stream whose server sent no usage counts 0 output tokens: its ratio is unknown, not a ZeroDivisionError
    that loses every cell of the run."""
    from saguaro_dist.bench.serving import annotate_serving
    cells = [{"system": s, "setting": "remote", "temperature": 0.7, "rate": "inf", "output_tokens_per_s": rate,
              "repeat_output_tokens_per_s": [rate], "outputs": [[]]} for s, rate in (("sd", 0.0), ("ssd", 50.0))]
    annotate_serving(cells)
    assert [c["speedup_vs_sd"] for c in cells] == [None, None]
    assert [c["paired_vs_sd"] for c in cells] == [None, None]  # paired_ratios skips a 0 baseline


def test_the_cli_writes_the_results_and_exits_1_when_a_cell_failed(tiny_llama_pair, tmp_path, monkeypatch, capsys):
    """A script or CI job running the bench learns of a failed cell from the exit code (it was 0)."""
    from saguaro_dist.cli import main
    failing(monkeypatch, "sd", fail_batch=1)
    code = main(["bench", "--preset", "quick", "--target", str(tiny_llama_pair[0]), "--draft", str(tiny_llama_pair[1]),
                 "--out", str(tmp_path), "--no-progress", "--systems", "ar,sd", "--batch", "1", "--k", "2",
                 "--prompt-len", "4", "--max-new-tokens", "6", "--no-plots"])
    assert code == 1 and "1 cell(s) failed" in capsys.readouterr().err
    assert [e["system"] for e in json.loads((tmp_path / "results.json").read_text())["errors"]] == ["sd"]
