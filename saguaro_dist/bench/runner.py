"""Run the grid (systems x settings x temperatures x batch sizes) and the SSD sweep; results are plain dicts."""
from __future__ import annotations

import dataclasses
import logging
import os
import platform
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from saguaro_dist.bench.config import (OURS, SETTINGS, SSD_SYSTEMS, SYSTEMS, BenchConfig, SweepConfig, candidate_placements,
                                       placement)
from saguaro_dist.bench.departures import judge_cells
from saguaro_dist.bench.paired import paired_ratios
from saguaro_dist.bench.prompts import bench_prompts, resolve_pair
from saguaro_dist.bench.systems import Measurement, Repeats, combine, make_system
from saguaro_dist.bench.theory import calibrate_draft, predict_from_run

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1


def run_grid(cfg: BenchConfig, progress: bool = True) -> dict:
    """Every system under every setting over the grid; SSD cells carry their Theorem-7 prediction."""
    target, draft = resolve_pair(cfg.target, cfg.draft)
    prompts, source = bench_prompts(target, cfg.prompt_count, cfg.prompt_len, cfg.seed, vocab_size(target))
    total = len(cfg.settings) * len(cfg.systems) * len(cfg.temperatures) * len(cfg.batch_sizes)
    cells = []
    with tqdm(total=total, desc="saguaro bench", unit="cell", disable=not progress) as bar:
        for setting in cfg.settings:
            if cfg.interleave:
                cells += run_interleaved(cfg, setting, target, draft, prompts, bar)
                continue
            for system in cfg.systems:
                cells += run_system(cfg, system, setting, target, draft, prompts, bar)
    calibs = calibrate_cells(cfg, cells, target, draft, prompts)
    judge_cells(cells, prompts, target, cfg.dtype, cfg.device)
    annotate(cells, calibs)
    return {"schema": SCHEMA_VERSION, "kind": "grid", "config": cfg.to_dict(), **context(target, draft, source, cfg),
            "calibration": [{"batch": b, "temperature": t, **c} for (b, t), c in calibs.items()], "cells": cells,
            "errors": cell_errors(cells)}


@dataclass(frozen=True)
class Failed:
    """A system's pass that raised: its cell reports the error in place of figures, and the grid goes on
    (one system's crash used to lose every cell measured before it, and every one after)."""
    error: str

    @classmethod
    def of(cls, err: BaseException, where: str) -> "Failed":
        log.error("bench: %s failed: %s: %s", where, type(err).__name__, err, exc_info=err)
        return cls(f"{where}: {type(err).__name__}: {err}")


def cell_errors(cells: list[dict]) -> list[dict]:
    """The cells whose system failed, and why (empty when every cell was measured)."""
    return [{k: c[k] for k in ("system", "setting", "batch", "temperature", "error")} for c in cells if c.get("error")]


def run_system(cfg: BenchConfig, system: str, setting: str, target: str, draft: str, prompts, bar) -> list[dict]:
    """A fresh engine per temperature (and candidate placement): the online estimates (acceptance, r,
    b*) never carry over between temperatures; within one the batch sizes run in order on one engine."""
    places, cells = candidate_placements(system, setting, cfg.cores), []
    for temperature in cfg.temperatures:
        runs = [measure_batches(cfg, system, place, target, draft, prompts, temperature, bar) for place in places]
        for j, b in enumerate(cfg.batch_sizes):
            cells.append(fastest_cell(system, setting, places, [run[j] for run in runs], b, temperature))
            log_cell(cells[-1])
            bar.update()
    return cells


def measure_batches(cfg: BenchConfig, system: str, place, target: str, draft: str, prompts, temperature: float,
                    bar) -> list[Repeats | Failed]:
    """One engine under `place`, measured at every batch size in turn. A failure (loading, a pass) is that
    batch size's result, and the later ones' (the engine may be broken): the batch sizes before it keep theirs."""
    label = f"{system} ({place.target_threads} thread(s)) T={temperature}"
    runner, results, stage = make_system(system, target, draft, cfg.engine_kwargs()), [], "loading"
    bar.set_postfix_str(f"{label}: loading")
    try:
        runner.open(place)
        for b in cfg.batch_sizes:
            stage = f"b={b}"
            bar.set_postfix_str(f"{label} {stage}")
            results.append(measure(runner, prompts, b, temperature, cfg))
    except Exception as err:  # noqa: BLE001 - reported in the cells; the other systems' cells go on
        results += [Failed.of(err, f"{label} {stage}")] * (len(cfg.batch_sizes) - len(results))
    finally:
        close_quietly(runner, label)
    return results


