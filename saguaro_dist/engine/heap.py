"""The startup heap, frozen out of the garbage collector's full passes in the processes that host a model."""
from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now to the permanent generation; returns how many are frozen.

    Why: a process holding an engine or a draft tracks ~300k long-lived objects (imports, the model's modules,
    the tokenizer), and a full collection walks them all: ~120 ms with the demo pair loaded (session 73), a stall
    of every stream the process serves, for state that never becomes garbage. Frozen objects are still freed by
    reference counting; only cycles among them are never collected (a bounded, one-time leak). Called once its
    model is loaded by each process that exists to host one (the draft's child process, the Ray target and draft
    actors; Ray Serve's replicas freeze themselves: RAY_SERVE_FREEZE_GC_ON_STARTUP), not by an in-process LLM,
    whose process is its caller's (README, "Tail latency")."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d startup objects out of the garbage collector's full passes", frozen)
    return frozen
