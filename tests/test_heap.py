"""The startup heap frozen out of full collections (engine/heap.py), in a process of its own: freezing is for
the process's life, and this one's is pytest's."""
import subprocess
import sys

PROBE = """
import gc
import saguaro_dist.engine.heap as heap
import torch, transformers  # a model host's imports: the bulk of its long-lived objects
frozen = heap.freeze_startup_heap()
print(frozen, gc.get_freeze_count(), len(gc.get_objects()))
"""


def test_freezing_leaves_a_full_collection_little_to_walk():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    frozen, counted, tracked = map(int, out.stdout.split())
    assert frozen == counted > 10_000
    assert tracked < frozen // 100  # what a full collection still walks