def close_quietly(runner, label: str) -> None:
    """close(), a failure logged: it must not take the cells already measured with it."""
    try:
        runner.close()
    except Exception:  # noqa: BLE001
        log.exception("bench: closing %s failed", label)


def fastest_cell(system: str, setting: str, places: list, timed: list[Repeats | Failed], batch: int,
                 temperature: float) -> dict:
    """The cell of the fastest candidate placement that ran; with several, each one's tok/s under "candidates"
    (None, and its error, for one that failed). With none that ran, an error cell (error_cell)."""
    ran = [j for j in range(len(places)) if isinstance(timed[j], Repeats)]
    if ran:
        i = max(ran, key=lambda j: timed[j].best.tokens_per_s)
        cell = cell_record(system, setting, places[i], batch, temperature, timed[i])
    else:
        cell = error_cell(system, setting, places[0], batch, temperature, "; ".join(t.error for t in timed))
    if len(places) > 1:
        cell["candidates"] = [{"target_threads": p.target_threads, "tokens_per_s": t.best.tokens_per_s}
                              if isinstance(t, Repeats) else
                              {"target_threads": p.target_threads, "tokens_per_s": None, "error": t.error}
                              for p, t in zip(places, timed)]
    return cell


def run_interleaved(cfg: BenchConfig, setting: str, target: str, draft: str, prompts, bar) -> list[dict]:
    """run_system for every system at once: per temperature all engines are open (an idle one sleeps)
    and each repeat runs every system once, the order rotating, so the box's drift (20% from minute
    to minute here) falls on all of them alike instead of on whichever ran later. An engine that fails
    (loading, a pass) reports it in its cells from there on; the others go on."""
    places, cells = {s: candidate_placements(s, setting, cfg.cores) for s in cfg.systems}, []
    for temperature in cfg.temperatures:
        runners = {(s, i): make_system(s, target, draft, cfg.engine_kwargs()) for s in cfg.systems
                   for i in range(len(places[s]))}
        broken: dict[tuple, Failed] = {}  # runner -> its failure, for every batch size from it on
        try:
            for (system, i), runner in runners.items():
                bar.set_postfix_str(f"{setting}/{system}: loading")
                try:
                    runner.open(places[system][i])
                except Exception as err:  # noqa: BLE001 - reported in the cells
                    broken[(system, i)] = Failed.of(err, f"{system} ({places[system][i].target_threads} thread(s)) "
                                                         f"T={temperature}, loading")
            for b in cfg.batch_sizes:
                bar.set_postfix_str(f"{setting} b={b} T={temperature}, interleaved")
                live = {key: runner for key, runner in runners.items() if key not in broken}
                timed = {**measure_interleaved(live, prompts, b, temperature, cfg, keep_going=True), **broken}
                broken.update({key: t for key, t in timed.items() if isinstance(t, Failed)})
                cells += [fastest_cell(s, setting, places[s], [timed[(s, i)] for i in range(len(places[s]))], b, temperature)
                          for s in cfg.systems]
                for cell in cells[-len(cfg.systems):]:
                    log_cell(cell)
                bar.update(len(cfg.systems))
        finally:
            for (system, _), runner in runners.items():
                close_quietly(runner, system)
    return cells


def measure(runner, prompts, batch: int, temperature: float, cfg: BenchConfig) -> Repeats:
    """A warm-up (warm_up), then `repeats` timed passes over the prompts, `batch` at a time."""
    return measure_interleaved({"one": runner}, prompts, batch, temperature, cfg)["one"]


def measure_interleaved(runners: dict, prompts, batch: int, temperature: float, cfg: BenchConfig,
                        keep_going: bool = False) -> dict[str, Repeats | Failed]:
    """measure() for several systems: warm-ups, then repeat r runs them in the order rotated by r.
    keep_going: a system that raises is left out of the passes after it and its result is a Failed (the
    others' passes go on); else the error propagates."""
    names, failed = list(runners), {}

    def attempt(name, run, *args, **kwargs):
        if name in failed:
            return None
        try:
            return run(runners[name], prompts, batch, temperature, cfg, *args, **kwargs)
        except Exception as err:
            if not keep_going:
                raise
            system = name[0] if isinstance(name, tuple) else name  # run_interleaved's keys: (system, placement)
            failed[name] = Failed.of(err, f"{system} b={batch} T={temperature}")
            return None

    for name in names:
        attempt(name, warm_up)
    runs: dict[str, list[Measurement]] = {n: [] for n in names}
    for r in range(cfg.repeats):
        for name in rotated(names, r):
            m = attempt(name, run_batches, repeat=r)
            if m is not None:
                runs[name].append(m)
    return {n: failed[n] if n in failed else Repeats.of(runs[n]) for n in names}


