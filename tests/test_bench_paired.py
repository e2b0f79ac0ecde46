"""Ratios between benched systems paired by repeat (bench/paired.py)."""
from __future__ import annotations

from saguaro_dist.bench.paired import format_paired, paired_ratios
from saguaro_dist.bench.report import GRID_COLUMNS, markdown_table


def test_paired_ratios_pair_repeat_r_with_repeat_r():
    # The best passes (12 vs 10: 1.2x) hide that the two systems swapped places in repeat 2.
    stats = paired_ratios([12.0, 6.0, 9.0], [10.0, 8.0, 9.0])
    assert stats == {"median": 1.0, "low": 0.75, "high": 1.2, "n": 3}


def test_paired_ratios_skip_empty_baselines_and_need_one_pair():
    assert paired_ratios([1.0, 2.0], [0.0, 1.0]) == {"median": 2.0, "low": 2.0, "high": 2.0, "n": 1}
    assert paired_ratios([], []) is None
    assert paired_ratios([1.0], [0.0]) is None


def test_format_paired_shows_the_range_only_with_several_repeats():
    assert format_paired(None) == "-"
    assert format_paired({"median": 1.234, "low": 1.234, "high": 1.234, "n": 1}) == "1.23"
    assert format_paired({"median": 1.17, "low": 1.049, "high": 1.28, "n": 5}) == "1.17 (1.05-1.28)"


def test_the_grid_table_has_the_by_repeat_column():
    row = {"system": "ssd", "speedup_vs_sd": 1.2, "paired_vs_sd": {"median": 1.1, "low": 0.9, "high": 1.3, "n": 3}}
    table = markdown_table([row], GRID_COLUMNS)
    assert "x sd by repeat" in table and "| 1.20 | 1.10 (0.90-1.30) |" in table
