#!/usr/bin/env bash
# Everything GPU-side in one call (device time is scarce): install, GPU tests,
# kernel benchmarks, the parity battery and end-to-end throughput; prints a
# short summary last. Select parts with STEPS (default: all but csrc, nosplit, overhead,
# kernels, rlstep, rlray, moe, fp8, serve, digest, wsync and tptree; `gate` is the real-dims parity gate that
# every numerics, kernel, cache or model change runs before it lands; `gdn` the Gated DeltaNet
# tests, per-layer cost and hybrid throughput (GDN_PARTS=breakdown adds the per-kernel times of
# both recurrences, GDN_PARTS=backward the training backward against the fused kernels,
# GDN_PARTS=sweep the forward kernels' tunables, benchmarks/kernels/gdn_forward_sweep.py);
# `mamba2` the Mamba-2 tests, per-layer cost and backward), e.g.
#   STEPS=tests,gemm,throughput bash benchmarks/gpu_suite.sh
# Logs land in ${OUT:-/tmp/gpu_suite}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_suite}"
STEPS="${STEPS:-gate,tests,gemm,attention,battery,throughput,train}"
THROUGHPUT_CONFIG="${THROUGHPUT_CONFIG:-benchmarks/configs/qwen3-8b.json}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
has() { [[ ",$STEPS," == *",$1,"* ]]; }
SECONDS=0

