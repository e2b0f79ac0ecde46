"""PNG plots of bench results (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def speedup_vs_batch(results: dict, path: Path) -> Path:
    """Speedup vs batch size, one line per system, one panel per (setting, temperature): over our ar, or
    over our sd when ar did not run (`--systems sd,ssd`), or tokens/s when neither did."""
    plt = _pyplot()
    cells = results["cells"]
    key, ylabel = _speedup_axis({c["system"] for c in cells if c.get("tokens_per_s")})  # of the baselines that ran
    panels = sorted({(c["setting"], c["temperature"]) for c in cells}) or [("no", None)]  # every cell failed: one empty panel
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    batches = sorted({c["batch"] for c in cells})
    for ax, (setting, temp) in zip(axes[0], panels):
        for system in dict.fromkeys(c["system"] for c in cells):
            pts = sorted((c["batch"], c[key]) for c in cells
                         if (c["system"], c["setting"], c["temperature"]) == (system, setting, temp) and c.get(key))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system)
        if key != "tokens_per_s":
            ax.axhline(1.0, color="grey", lw=0.5)
        ax.set(title=f"{setting} setting, T={temp}", xlabel="batch size", ylabel=ylabel, xscale="log")
        if batches:
            ax.set_xticks(batches, labels=[str(b) for b in batches])
        ax.minorticks_off()  # a log axis labels its minor ticks (3 x 10^0) between the batch sizes otherwise
        _legend(ax)
    return _save(fig, plt, path)


def _legend(ax, **kwargs) -> None:
    """A legend where some line has a label (matplotlib warns of an empty one: a panel whose cells all failed)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def _speedup_axis(systems: set[str]) -> tuple[str, str]:
    """(the cells' field to plot, its axis label): over the first baseline that ran."""
    for baseline in ("ar", "sd"):
        if baseline in systems:
            return f"speedup_vs_{baseline}", f"tokens/s / ours {baseline}"
    return "tokens_per_s", "tokens/s"


def hit_rate_vs_budget(results: dict, path: Path) -> Path:
    """Cache hit rate vs fan-out budget per fan-out kind (sweep points of the fan_out axis)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    points = [p for p in results["points"] if p["axis"] == "fan_out" and p.get("cache_hit_rate") is not None]
    for kind in dict.fromkeys(p["fan_out_kind"] for p in points):
        pts = sorted((p["fan_out"], p["cache_hit_rate"]) for p in points if p["fan_out_kind"] == kind)
        ax.plot(*zip(*pts), marker="o", label=kind)
    ax.set(title=f"hit rate vs fan-out budget (T={results['sweep']['temperature']})", xlabel="fan-out budget B",
           ylabel="cache hit rate", ylim=(0, 1.05))
    _legend(ax)
    return _save(fig, plt, path)


def acceptance_hit_vs_c(results: dict, path: Path) -> Path:
    """Acceptance rate and cache hit rate vs Saguaro C (sweep points of the saguaro_c axis)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    points = sorted((p for p in results["points"] if p["axis"] == "saguaro_c"), key=lambda p: p["saguaro_c"])
    for key, marker, label in (("acceptance_rate", "o", "acceptance rate"), ("cache_hit_rate", "s", "cache hit rate")):
        pts = [(p["saguaro_c"], p[key]) for p in points if p.get(key) is not None]  # None: a failed point, no lookups
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=label)
    ax.set(title=f"Saguaro sampling (T={results['sweep']['temperature']})", xlabel="C", ylabel="rate", ylim=(0, 1.05))
    _legend(ax)
    return _save(fig, plt, path)


def serving_vs_rate(results: dict, path: Path) -> Path:
    """Output tokens/s (top) and TPOT p50 (bottom) vs the request rate, one line per system, one column per
    (setting, temperature); the rates as categories (inf, all at once, is not a point on a number line)."""
    plt = _pyplot()
    cells = results["cells"]
    rates = list(dict.fromkeys(c["rate"] for c in cells))
    panels = sorted({(c["setting"], c["temperature"]) for c in cells})
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 7), squeeze=False)
    for col, (setting, temp) in enumerate(panels):
        for row, (key, ylabel) in enumerate((("output_tokens_per_s", "output tokens/s"), ("tpot_ms_p50", "TPOT p50 (ms)"))):
            ax = axes[row][col]
            for system in dict.fromkeys(c["system"] for c in cells):
                by_rate = {c["rate"]: c[key] for c in cells if (c["system"], c["setting"], c["temperature"]) == (system, setting, temp)}
                ax.plot(range(len(rates)), [by_rate.get(r) for r in rates], marker="o", label=system)
            ax.set(title=f"{setting} setting, T={temp}", xlabel="requests/s arriving", ylabel=ylabel)
            ax.set_xticks(range(len(rates)), labels=[str(r) for r in rates])
            _legend(ax, fontsize=8)
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    if results["kind"] == "grid":
        return [speedup_vs_batch(results, out_dir / "speedup_vs_batch.png")]
    if results["kind"] == "serving":
        return [serving_vs_rate(results, out_dir / "serving_vs_rate.png")]
    return [hit_rate_vs_budget(results, out_dir / "hit_rate_vs_budget.png"),
            acceptance_hit_vs_c(results, out_dir / "acceptance_hit_vs_c.png")]