def rotated(names: list, r: int) -> list:
    """The names in the order repeat r runs them: rotated by r, so no system always runs first or last."""
    return names[r % len(names):] + names[:r % len(names)] if names else []


GPU_WARM_UP_PASSES = 2


def warm_up(runner, prompts, batch: int, temperature: float, cfg: BenchConfig) -> None:
    """Untimed. On a GPU two whole passes: CUDA graphs are captured per shape as the rounds first meet them
    (a short call left most shapes to the first timed pass: session 28, an H200, ssd-thread b = 8 ran 765
    tok/s in it, then 2973), and the pass after the captures is still slow without any (session 30, an
    H200: sd b = 8 126, 585, 2731 tok/s in passes 0-2, graphs captured in pass 0 only; ssd 236, 1671,
    2827). Elsewhere one whole pass: SSD chooses its rounds by measurement per batch size (spec/tree_gate.py,
    spec/cohorts.py) and a timed pass at b = 8 is only ~40 rounds, of which its first tries of each kind
    would be most (session 40: T = 0.7, b = 4 / 8 ssd / sd 0.92 / 1.00 in the bench, 1.03-1.08 after
    ~100 rounds in-process)."""
    for _ in range(GPU_WARM_UP_PASSES if cfg.device.startswith("cuda") else 1):
        run_batches(runner, prompts, batch, temperature, cfg)


def run_batches(runner, prompts, batch: int, temperature: float, cfg: BenchConfig, repeat: int = 0) -> Measurement:
    """The prompts in consecutive batches of `batch` (a remainder short of a batch is left out); prompt i of
    repeat r is seeded seed + r x len(prompts) + i whatever the batch size or system (transformers' batched generate
    draws every row from one generator, seeded by the batch's first prompt's seed). At T > 0 each repeat
    then samples other text: with one seed for all, every repeat replayed one sample of ~1000 tokens, whose
    luck (acceptance moves ~3% between samples) then sat in every pass of a system alike."""
    starts = range(0, len(prompts) - batch + 1, batch)
    first = cfg.seed + repeat * len(prompts)
    return combine([runner.run(prompts[i:i + batch], temperature, cfg.max_new_tokens, first + i) for i in starts])


def log_cell(cell: dict) -> None:
    """Each cell as it is measured (a long run cut short still tells what it saw)."""
    if cell.get("error"):
        log.error("cell %s/%s b=%d T=%g: FAILED (%s)", cell["setting"], cell["system"], cell["batch"], cell["temperature"],
                  cell["error"])
        return
    per_round = {k: round(v, 2) for k, v in cell.items() if k.endswith("_ms_per_round")}
    log.info("cell %s/%s b=%d T=%g: %.1f tok/s, acceptance %s, hit rate %s, %s", cell["setting"], cell["system"],
             cell["batch"], cell["temperature"], cell["tokens_per_s"], cell["acceptance_rate"], cell["cache_hit_rate"],
             per_round)


def cell_record(system: str, setting: str, place, batch: int, temperature: float, passes: Repeats) -> dict:
    """The cell's figures from its fastest pass; every pass's tokens/s too (repeat_tokens_per_s)."""
    m = passes.best
    rounds = m.engine.get("rounds", 0)
    per_round_ms = {f"{k[:-2]}_ms_per_round": 1e3 * m.engine[k] / rounds if rounds else None for k in round_timings(system)}
    lookups = m.cache_hits + m.cache_misses
    return {"system": system, "setting": setting, "batch": batch, "temperature": temperature,
            "tokens": m.tokens, "seconds": m.seconds, "tokens_per_s": m.tokens_per_s, "cores": place.cores,
            "tokens_per_s_per_core": m.tokens_per_s / place.cores, "placement": place.to_dict(),
            "acceptance_rate": m.accepted / m.drafted if m.drafted else None,
            "mean_accepted_length": (m.accepted + m.seq_rounds) / m.seq_rounds if m.seq_rounds else None,
            "cache_hit_rate": m.cache_hits / lookups if lookups else None, "fallbacks": m.fallbacks,
            "prompts": len(m.outputs), "repeat_tokens_per_s": passes.tokens_per_s,
            "engine": m.engine, **per_round_ms, "error": None, "outputs": m.outputs, "_measurement": m}


