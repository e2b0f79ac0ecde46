"""What the one-host draft's child process imports: every engine pays its start-up (the product's, and each
process/split engine of this suite), so it loads what the draft needs and not the target's round loop."""
from __future__ import annotations

import subprocess
import sys
import textwrap

# The target's side: the engine, its round loops, the split backend (the child runs none of them)
NOT_IN_CHILD = ("saguaro_dist.engine.engine", "saguaro_dist.engine.sd_loop", "saguaro_dist.engine.ssd_loop",
                "saguaro_dist.engine.split_draft")


def test_the_draft_child_does_not_import_the_target_round_loop():
    # The imports of draft_process.main, in a fresh interpreter as the child is (python -m ...draft_process)
    code = textwrap.dedent(f"""
        import sys
        import saguaro_dist.engine.draft_process
        from saguaro_dist.engine.build import build_draft_worker
        from saguaro_dist.engine.heap import freeze_startup_heap
        print(sorted(m for m in {NOT_IN_CHILD!r} if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
