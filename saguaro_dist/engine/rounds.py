"""One round loop per mode. The Engine drives: admit -> prepare -> verify, every step.

- admit(seqs):   prefill new sequences; returns each one's first token.
- prepare(seqs): give every sequence the speculation it verifies this round.
- verify(seqs):  one batched target pass; returns the tokens each sequence gained.

The loops: engine/draftless.py (AR, n-gram), engine/sd_loop.py (SD), engine/ssd_loop.py (SSD).
"""
from __future__ import annotations

from saguaro_dist.config import Config, Mode
from saguaro_dist.engine.draftless import ARLoop, NgramLoop
from saguaro_dist.engine.metrics import EngineMetrics
from saguaro_dist.engine.sd_loop import SDLoop
from saguaro_dist.engine.ssd_loop import SSDLoop
from saguaro_dist.engine.target import TargetScorer


def build_loop(config: Config, target: TargetScorer, draft, metrics: EngineMetrics):
    """The round loop for the configured mode."""
    loops = {
        Mode.AR: lambda: ARLoop(target, metrics),
        Mode.SD: lambda: SDLoop(target, draft, metrics, config),
        Mode.SSD: lambda: SSDLoop(target, draft, metrics, config),
        Mode.NGRAM: lambda: NgramLoop(target, metrics, config),
    }
    return loops[config.mode]()
