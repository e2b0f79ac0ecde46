"""Ratios between systems from their repeats, paired by repeat.

With --interleave, repeat r runs every system once within the same minute, so the ratio of repeat r's
tokens/s is measured under one load; the spread of those ratios over the repeats says how far this
box's noise moves a ratio, which the ratio of each system's best pass (the table's "x sd") hides.
"""
from __future__ import annotations

import statistics


def paired_ratios(rates: list[float], baseline: list[float]) -> dict | None:
    """rates[r] / baseline[r] over the repeats both ran: median, low, high and n (None if none)."""
    ratios = [a / b for a, b in zip(rates, baseline) if b > 0]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios), "n": len(ratios)}


def format_paired(stats: dict | None) -> str:
    """'1.17 (1.05-1.28)': the median and range of the paired ratios; '-' without them."""
    if stats is None:
        return "-"
    if stats["n"] == 1:
        return f"{stats['median']:.2f}"
    return f"{stats['median']:.2f} ({stats['low']:.2f}-{stats['high']:.2f})"