# The GPU machine is offline: install without build isolation (pyproject.toml
# names the backend; nothing is downloaded); the tree is also put on PYTHONPATH
# so a failed install cannot hide the code under test.
echo "== install"
VLLM_PARITY_SKIP_CSRC="${VLLM_PARITY_SKIP_CSRC:-1}" python -m pip install -q --no-build-isolation --no-deps -e . \
  >"$OUT/install.log" 2>&1 && echo "pip install -e . ok" || { echo "pip install failed (see install.log)"; tail -3 "$OUT/install.log"; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Packages the offline GPU machine lacks (fastapi, uvicorn, openai, ...) travel as wheels in
# .whl/ (docs/serving.md says how to fetch them); they go to a private site folder.
# flash-linear-attention (fla, fla_core-*.whl) goes to its own folder, on the path only for
# the GDN kernel benchmark: where it imports, transformers' Qwen3-Next swaps its torch
# reference functions for fla's kernels, which the tests use as independent references.
# The kernel baselines (fla_core, mamba_ssm and einops, which both import) stay off the tests'
# path: transformers' model classes swap in their kernels when they import.
wheels=$(ls .whl/*.whl 2>/dev/null | grep -vE "/(fla_core|mamba_ssm|einops)-")
if [[ -n "$wheels" ]]; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    >"$OUT/wheels.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site" && echo "wheels from .whl installed" \
    || { echo "wheel install failed"; tail -3 "$OUT/wheels.log"; }
fi
if compgen -G ".whl/fla_core-*.whl" >/dev/null; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla_site \
    .whl/fla_core-*.whl .whl/einops-*.whl >>"$OUT/wheels.log" 2>&1 && echo "fla in /tmp/fla_site (GDN kernel benchmark only)"
fi
# mamba_ssm's Triton SSD ops (scripts/mamba_ssm_triton_wheel.py builds the wheel): the Mamba-2
# benchmark's native baseline, likewise off the tests' path
if compgen -G ".whl/mamba_ssm-*.whl" >/dev/null; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mamba_site \
    .whl/mamba_ssm-*.whl .whl/einops-*.whl >>"$OUT/wheels.log" 2>&1 && echo "mamba_ssm in /tmp/mamba_site (Mamba-2 kernel benchmark only)"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if has csrc; then
  # build csrc/ through CMakeLists.txt (nvcc + cmake) and run its test; the other steps
  # keep the pure-Python install so one failed build cannot hide the rest
  echo "== csrc build ($SECONDS s)"
  ( command -v nvcc; command -v cmake; nvcc --version | tail -1 ) >"$OUT/csrc.log" 2>&1
  timeout "${CSRC_TIMEOUT:-300}" env VLLM_PARITY_SKIP_CSRC=0 python -m pip install -v --no-build-isolation --no-deps -e . \
    >>"$OUT/csrc.log" 2>&1 && echo "csrc build ok" || { echo "csrc build failed"; tail -5 "$OUT/csrc.log"; }
  python -c "from vllm import _custom_ops as c; print('vllm._C built:', c.HAS_C)" 2>&1 | tee -a "$OUT/csrc.log"
  python -m pytest -q -p no:cacheprovider tests/test_custom_ops.py 2>&1 | tail -2 | tee -a "$OUT/csrc.log"
fi
if has tests; then
  echo "== GPU tests ($SECONDS s)"
  timeout "${TESTS_TIMEOUT:-400}" python -m pytest -q -m gpu -p no:cacheprovider ${TEST_PATHS:-tests} ${PYTEST_ARGS:-} >"$OUT/gpu_tests.log" 2>&1
  grep -E "passed|failed|Error|FAILED" "$OUT/gpu_tests.log" | tail -25
fi
if has gemm; then
  echo "== GEMM ($SECONDS s)"
  timeout "${GEMM_TIMEOUT:-300}" python benchmarks/kernels/gemm.py ${GEMM_ARGS:-} --json-out "$OUT/gemm.json" >"$OUT/gemm.log" 2>&1
  tail -22 "$OUT/gemm.log"
fi
if has tptree; then
  # the TP leaf tree at TP=1 against the invariant GEMM (TPTREE_ARGS="--sweep ..." for the
  # candidate tiles, e.g. --sweep-impls tmah,tmah2,tmar,tma)
  echo "== TP leaf tree ($SECONDS s)"
  timeout "${TPTREE_TIMEOUT:-300}" python benchmarks/kernels/tp_tree.py ${TPTREE_ARGS:---leaves 8} \
    --json-out "$OUT/tp_tree.json" >"$OUT/tp_tree.log" 2>&1
  grep -vE "^\[W|Warn" "$OUT/tp_tree.log" | tail -24
fi
if has nosplit; then
  # cuBLASLt with split-K forbidden: rows vs M, bits vs our Triton kernel, speed in graphs
  echo "== cuBLASLt nosplit ($SECONDS s)"
  timeout "${NOSPLIT_TIMEOUT:-240}" python benchmarks/kernels/cublas_nosplit.py ${NOSPLIT_ARGS:-} \
    --json-out "$OUT/nosplit.json" >"$OUT/nosplit.log" 2>&1
  grep -E "bits:|graphs:|cublaslt \(|wrote" "$OUT/nosplit.log" | tail -50
fi
if has overhead; then
  echo "== launch overhead ($SECONDS s)"
  timeout 120 python benchmarks/kernels/launch_overhead.py >"$OUT/overhead.log" 2>&1
  cat "$OUT/overhead.log" | tail -10
fi
if has kernels; then
  echo "== kernel profile ($SECONDS s)"
  timeout "${KERNELS_TIMEOUT:-300}" python benchmarks/profile_kernels.py --config "$THROUGHPUT_CONFIG" ${KERNELS_ARGS:-} \
    --json-out "$OUT/kernels.json" >"$OUT/kernels.log" 2>&1
  grep -E "^== |families" "$OUT/kernels.log"
fi
if has attention; then
  echo "== attention ($SECONDS s)"
  timeout 200 python benchmarks/kernels/attention.py >"$OUT/attention.log" 2>&1
  tail -20 "$OUT/attention.log"
fi
if has digest; then
  # the same rollout on this tree and, with OLD_TREE=archive.tar, on an older one: equal
  # digests mean a change left tokens and logprob bits untouched
  echo "== rollout digest ($SECONDS s)"
  python benchmarks/rollout_digest.py --make-model /tmp/digest_model >"$OUT/digest.log" 2>&1
  if [[ -n "${OLD_TREE:-}" ]]; then
    mkdir -p /tmp/old_tree && tar -xf "$OLD_TREE" -C /tmp/old_tree
    (cd /tmp && PYTHONPATH="/tmp/old_tree:/tmp/site" timeout 300 python "$OLDPWD/benchmarks/rollout_digest.py" \
      --model /tmp/digest_model) 2>&1 | grep digest | sed 's/^/old tree /' | tee -a "$OUT/digest.log"
  fi
  timeout 300 python benchmarks/rollout_digest.py --model /tmp/digest_model 2>&1 | grep digest | sed 's/^/this tree /' \
    | tee -a "$OUT/digest.log"
fi
if has serve; then
  echo "== serve ($SECONDS s)"
  timeout "${SERVE_TIMEOUT:-480}" python benchmarks/serve.py --config "$THROUGHPUT_CONFIG" --numerics invariant \
    --no-enable-prefix-caching --num-clients "${SERVE_CLIENTS:-256}" --input-len "${INPUT_LEN:-512}" \
    --output-len "${OUTPUT_LEN:-256}" ${SERVE_ARGS:-} >"$OUT/serve.log" 2>&1
  tail -12 "$OUT/serve.log"
fi
if has wsync; then
  # weight sync: same-process / IPC vs the device-copy floor, group vs the broadcast floor
  echo "== weight sync ($SECONDS s)"
  timeout "${WSYNC_TIMEOUT:-400}" python benchmarks/weight_sync.py --config "${WSYNC_CONFIG:-benchmarks/configs/qwen3-8b.json}" \
    ${WSYNC_ARGS:-} --json-out "$OUT/weight_sync.json" >"$OUT/weight_sync.log" 2>&1
  tail -10 "$OUT/weight_sync.log"
fi
if has gate; then
  # every feature axis at Qwen3-1.7B / Qwen3-MoE dims, invariant beside fast: every invariant cell 0
  echo "== real-dims parity gate ($SECONDS s)"
  timeout "${GATE_TIMEOUT:-480}" python benchmarks/parity_gate.py ${GATE_ARGS:-} --json-out "$OUT/gate.json" >"$OUT/gate.log" 2>&1
  sed -n '/== parity gate/,$p' "$OUT/gate.log"
fi
if has battery; then
  echo "== parity battery ($SECONDS s)"
  timeout "${BATTERY_TIMEOUT:-400}" python benchmarks/parity_battery.py ${BATTERY_ARGS:-} --json-out "$OUT/battery.json" >"$OUT/battery.log" 2>&1
  tail -12 "$OUT/battery.log"
fi
if has throughput; then
  echo "== throughput ($SECONDS s)"
  timeout "${THROUGHPUT_TIMEOUT:-500}" python benchmarks/throughput.py --config "$THROUGHPUT_CONFIG" --num-prompts "${NUM_PROMPTS:-256}" \
    --input-len "${INPUT_LEN:-512}" --output-len "${OUTPUT_LEN:-256}" --numerics "${NUMERICS:-fast,fast+async,invariant,invariant+async}" ${HF_FLAG:---hf} ${THROUGHPUT_ARGS:-} \
    --json-out "$OUT/throughput.json" >"$OUT/throughput.log" 2>&1
  tail -14 "$OUT/throughput.log"
fi
if has train; then
  echo "== train step ($SECONDS s)"
  timeout "${TRAIN_TIMEOUT:-1200}" python benchmarks/train_step.py ${TRAIN_ARGS:-} --json-out "$OUT/train_step.json" >"$OUT/train_step.log" 2>&1
  sed -n "/== train step/,\$p" "$OUT/train_step.log"
fi
if has moe; then
  # Qwen3-30B-A3B dims: MoE tests, the grouped expert GEMM vs torch._grouped_mm / per-expert
  # cuBLAS, end-to-end throughput (invariant vs fast) and the train step (12 of 48 layers)
  echo "== MoE ($SECONDS s)"
  MOE_PARTS="${MOE_PARTS:-tests,gemm,throughput,train}"
  moe_has() { [[ ",$MOE_PARTS," == *",$1,"* ]]; }
  moe_has tests && timeout "${MOE_TESTS_TIMEOUT:-600}" python -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_kernels.py \
    tests/test_moe_gpu.py tests/test_moe_parallel.py >"$OUT/moe_tests.log" 2>&1
  moe_has tests && tail -3 "$OUT/moe_tests.log"
  moe_has gemm && timeout "${MOE_GEMM_TIMEOUT:-600}" python benchmarks/kernels/moe_gemm.py ${MOE_GEMM_ARGS:-} --json-out "$OUT/moe_gemm.json" \
    >"$OUT/moe_gemm.log" 2>&1
  moe_has gemm && tail -40 "$OUT/moe_gemm.log"
  moe_has throughput && timeout "${MOE_THROUGHPUT_TIMEOUT:-900}" python benchmarks/throughput.py --config benchmarks/configs/qwen3-30b-a3b.json \
    --num-prompts "${NUM_PROMPTS:-256}" --input-len "${INPUT_LEN:-512}" --output-len "${OUTPUT_LEN:-256}" \
    --numerics "${MOE_NUMERICS:-fast+async,invariant+async}" --json-out "$OUT/moe_throughput.json" >"$OUT/moe_throughput.log" 2>&1
  moe_has throughput && tail -8 "$OUT/moe_throughput.log"
  moe_has train && timeout "${MOE_TRAIN_TIMEOUT:-600}" python benchmarks/train_step.py --config benchmarks/configs/qwen3-30b-a3b.json \
    --num-hidden-layers "${MOE_TRAIN_LAYERS:-12}" --layouts 4x1024 --rows transformers,invariant,fast --json-out "$OUT/moe_train_step.json" \
    >"$OUT/moe_train_step.log" 2>&1
  moe_has train && tail -6 "$OUT/moe_train_step.log"
fi
if has fp8; then
  # FP8: the FP8 tests, the FP8 GEMM vs bf16 invariant vs cuBLAS at Qwen3-8B shapes (in CUDA graphs
  # unless FP8_GEMM_ARGS says otherwise), decode
  # attention with the FP8 cache vs bf16, rollout throughput FP8 KV / FP8 linears vs bf16
  echo "== FP8 ($SECONDS s)"
  FP8_PARTS="${FP8_PARTS:-tests,gemm,cublaslt,attention,throughput}"
  fp8_has() { [[ ",$FP8_PARTS," == *",$1,"* ]]; }
  if fp8_has tests; then
    timeout "${FP8_TESTS_TIMEOUT:-400}" python -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_kv.py \
      tests/test_fp8_linear.py tests/test_parity_gate.py ${FP8_PYTEST_ARGS:-} >"$OUT/fp8_tests.log" 2>&1
    tail -3 "$OUT/fp8_tests.log"
  fi
  if fp8_has gemm; then
    timeout "${FP8_GEMM_TIMEOUT:-300}" python benchmarks/kernels/fp8_gemm.py ${FP8_GEMM_ARGS:---graph} --json-out "$OUT/fp8_gemm.json" \
      >"$OUT/fp8_gemm.log" 2>&1
    tail -40 "$OUT/fp8_gemm.log"
  fi
  if fp8_has cublaslt; then
    # cuBLASLt's block-scaled GEMM: bits vs Triton and across M, every algorithm, speed
    timeout "${FP8_CUBLASLT_TIMEOUT:-300}" python benchmarks/kernels/fp8_cublaslt.py ${FP8_CUBLASLT_ARGS:-} \
      --json-out "$OUT/fp8_cublaslt.json" >"$OUT/fp8_cublaslt.log" 2>&1
    grep -E "^cublaslt|^shape|^[a-z_]+ +[0-9]+ " "$OUT/fp8_cublaslt.log" | tail -45
  fi
  if fp8_has attention; then
    timeout "${FP8_ATTENTION_TIMEOUT:-200}" python benchmarks/kernels/fp8_decode_attention.py ${FP8_ATTENTION_ARGS:-} \
      >"$OUT/fp8_attention.log" 2>&1
    tail -30 "$OUT/fp8_attention.log"
  fi
  if fp8_has throughput; then
    timeout "${FP8_THROUGHPUT_TIMEOUT:-900}" python benchmarks/throughput.py --config "$THROUGHPUT_CONFIG" \
      --num-prompts "${NUM_PROMPTS:-256}" --input-len "${INPUT_LEN:-512}" --output-len "${OUTPUT_LEN:-256}" \
      --numerics "${FP8_NUMERICS:-invariant+async}" --kv-cache-dtype "${FP8_KV:-auto,fp8}" --quantization "${FP8_QUANT:-none,fp8}" \
      --json-out "$OUT/fp8_throughput.json" >"$OUT/fp8_throughput.log" 2>&1
    tail -12 "$OUT/fp8_throughput.log"
  fi
fi
if has gdn; then
  # Gated DeltaNet hybrids: the GDN kernel and model tests, the per-layer cost (invariant vs
  # fast vs flash-linear-attention where its wheel travels in .whl/) and rollout throughput at
  # Qwen3-Next-like dims (12 layers)
  echo "== Gated DeltaNet ($SECONDS s)"
  GDN_PARTS="${GDN_PARTS:-tests,kernels,throughput}"
  gdn_has() { [[ ",$GDN_PARTS," == *",$1,"* ]]; }
  if gdn_has tests; then
    timeout "${GDN_TESTS_TIMEOUT:-400}" python -m pytest -q -p no:cacheprovider tests/test_gdn_chunk.py tests/test_gdn_ops.py \
      tests/test_chunk_recurrence.py tests/test_gdn_backward.py tests/test_chunk_tiles.py \
      ${GDN_PYTEST_ARGS:-} >"$OUT/gdn_tests.log" 2>&1
    grep -E "passed|failed|Error|FAILED|fast mode:" "$OUT/gdn_tests.log" | tail -15
  fi
  if gdn_has kernels; then
    PYTHONPATH="$PYTHONPATH:/tmp/fla_site" timeout "${GDN_KERNELS_TIMEOUT:-300}" python benchmarks/kernels/gdn.py \
      --json-out "$OUT/gdn_kernels.json" \
      >"$OUT/gdn_kernels.log" 2>&1
    tail -12 "$OUT/gdn_kernels.log"
  fi
  if gdn_has throughput; then
    timeout "${GDN_THROUGHPUT_TIMEOUT:-600}" python benchmarks/throughput.py --config "${GDN_CONFIG:-benchmarks/configs/qwen3-next-12l.json}" \
      --num-prompts "${NUM_PROMPTS:-256}" --input-len "${INPUT_LEN:-512}" --output-len "${OUTPUT_LEN:-256}" \
      --numerics "${GDN_NUMERICS:-fast+async,invariant+async}" --json-out "$OUT/gdn_throughput.json" \
      >"$OUT/gdn_throughput.log" 2>&1
    tail -8 "$OUT/gdn_throughput.log"
  fi
  if gdn_has backward; then
    # the training backward alone: today's path (autograd of the reference, Triton recurrence)
    # against the fused kernels (vllm/kernels/gdn_backward.py), time and distance, and fla's
    # kernels per call where its wheel travels
    PYTHONPATH="$PYTHONPATH:/tmp/fla_site" timeout "${GDN_BACKWARD_TIMEOUT:-150}" python benchmarks/kernels/gdn.py --backward \
      >"$OUT/gdn_backward.log" 2>&1
    grep -vE "^\[W" "$OUT/gdn_backward.log" | tail -11
  fi
  if gdn_has sweep; then
    # the forward kernels' tiles, warps and T form: time per config and bits against the defaults
    PYTHONPATH="$PYTHONPATH:/tmp/fla_site" timeout "${GDN_SWEEP_TIMEOUT:-400}" python benchmarks/kernels/gdn_forward_sweep.py \
      ${GDN_SWEEP_CONFIGS:+--configs "$GDN_SWEEP_CONFIGS"} >"$OUT/gdn_sweep.log" 2>&1
    grep -vE "^\[W" "$OUT/gdn_sweep.log" | tail -12
  fi
  if gdn_has breakdown; then
    # per kernel, GDN and Mamba-2, decode at several chunk offsets and prefill (torch profiler)
    timeout "${BREAKDOWN_TIMEOUT:-120}" python benchmarks/kernels/scan_breakdown.py >"$OUT/scan_breakdown.log" 2>&1
    grep -E "^(decode|prefill|mamba2)" "$OUT/scan_breakdown.log" | cut -c1-160
  fi
fi
if has mamba2; then
  # Mamba-2 hybrids (Nemotron-H): the scan's kernel tests and its per-layer cost against the
  # native forms (mamba_ssm where it imports, else our fast mode)
  echo "== Mamba-2 ($SECONDS s)"
  timeout "${MAMBA2_TESTS_TIMEOUT:-300}" python -m pytest -q -p no:cacheprovider tests/test_mamba2_chunk.py \
    tests/test_mamba2_backward.py tests/test_nemotron_h.py >"$OUT/mamba2_tests.log" 2>&1
  grep -E "passed|failed|Error|FAILED" "$OUT/mamba2_tests.log" | tail -8
  PYTHONPATH="$PYTHONPATH:/tmp/mamba_site" timeout "${MAMBA2_KERNELS_TIMEOUT:-300}" python benchmarks/kernels/mamba2.py \
    >"$OUT/mamba2_kernels.log" 2>&1
  tail -10 "$OUT/mamba2_kernels.log"
  # the training backward alone: today's path against the fused kernels (vllm/kernels/mamba2_backward.py)
  timeout "${MAMBA2_BACKWARD_TIMEOUT:-150}" python benchmarks/kernels/mamba2.py --backward >"$OUT/mamba2_backward.log" 2>&1
  grep -vE "^\[W" "$OUT/mamba2_backward.log" | tail -9
fi
if has defaultjob; then
  # the README's main job (`vllm train`, no arguments: the default recipe on the embedded model) on the GPU
  echo "== vllm train, default recipe ($SECONDS s)"
  timeout "${DEFAULTJOB_TIMEOUT:-300}" python -m vllm.entrypoints.cli.main train --output-dir /tmp/rl_default --overwrite \
    ${DEFAULTJOB_ARGS:-} >"$OUT/defaultjob.log" 2>&1
  tr '\r' '\n' <"$OUT/defaultjob.log" | grep -E "^(vllm train: grpo|eval|step|done)" | tail -9
fi
if has rlstep; then
  # the full RL step (vllm train's loop), fast vs invariant, Qwen3-4B dims, random weights
  echo "== RL step ($SECONDS s)"
  timeout "${RLSTEP_TIMEOUT:-540}" python benchmarks/rl_step.py ${RLSTEP_ARGS:-} --json-out "$OUT/rl_step.json" \
    >"$OUT/rl_step.log" 2>&1
  tail -12 "$OUT/rl_step.log"
fi
if has rlray; then
  # the RL step on Ray (trainer + one engine colocated on this GPU) vs the single-process step, Qwen3-4B
  # dims; needs the ray package (the offline machine: .whl/ray/ from scripts/slim_ray_wheel.py), docs/ray.md
  echo "== RL step on Ray ($SECONDS s)"
  # ray travels slimmed (scripts/slim_ray_wheel.py: its full wheel is over what a call carries)
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ray_site \
    .whl/ray/*.whl >>"$OUT/wheels.log" 2>&1 && echo "ray from .whl/ray installed"
  PYTHONPATH="$PYTHONPATH:/tmp/ray_site" timeout "${RLRAY_TIMEOUT:-600}" python benchmarks/rl_step.py --modes invariant,invariant+ray ${RLRAY_ARGS:-} \
    --json-out "$OUT/rl_ray_step.json" >"$OUT/rl_ray_step.log" 2>&1
  tail -10 "$OUT/rl_ray_step.log"
fi

echo
echo "================ summary (${SECONDS} s) ================"
has csrc && echo "csrc: $(tail -1 "$OUT/csrc.log")"
has gate && sed -n '/== parity gate/,$p' "$OUT/gate.log"
has tests && echo "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
has gemm && sed -n '/== invariant GEMM/,$p' "$OUT/gemm.log" | head -80
has tptree && grep -vE "^\[W|Warn" "$OUT/tp_tree.log" | tail -24
has nosplit && grep -E "bits:" "$OUT/nosplit.log"
has attention && grep -A12 "== attention" "$OUT/attention.log" | head -14
has digest && grep digest "$OUT/digest.log"
has serve && grep -iE "tok/s|ratio" "$OUT/serve.log" | tail -6
has wsync && sed -n '/^path /,$p' "$OUT/weight_sync.log"
has battery && sed -n '/== parity battery/,$p' "$OUT/battery.log"
has throughput && grep -E "^(floor|engine|fast|invariant|transformers|\[)" "$OUT/throughput.log"
has train && sed -n '/== train step/,$p' "$OUT/train_step.log"
has moe && { tail -1 "$OUT/moe_tests.log"; grep -E "^bits:" "$OUT/moe_gemm.log"; grep -E "^(floor|invariant)" "$OUT/moe_throughput.log"; grep -E "^invariant / plain" "$OUT/moe_train_step.log"; } 2>/dev/null
has gdn && { grep -E "passed|failed" "$OUT/gdn_tests.log" | tail -1; sed -n '/== Gated DeltaNet, one layer/,$p' "$OUT/gdn_kernels.log"; \
  grep -E "^(floor|engine|fast|invariant)" "$OUT/gdn_throughput.log"; } 2>/dev/null
has gdn && grep -E "^backward| vs float64:" "$OUT/gdn_backward.log" 2>/dev/null
has gdn && grep -E "^(decode 256x1 invariant, spread, T cached|decode 256x1 fast|mamba2 decode 256x1 (invariant, spread|fast))" \
  "$OUT/scan_breakdown.log" 2>/dev/null | cut -c1-120
has mamba2 && { grep -E "passed|failed" "$OUT/mamba2_tests.log" | tail -1; sed -n '/== Mamba-2, one layer/,$p' "$OUT/mamba2_kernels.log"; \
  grep -E "^backward| vs float64:" "$OUT/mamba2_backward.log"; } 2>/dev/null
has defaultjob && tr '\r' '\n' <"$OUT/defaultjob.log" | grep -E "^done" 
has rlstep && sed -n '/^RL step/,$p' "$OUT/rl_step.log"
has rlray && sed -n '/^RL step/,$p' "$OUT/rl_ray_step.log"
has fp8 && { tail -1 "$OUT/fp8_tests.log"; grep -E "^fp8 (bits|summary)" "$OUT/fp8_gemm.log"; \
  grep -E "^cublaslt (bits|summary)" "$OUT/fp8_cublaslt.log"; \
  grep -E "^fp8 decode" "$OUT/fp8_attention.log"; grep -E "^\[fp8\]|^invariant" "$OUT/fp8_throughput.log"; } 2>/dev/null
exit 0
