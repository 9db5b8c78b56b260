#!/usr/bin/env bash
# Install the package with its test extras and run the CPU test suite
# (GPU-marked tests skip themselves without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
python -m pytest -q -p no:cacheprovider "$@"
