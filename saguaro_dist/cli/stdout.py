"""The commands' standard output, once its reader went away (`| head -1`)."""
from __future__ import annotations

import os
import sys


def stdout_to_devnull() -> None:
    """Point stdout at /dev/null: the interpreter's flush at exit would print its own BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout without a file descriptor (captured, in-process)
        pass
