#!/usr/bin/env bash
# Installs saguaro-dist with its test extra (torch pinned first, so the test extra never pulls another build)
# and runs the whole test suite. This is the README's second Quickstart command.
set -euo pipefail
cd "$(dirname "$0")/.."
# Keep an existing torch (a CUDA build on GPU machines); otherwise install the pinned one: from plain PyPI on
# Linux that is the CUDA build (the README's Quickstart says how to take the CPU wheel; CI's image has it locally).
python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
set +e
# Two workers (pytest-xdist), each taking a whole test file at a time, so a file's module fixtures
# (checkpoints, engines, Ray pools) are built once: one pytest process keeps about one core busy, and
# the CI box has two. SAGUARO_TEST_WORKERS=0 runs the suite in this process. The 25 slowest tests close
# the report, to keep the suite well inside CI's time limit.
python -m pytest -q -n "${SAGUARO_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
