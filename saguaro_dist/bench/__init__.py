"""`saguaro bench`: SSD against AR, SD and Hugging Face generation on the same checkpoints.

    from saguaro_dist.bench import BenchConfig, ServingConfig, run_grid, run_serving, run_sweep
    results = run_grid(BenchConfig.preset("quick"))
    served = run_serving(ServingConfig(base=BenchConfig(systems=("sd", "ssd")), rates=(4.0, float("inf"))))

Every run records where each model ran (process, threads), tokens/s and tokens/s per core, the
speculation metrics and, for SSD, the Theorem-7 prediction from the run's own measurements; a serving
run (bench/serving.py) streams requests to our systems and reports throughput and latencies.
"""
from saguaro_dist.bench.config import PRESETS, SETTINGS, SYSTEMS, BenchConfig, SweepConfig
from saguaro_dist.bench.runner import run_grid, run_sweep
from saguaro_dist.bench.serving import ServingConfig, run_serving

__all__ = ["BenchConfig", "SweepConfig", "ServingConfig", "PRESETS", "SETTINGS", "SYSTEMS", "run_grid", "run_sweep",
           "run_serving"]