def round_timings(system: str) -> tuple[str, ...]:
    """The engine timings a cell reports per round (as <name>_ms_per_round): none for transformers' (no
    rounds to count), the step alone for ar (no split), else the split."""
    if system.startswith("hf"):
        return ()
    return ("step_s",) if system == "ar" else ("verify_s", "draft_wait_s", "coordination_s", "step_s")


def error_cell(system: str, setting: str, place, batch: int, temperature: float, error: str) -> dict:
    """A cell whose system failed: cell_record's fields, no figures (None), and the error."""
    return {"system": system, "setting": setting, "batch": batch, "temperature": temperature,
            "tokens": None, "seconds": None, "tokens_per_s": None, "cores": place.cores,
            "tokens_per_s_per_core": None, "placement": place.to_dict(), "acceptance_rate": None,
            "mean_accepted_length": None, "cache_hit_rate": None, "fallbacks": {}, "prompts": 0,
            "repeat_tokens_per_s": [], "engine": {}, **{f"{k[:-2]}_ms_per_round": None for k in round_timings(system)},
            "error": error, "outputs": [], "_measurement": None}


def calibrate_cells(cfg: BenchConfig, cells: list[dict], target: str, draft: str, prompts) -> dict:
    """Draft tree-build / just-in-time latencies per (batch, temperature) that an SSD cell ran at."""
    keys = sorted({(c["batch"], c["temperature"]) for c in cells if c["system"] in SSD_SYSTEMS and not c.get("error")})
    calibs = {}
    for b, t in tqdm(keys, desc="draft calibration", unit="cell", disable=not keys):
        try:
            calibs[(b, t)] = calibrate_draft(target, draft, cfg.engine_kwargs(), prompts[:b], t)
        except Exception as err:  # noqa: BLE001 - those cells go without Theorem 7; the measurements stay
            Failed.of(err, f"draft calibration b={b} T={t}")
    return calibs


def annotate(cells: list[dict], calibs: dict) -> None:
    """Speedups vs our ar / sd of the same setting and cell, greedy identity vs our ar, Theorem 7."""
    index = {(c["system"], c["setting"], c["batch"], c["temperature"]): c for c in cells}
    for c in cells:
        key = (c["setting"], c["batch"], c["temperature"])
        for base in ("ar", "sd", "hf-assisted"):
            ref = index.get((base,) + key)
            measured = c["tokens_per_s"] is not None and ref and ref["tokens_per_s"]  # neither failed, nor 0 tok/s
            c[f"speedup_vs_{base}"] = c["tokens_per_s"] / ref["tokens_per_s"] if measured else None
            c[f"paired_vs_{base}"] = paired_ratios(c["repeat_tokens_per_s"], ref["repeat_tokens_per_s"]) if ref else None
        ar = index.get(("ar",) + key)
        c["greedy_same_as_ar"] = (sum(a == b for a, b in zip(c["outputs"], ar["outputs"])) / len(ar["outputs"])
                                  if ar and c["temperature"] == 0 and c["outputs"] and ar["outputs"] else None)
        m = c.pop("_measurement")
        calib = calibs.get((c["batch"], c["temperature"]))
        c["theorem7"] = predict_from_run(m, c["batch"], calib) if m and calib and c["system"] in SSD_SYSTEMS else None
        sd = index.get(("sd",) + key)
        if c["theorem7"] and sd and sd["tokens_per_s"]:
            c["theorem7"]["best_case_vs_sd"] = c["theorem7"]["best_case_tokens_per_s"] / sd["tokens_per_s"]
    for c in cells:
        c.pop("outputs")


