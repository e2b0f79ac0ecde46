"""`saguaro bench`: SSD against AR, SD and Hugging Face generation on the same checkpoints.

    from saguaro_dist.bench import BenchConfig, run_grid, run_sweep
    results = run_grid(BenchConfig.preset("quick"))

Every run records where each model ran (process, threads), tokens/s and tokens/s per core, the
speculation metrics and, for SSD, the Theorem-7 prediction from the run's own measurements.
"""
from saguaro_dist.bench.config import PRESETS, SETTINGS, SYSTEMS, BenchConfig, SweepConfig
from saguaro_dist.bench.runner import run_grid, run_sweep

__all__ = ["BenchConfig", "SweepConfig", "PRESETS", "SETTINGS", "SYSTEMS", "run_grid", "run_sweep"]
