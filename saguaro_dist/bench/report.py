"""Terminal tables (markdown) and JSON for bench results."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from saguaro_dist.bench.departures import summary as departures_summary
from saguaro_dist.bench.paired import format_paired

log = logging.getLogger(__name__)

GRID_COLUMNS = [("setting", "setting", "{}"), ("system", "system", "{}"), ("batch", "b", "{}"),
                ("temperature", "T", "{}"), ("tokens_per_s", "tok/s", "{:.1f}"), ("cores", "cores", "{}"),
                ("tokens_per_s_per_core", "tok/s/core", "{:.1f}"), ("speedup_vs_ar", "x ar", "{:.2f}"),
                ("speedup_vs_sd", "x sd", "{:.2f}"), ("paired_vs_sd", "x sd by repeat", format_paired),
                ("speedup_vs_hf-assisted", "x hf-asst", "{:.2f}"),
                ("acceptance_rate", "accept", "{:.2f}"), ("cache_hit_rate", "hit", "{:.2f}"),
                ("verify_ms_per_round", "verify ms/rd", "{:.2f}"), ("draft_wait_ms_per_round", "wait ms/rd", "{:.2f}"),
                ("coordination_ms_per_round", "coord ms/rd", "{:.2f}"), ("greedy_same_as_ar", "=ar", "{:.2f}")]
SWEEP_COLUMNS = [("axis", "axis", "{}"), ("k", "k", "{}"), ("fan_out", "budget", "{}"), ("fan_out_kind", "kind", "{}"),
                 ("saguaro_c", "C", "{}"), ("fallback", "fallback", "{}"), ("tokens_per_s", "tok/s", "{:.1f}"),
                 ("acceptance_rate", "accept", "{:.2f}"), ("mean_accepted_length", "tok/rd/seq", "{:.2f}"),
                 ("cache_hit_rate", "hit", "{:.2f}"), ("draft_wait_ms_per_round", "wait ms/rd", "{:.2f}")]
SERVING_COLUMNS = [("setting", "setting", "{}"), ("system", "system", "{}"), ("temperature", "T", "{}"),
                   ("rate", "req/s in", "{}"), ("requests_per_s", "req/s out", "{:.2f}"),
                   ("output_tokens_per_s", "out tok/s", "{:.1f}"), ("speedup_vs_sd", "x sd", "{:.2f}"),
                   ("paired_vs_sd", "x sd by repeat", format_paired), ("ttft_ms_p50", "TTFT p50 ms", "{:.1f}"),
                   ("ttft_ms_p99", "TTFT p99 ms", "{:.1f}"), ("tpot_ms_p50", "TPOT p50 ms", "{:.2f}"),
                   ("tpot_ms_p99", "TPOT p99 ms", "{:.2f}"), ("itl_ms_p50", "ITL p50 ms", "{:.2f}"),
                   ("itl_ms_p99", "ITL p99 ms", "{:.2f}"), ("e2e_ms_p50", "E2E p50 ms", "{:.0f}"),
                   ("e2e_ms_p99", "E2E p99 ms", "{:.0f}"), ("acceptance_rate", "accept", "{:.2f}"),
                   ("cache_hit_rate", "hit", "{:.2f}"), ("greedy_same_as_ar", "=ar", "{:.2f}"),
                   ("failed_requests", "failed", "{:g}")]
TABLES = {"grid": ("cells", GRID_COLUMNS), "sweep": ("points", SWEEP_COLUMNS), "serving": ("cells", SERVING_COLUMNS)}


def fmt(value, spec) -> str:
    """spec: a format string, or a function of the value (which then also formats None)."""
    if callable(spec):
        return spec(value)
    return "-" if value is None else spec.format(value)


def markdown_table(rows: list[dict], columns) -> str:
    head = "| " + " | ".join(title for _, title, _ in columns) + " |"
    sep = "|" + "---|" * len(columns)
    body = ["| " + " | ".join(fmt(r.get(key), spec) for key, _, spec in columns) + " |" for r in rows]
    return "\n".join([head, sep] + body)


def theorem7_lines(rows: list[dict]) -> list[str]:
    """One line per SSD run: the prediction, its inputs and the measurement next to it."""
    lines = []
    for r in rows:
        t = r.get("theorem7")
        if not t:
            continue
        label = f"{r.get('setting', '')}/{r['system']} b={r['batch']} T={r['temperature']}"
        if "axis" in r:
            label += f" [{r['axis']}={_axis_value(r)}]"
        lines.append(f"Theorem 7 {label}: predicted {t['predicted_tokens_per_s']:.1f} tok/s decoding "
                     f"(tokens/round {t['tokens_per_round']:.2f}{_by_kind(t)}, p {t['p_hit']:.2f}, "
                     f"verify {1e3 * t['verify_s']:.2f} ms, "
                     f"T_p {_verifies(t['tree_s'], t)}, T_b {_verifies(t['backup_s'], t)})"
                     f"{_with_prefill(t)}, measured "
                     f"{t['measured_tokens_per_s']:.1f} tok/s = {100 * t['measured_over_predicted']:.0f}% of predicted; "
                     f"draft alone: T_p {_verifies(t['tree_alone_s'], t)}, "
                     f"predicted {t['predicted_alone_tokens_per_s']:.1f} tok/s" + _best_case(t) + _cohorts(t) + _fast_rounds(t))
    return lines


def _verifies(seconds: float, t: dict) -> str:
    """Seconds in verifies (T_p, T_b); "-" where the run timed no verify (its division by zero ended the report)."""
    return f"{seconds / t['verify_s']:.2f}" if t["verify_s"] else "-"


def _with_prefill(t: dict) -> str:
    """The run's prediction: its prefills' own seconds added (older results: none)."""
    run = t.get("predicted_run_tokens_per_s")
    return f", {run:.1f} tok/s with the run's {t['prefill_s']:.3f} s of prefill" if run is not None else ""


def _by_kind(t: dict) -> str:
    """Tokens per round of either kind, where the run had both (older results: no split)."""
    hit, miss = t.get("tokens_per_hit_round"), t.get("tokens_per_miss_round")
    return f" [{hit:.2f} without a wait, {miss:.2f} waiting for a draft]" if hit is not None and miss is not None else ""


def _cohorts(t: dict) -> str:
    """The share of rounds run as two cohorts, which Theorem 7 does not model (it counts them as SD's)."""
    share = t.get("cohort_share") or 0.0
    return f"; {100 * share:.0f}% of rounds two cohorts (Theorem 7 counts them as whole SD rounds)" if share else ""


def _fast_rounds(t: dict) -> str:
    """The share of rounds run on n-gram proposals alone, mixed into the prediction at one verify each."""
    share = t.get("fast_share") or 0.0
    return (f"; {100 * share:.0f}% of rounds n-gram proposals alone ({t['tokens_per_fast_round']:.2f} tokens a round, "
            "one verify each)") if share else ""


def round_mix(engine: dict) -> str:
    """How an SSD cell's rounds ran, from its engine counters: with trees, as SD's (drafted just in time),
    or on n-gram proposals alone; the tree gate's choice, and so where a gap between two engines lies."""
    rounds = engine.get("rounds") or 0
    if not rounds:
        return "no rounds"
    jit, fast, lookup = (engine.get(k, 0) for k in ("just_in_time_rounds", "fast_rounds", "lookup_rounds"))
    return (f"trees {(rounds - jit - fast - lookup) / rounds:.0%}, SD's {jit / rounds:.0%}, n-gram {fast / rounds:.0%}, "
            f"rounds whose rows all took n-gram proposals {lookup / rounds:.0%}")


def _best_case(t: dict) -> str:
    """Theorem 7's best case (every round the cheaper kind) over the measured sd of the same cell."""
    if t.get("best_case_vs_sd") is None:
        return ""
    return f"; best case: {t['best_case_tokens_per_s']:.1f} tok/s = {t['best_case_vs_sd']:.2f} x sd"


def _axis_value(r: dict):
    return r["fan_out"] if r["axis"] == "fan_out" else r[r["axis"]]


def placement_lines(results: dict) -> list[str]:
    return [f"placement {key}: {p['where']} (cores counted: {p['cores']})" for key, p in results["placements"].items()]


def render(results: dict) -> str:
    """The full terminal report of a grid, sweep or serving run."""
    host = results["host"]
    lines = [f"pair: target {results['pair']['target']}, draft {results['pair']['draft']}",
             f"prompts: {results['prompts']}", f"host: {host['cpu_count']} CPUs, load average {host['load_average']}"]
    lines += [f"setting {k}: {v}" for k, v in results["settings"].items()] + placement_lines(results)
    if results["kind"] == "serving":
        serving = results["serving"]
        slots = serving["max_batch_size"]
        running = f"at most {slots} running (max_batch_size)" if slots else f"batched by the server at {serving['url']}"
        lines.append(f"serving: {serving['num_requests']} requests a stream, {running}, arriving as a Poisson stream "
                     "at each rate (inf: all at once); medians over repeats (failed: their sum)")
    rows_key, columns = TABLES[results["kind"]]
    rows = results[rows_key]
    table = markdown_table(rows, columns)
    greedy = departures_summary(rows)
    failed = error_lines(rows)
    return "\n".join(lines + ["", table, ""] + (failed + [""] if failed else []) + ([greedy, ""] if greedy else [])
                     + theorem7_lines(rows))


def error_lines(rows: list[dict]) -> list[str]:
    """One line per cell (or sweep point) whose system failed: the table shows its figures as '-'."""
    lines = []
    for r in rows:
        if not r.get("error"):
            continue
        where = f"b={r['batch']}" if "batch" in r else f"rate={r['rate']}"  # a serving cell's is its stream's rate
        label = f"{r.get('setting', '')}/{r['system']} {where} T={r['temperature']}"
        if "axis" in r:
            label += f" [{r['axis']}={_axis_value(r)}]"
        lines.append(f"FAILED {label}: {r['error']}")
    return lines


def write_json(results: dict, path: Path) -> Path:
    """Strict JSON: a NaN or inf figure is written as null (logged by where it was); json.dumps wrote the
    literals NaN / Infinity, which no strict parser (jq, JavaScript, Go) reads back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    bad: list[str] = []
    path.write_text(json.dumps(finite(results, "", bad), indent=1, sort_keys=False, allow_nan=False))
    if bad:
        log.warning("bench JSON: %d non-finite figure(s) written as null: %s", len(bad), ", ".join(bad[:10]))
    return path


def finite(value, where: str, bad: list[str]):
    """`value` with every non-finite float replaced by None, its place appended to `bad`."""
    if isinstance(value, float) and not math.isfinite(value):
        bad.append(where or "(top)")
        return None
    if isinstance(value, dict):
        return {k: finite(v, f"{where}.{k}", bad) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v, f"{where}[{i}]", bad) for i, v in enumerate(value)]
    return value
