"""Yielding the CPU while a thread waits for another of its process.

A waiting loop that only yields the GIL (time.sleep(0)) keeps its vCPU, and the thread it waits for,
runnable on that vCPU, runs only when the scheduler steps in; os.sched_yield gives it the vCPU at once
(and releases the GIL as it does). docs/architecture.md, "Sending outcomes before the verify".
"""
from __future__ import annotations

import os
import time

yield_cpu = getattr(os, "sched_yield", lambda: time.sleep(0))  # not every platform has sched_yield
