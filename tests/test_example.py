"""The README's first Quickstart command runs example.py: it must run, on an embedded local Ray cluster."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_example_runs_and_reports_its_speculation():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own embedded cluster, as a user's
    done = subprocess.run([sys.executable, "example.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("--- continuation ---") == 2
    assert "tok/s, acceptance" in done.stdout and "engine:" in done.stdout
    assert "JSON under a schema: {" in done.stdout
    assert "the draft built a tree in" in done.stdout  # its build time crossed gRPC from the draft actor
