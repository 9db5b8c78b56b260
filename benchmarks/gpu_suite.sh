#!/usr/bin/env bash
# Everything GPU-side in one call (device time is scarce): install, GPU tests,
# kernel + end-to-end benchmarks; prints a short table last.
#   bash benchmarks/gpu_suite.sh [quick|full]
# Outputs land in ${OUT:-/tmp/gpu_suite}.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-full}"
OUT="${OUT:-/tmp/gpu_suite}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

echo "== install"
VLLM_PARITY_SKIP_CSRC="${VLLM_PARITY_SKIP_CSRC:-1}" python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "install failed"; tail -20 "$OUT/install.log"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== GPU tests"
python -m pytest -q -m gpu -p no:cacheprovider tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
TESTS_LINE=$(tail -1 "$OUT/gpu_tests.log")

echo "== throughput"
if [ "$MODE" = "quick" ]; then
  python benchmarks/throughput.py --config benchmarks/configs/qwen3-0.6b.json --num-prompts 64 --input-len 256 --output-len 64 \
    --numerics "${NUMERICS:-fast}" --json-out "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" | tail -12
else
  python benchmarks/throughput.py --config benchmarks/configs/qwen3-8b.json --num-prompts 256 --input-len 512 --output-len 256 \
    --numerics "${NUMERICS:-fast}" ${HF_FLAG:---hf} --json-out "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" | tail -12
fi

echo
echo "================ summary ================"
echo "gpu tests: $TESTS_LINE"
grep -E "^(floor|engine|fast|invariant|transformers)" "$OUT/throughput.log" || true