def host_info() -> dict:
    """This machine, as a run's JSON records it (the load average: how busy the box was)."""
    return {"cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()), "python": platform.python_version(),
            "torch": torch.__version__, "machine": platform.machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def context(target: str, draft: str, source: str, cfg: BenchConfig) -> dict:
    return {"pair": {"target": target, "draft": draft}, "prompts": source, "host": host_info(),
            "systems": {s: SYSTEMS[s] for s in cfg.systems if s in SYSTEMS},
            "settings": {s: SETTINGS[s] for s in cfg.settings},
            "placements": {f"{st}/{sy}" + (f" [{p.target_threads} thread(s)]" if len(places) > 1 else ""): p.to_dict()
                           for st in cfg.settings for sy in cfg.systems
                           for places in [candidate_placements(sy, st, cfg.cores)] for p in places}}


def vocab_size(path: str) -> int:
    """The target's vocabulary size, from its config.json: a local folder's, or a Hugging Face id's (fetched)."""
    from saguaro_dist.model.hf_config import read_config_json
    from saguaro_dist.model.loader import resolve_model_dir
    return int(read_config_json(resolve_model_dir(path, weights=False))["vocab_size"])


def run_sweep(sweep: SweepConfig, progress: bool = True) -> dict:
    """One SSD run per sweep point (one knob changed from the base), each with its Theorem-7 prediction."""
    cfg = sweep.base
    point_cfgs = sweep_point_configs(sweep)
    target, draft = resolve_pair(cfg.target, cfg.draft)
    # (before session 23: one prompt at b = 1)
    prompts, source = bench_prompts(target, sweep.prompt_count, cfg.prompt_len, cfg.seed, vocab_size(target))
    place = placement(sweep.system, sweep.setting, cfg.cores)
    points = []
    for axis, overrides, point_cfg in tqdm(point_cfgs, desc="saguaro bench sweep", unit="run", disable=not progress):
        try:
            points.append(sweep_point(point_cfg, sweep, axis, overrides, place, target, draft, prompts))
        except Exception as err:  # noqa: BLE001 - the point reports it; the other points go on
            failed = Failed.of(err, f"sweep point {axis} {overrides}")
            cell = error_cell(sweep.system, sweep.setting, place, sweep.batch_size, sweep.temperature, failed.error)
            cell.pop("_measurement"), cell.pop("outputs")
            points.append({**point_fields(point_cfg, axis, overrides), **cell, "calibration": None, "theorem7": None})
    return {"schema": SCHEMA_VERSION, "kind": "sweep", "config": cfg.to_dict(), "sweep": sweep.to_dict(),
            **context(target, draft, source, dataclasses.replace(cfg, systems=(sweep.system,), settings=(sweep.setting,))),
            "points": points, "errors": [{"axis": p["axis"], "overrides": p["overrides"], "error": p["error"]}
                                         for p in points if p.get("error")]}


def sweep_point_configs(sweep: SweepConfig) -> list[tuple[str, dict, BenchConfig]]:
    """Every point's config, built before any run: a bad sweep value (--sweep-ks 2,0) fails at once, not after
    the points before it ran with nothing written."""
    built = []
    for axis, overrides in sweep.points():
        try:
            built.append((axis, overrides, dataclasses.replace(sweep.base, **overrides,
                                                               batch_sizes=(sweep.batch_size,))))
        except ValueError as err:
            key = offending_override(sweep.base, overrides) or axis
            raise ValueError(f"sweep point {key} = {overrides[key]!r}: {err}") from None
    return built


def offending_override(base: BenchConfig, overrides: dict) -> str | None:
    """The first override the base refuses alone: a fan-out point's bad kind (--sweep-kinds bogus) was reported
    under its budget, "fan_out = 6: fan_out_kind must be ...". None where only their combination fails."""
    for key, value in overrides.items():
        try:
            dataclasses.replace(base, **{key: value})
        except ValueError:
            return key
    return None


def point_fields(cfg: BenchConfig, axis: str, overrides: dict) -> dict:
    """What a sweep point varies: its axis, its overrides and the knobs' values there."""
    return {"axis": axis, "overrides": overrides, "k": cfg.k, "fan_out": cfg.fan_out, "fan_out_kind": cfg.fan_out_kind,
            "saguaro_c": cfg.saguaro_c, "fallback": cfg.fallback}


def sweep_point(cfg: BenchConfig, sweep: SweepConfig, axis: str, overrides: dict, place, target, draft, prompts) -> dict:
    runner = make_system(sweep.system, target, draft, cfg.engine_kwargs())
    runner.open(place)
    try:
        timed = measure(runner, prompts, sweep.batch_size, sweep.temperature, cfg)
    finally:
        runner.close()
    cell = cell_record(sweep.system, sweep.setting, place, sweep.batch_size, sweep.temperature, timed)
    # The draft alone at the sweep's batch size (the point's prompts run batch_size at a time).
    calib = calibrate_draft(target, draft, cfg.engine_kwargs(), prompts[:sweep.batch_size], sweep.temperature)
    cell.pop("_measurement"), cell.pop("outputs")
    return {**point_fields(cfg, axis, overrides), **cell, "calibration": calib,
            "theorem7": predict_from_run(timed.best, sweep.batch_size, calib)}


__all__ = ["run_grid", "run_sweep", "SCHEMA_VERSION", "OURS"]
