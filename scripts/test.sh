#!/usr/bin/env bash
# Runs the test suite with the given Python (default: .venv/bin/python); MARK selects by marker (default: the fast
# suite, "not slow"; `make test-slow` passes MARK=slow). Exit code 5 (no tests collected) fails.
set -uo pipefail
PY=${1:-.venv/bin/python}
export PYTHONUNBUFFERED=1  # tests/conftest.py turns the Triton interpreter on where there is no CUDA
MARK=${MARK:-not slow}
"$PY" -m pytest -q --durations=25 -m "$MARK" tests
status=$?
if [ "$status" -eq 5 ]; then echo "no tests were collected: treating as failure" >&2; exit 1; fi
exit "$status"
