#!/usr/bin/env bash
# Install the package with its test extras and run the CPU test suite
# (GPU-marked tests skip themselves without CUDA). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
# The tests run tiny models, whose ops are too small to gain from OpenMP threads; on a
# busy machine extra threads only wait on each other.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# One pytest worker per core (pytest-xdist; at most 8), idle workers taking queued tests from
# busy ones: on 2 cores 12 minutes against 22 in one process. Each worker builds its own
# session fixtures (tiny checkpoints) in its own temporary directory.
# pytest.ini's testpaths (tests/) and the cd above fix what is collected; a run that
# collects nothing (pytest's exit code 5, e.g. a -k that matches no test) is a failure
# with a reason, not a silent pass.
rc=0
python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 8 --dist worksteal --durations=15 "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests (arguments: ${*:-none}); nothing was verified" >&2
fi
exit "$rc"
