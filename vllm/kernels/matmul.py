"""Batch-invariant GEMM: y = x @ W^T (+ b), one fixed reduction order along K.

The reduction order of every output element (m, n) is a function of K alone: one
program walks K upward from zero and accumulates in float32 with the
`acc = tl.dot(a, b, acc)` form, then the bias is added and the result cast once. K is
never split (a fixed split merged in ascending order was measured on the H200 and was
not faster: benchmarks/NOTES.md, "Removed options").

Several implementations compute exactly that order and are chosen by M only for
speed (see IMPLS): "plain" (one program per output tile), "tma" / "tmaf" (persistent
programs with Hopper TMA loads; "tmaf" flattens the tile loop into the K loop), and
"cublaslt": cuBLASLt with every reduction scheme forbidden (no split-K, so one sequence
of MMA steps along K per output), which on the H200 gives exactly the Triton kernels'
bits at every M (benchmarks/kernels/cublas_nosplit.py; checked again at start-up and in
the GPU tests) and is faster at mid M, where cuBLAS's own tiles beat ours. Tile shapes
(BM, BN, BK, warps, stages) may follow M: on the H200 the `acc = tl.dot(a, b, acc)` form
gives bit-identical results for every tile shape and impl tried (benchmarks/NOTES.md, two
sweeps of ~1,500 candidates), and the start-up self-check (`vllm/kernels/selfcheck.py`)
plus benchmarks/kernels/gemm.py --sweep re-verify table entries against each other.
Which config runs comes from a per-device, per-(K, N) table (`tuned/gemm_<device>.json`)
or the generic tables below.
"""
from __future__ import annotations

import functools
import os
import threading

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_coords(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped order so consecutive programs share W tiles in L2 (program order never
    # affects bits: each output tile belongs to exactly one program).
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    group = GROUP_M * num_pid_n
    first_m = (tile // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % size_m
    pid_n = (tile % group) // size_m
    return pid_m, pid_n


@triton.jit
def _dot_k(a_ptr, b_ptr, rm, rn, rk, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """float32 sum over all of K of a[rm, k] * b[rn, k], ascending, from zero."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rn[None, :] * stride_bn + rk[:, None] * stride_bk
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N
    for k in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok, other=0.0)
            b = tl.load(b_ptrs, mask=n_ok, other=0.0)
        else:
            k_left = K - k * BK
            a = tl.load(a_ptrs, mask=m_ok & (rk[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=n_ok & (rk[:, None] < k_left), other=0.0)
        acc = tl.dot(a, b, acc)  # this form (not `acc += tl.dot`) keeps bits independent of BK/BM
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk
    return acc


@triton.jit
def _invariant_matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BM, BN, GROUP_M)
    # int64 offsets: lm_head outputs exceed 2^31 elements at large M
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    total = _dot_k(a_ptr, b_ptr, rm, rn, rk, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, BM, BN, BK, EVEN_K)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        total = total + bias[None, :]
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _tma_dot_k(a_desc, b_desc, off_m, off_n, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(0, tl.cdiv(K, BK)):
        a = a_desc.load([off_m, ki * BK])
        b = b_desc.load([off_n, ki * BK])
        acc = tl.dot(a, b.T, acc)  # TMA zero-fills the K tail: exact zeros added
    return acc


@triton.jit
def _tma_tile(a_desc, b_desc, c_desc, bias_ptr, tile, M, N, K,
              HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_coords(tile, M, N, BM, BN, GROUP_M)
    total = _tma_dot_k(a_desc, b_desc, pid_m * BM, pid_n * BN, K, BM, BN, BK)
    if HAS_BIAS:
        rn = pid_n * BN + tl.arange(0, BN)
        total = total + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_desc.store([pid_m * BM, pid_n * BN], total.to(c_desc.dtype))


@triton.jit
def _invariant_matmul_tma_kernel(
    a_desc, b_desc, c_desc, bias_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
):
    """Persistent variant (Hopper TMA loads/stores, NUM_PROGRAMS programs walking output
    tiles). Per output tile it is the same computation as _invariant_matmul_kernel."""
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    if FLATTEN:  # only compiled when asked for (older Triton lacks the keyword)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
            _tma_tile(a_desc, b_desc, c_desc, bias_ptr, tile, M, N, K, HAS_BIAS, BM, BN, BK, GROUP_M)
    else:
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
            _tma_tile(a_desc, b_desc, c_desc, bias_ptr, tile, M, N, K, HAS_BIAS, BM, BN, BK, GROUP_M)


# ---- config tables ----------------------------------------------------------------------------
# (max M, impl, BM, BN, BK, num_warps, num_stages). Neither tile shape nor impl changes
# bits (tests/test_invariant_kernels.py, the start-up self-check and
# benchmarks/kernels/gemm.py --sweep all verify it), so they may follow M freely. These
# generic tables serve shapes without a tuned table (values: the H200 sweeps' common
# winners, benchmarks/NOTES.md); wide outputs and float32 outputs (logits) use the
# second one.
GPU_CONFIGS: list[tuple] = [
    (16, "plain", 16, 64, 256, 4, 4),
    (64, "plain", 64, 32, 256, 4, 4),
    (128, "plain", 64, 64, 128, 4, 4),
    (512, "tma", 128, 128, 64, 4, 4),
    (1 << 62, "tma", 128, 256, 64, 8, 3),
]
GPU_CONFIGS_WIDE: list[tuple] = [
    (16, "plain", 16, 64, 128, 4, 5),
    (64, "plain", 64, 128, 128, 4, 4),
    (128, "tma", 128, 64, 128, 4, 4),
    (512, "tma", 128, 128, 64, 4, 4),
    (1024, "tma", 128, 128, 64, 8, 4),
    (1 << 62, "plain", 128, 256, 64, 8, 3),
]
WIDE_N = 65536
# The Triton interpreter (CPU tests) emulates tl.dot with numpy, where the K tile DOES
# change bits (each tile's partial product is rounded before it is added), so it gets
# one fixed tile shape for every M (the impls still differ, and must agree).
INTERPRET_CONFIGS: list[tuple] = [
    (1 << 62, "plain", 16, 16, 16, 1, 1),
]
# "tmaf": one program per SM with the tile loop flattened into the K loop (the pipeline
# keeps loading across tile boundaries).
# "cublaslt": cuBLASLt with split-K forbidden (see _cublaslt_matmul); "cublaslt+tma" etc.
# names the Triton impl that runs, with the entry's tiles, the inputs it does not take
# (bias, fp16, unaligned, non-CUDA, old torch); bare "cublaslt" falls back to tma / plain.
IMPLS = ("plain", "tma", "tmaf", "cublaslt")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Per-device tables measured by `benchmarks/kernels/gemm.py --sweep` and written by
# `benchmarks/kernels/derive_gemm_configs.py`: {"K,N": [[max M, impl, BM, BN, BK, warps,
# stages], ...]} for the shapes that were swept. Speed only: bits never depend on them.
_TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
_tuned_cache: dict[str, dict] = {}  # device key -> tables


@functools.lru_cache(maxsize=None)
def _device_key() -> str:
    if not torch.cuda.is_available():
        return ""
    return torch.cuda.get_device_name().lower().replace("nvidia", "").strip().replace(" ", "_")


def tuned_tables(device_key: str | None = None) -> dict:
    dev = _device_key() if device_key is None else device_key
    if dev not in _tuned_cache:
        path = os.path.join(_TUNED_DIR, f"gemm_{dev}.json")
        table = {}
        if dev and os.path.exists(path):
            import json
            with open(path) as f:
                data = json.load(f)
            table = {k: [tuple(e) for e in v] for k, v in data["shapes"].items()}
        _tuned_cache[dev] = table
    return _tuned_cache[dev]


def tuned_tables_digest() -> str | None:
    """SHA-256 of this device's tuned tables as loaded (None: no table). Tables are speed
    only, but the contract names them anyway: that claim is itself measured."""
    tables = tuned_tables()
    if not tables:
        return None
    import hashlib
    import json
    return hashlib.sha256(json.dumps(tables, sort_keys=True).encode()).hexdigest()


def config_table(N: int = 0, K: int = 0, fp32_out: bool = False) -> list[tuple]:
    if _interpreting():
        return INTERPRET_CONFIGS
    return _gpu_config_table(N, K, fp32_out)


# Cached: this runs on every eager GEMM launch, where a few device queries per call
# cost more host time (~90 us measured) than a decode-sized GEMM takes on the GPU.
@functools.lru_cache(maxsize=None)
def _gpu_config_table(N: int, K: int, fp32_out: bool) -> list[tuple]:
    tuned = tuned_tables().get(f"{K},{N}")
    if tuned:
        return tuned
    # float32 outputs (logits) take the lm_head table: a TMA epilogue of 128x256 fp32
    # does not fit next to three bf16 load stages in shared memory
    return GPU_CONFIGS_WIDE if (N >= WIDE_N or fp32_out) else GPU_CONFIGS


def pick_config(M: int, N: int = 0, K: int = 0, configs=None, fp32_out: bool = False) -> tuple:
    """(impl, BM, BN, BK, warps, stages) for a GEMM with M rows, N outputs and depth K."""
    for max_m, *cfg in (configs if configs is not None else config_table(N, K, fp32_out)):
        if M <= max_m:
            return tuple(cfg)
    raise AssertionError("config table must end with an unbounded entry")


def _tma_ok(a: torch.Tensor, weight: torch.Tensor, c: torch.Tensor) -> bool:
    # TMA needs 16-byte aligned row strides and base addresses, unit inner stride
    return all(t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (a, weight, c))


_TMA_TOO_BIG: set = set()


def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def _is_hopper_or_newer(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device.index if device.index is not None
                                                 else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# ---- cuBLASLt without split-K ------------------------------------------------------------------
# torch >= 2.10 lets a caller forbid cuBLASLt every split-K reduction scheme
# (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False) sets
# CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK to NONE on the cuBLASLt path). Every output is
# then one float32 sequence of MMA steps along K, whatever tile cuBLAS picks for M: measured
# bit-identical to our Triton kernels for Qwen3-8B's shapes at M = 1..16384 on the H200.
# The settings are process-global, so they are switched on around our call only (read on
# the host when the GEMM is launched or captured into a CUDA graph) and restored after.
# Only bf16 is taken (see _cublaslt_takes), so only the bf16 switch is touched.


@functools.lru_cache(maxsize=None)
def cublaslt_nosplit_supported() -> bool:
    """Whether this torch can forbid cuBLASLt's split-K (the setter takes allow_splitk)."""
    try:
        state = torch._C._get_cublas_allow_bf16_reduced_precision_reduction()
        if not isinstance(state, tuple) or len(state) != 2:
            return False
        torch._C._set_cublas_allow_bf16_reduced_precision_reduction(*state)  # the two-argument form exists
        return hasattr(torch._C, "_set_blas_preferred_backend") and hasattr(torch._C._BlasBackend, "Cublaslt")
    except (AttributeError, TypeError, RuntimeError):
        return False


def cublaslt_version() -> int | None:
    """Version of the cuBLASLt this process has loaded (part of the contract where the impl
    is used): read from the library mapped into the process, so it is the one torch calls."""
    try:
        import ctypes
        if torch.cuda.is_initialized():
            torch.cuda.current_blas_handle()  # makes torch load cuBLAS(Lt) if it has not yet
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcublasLt.so" in line}
        for path in sorted(paths):
            return int(ctypes.CDLL(path).cublasLtGetVersion())
    except Exception:  # noqa: BLE001 -- a version we cannot read is reported as None
        pass
    return None


def _cublaslt_takes(a: torch.Tensor, weight: torch.Tensor, bias, out_dtype: torch.dtype) -> bool:
    """What cuBLASLt-nosplit was measured on: CUDA bf16 in (fp16 was never measured, and
    torch may accumulate fp16 in fp16), bf16 or float32 out, no bias, unit inner strides,
    256-byte aligned bases and 16-byte aligned rows (alignment feeds cuBLAS's choice of
    kernel, so only the measured kind is taken), TunableOp off (it bypasses the backend
    switch). Everything else runs in Triton with the same bits."""
    return (a.is_cuda and bias is None and a.dtype == torch.bfloat16 and weight.dtype == a.dtype
            and out_dtype in (a.dtype, torch.float32) and a.stride(-1) == 1 and weight.stride(-1) == 1
            and a.data_ptr() % 256 == 0 and weight.data_ptr() % 256 == 0
            and (a.stride(0) * a.element_size()) % 16 == 0 and (weight.stride(0) * weight.element_size()) % 16 == 0
            and (weight.shape[0] * (4 if out_dtype == torch.float32 else 2)) % 16 == 0
            and cublaslt_nosplit_supported() and not torch.cuda.tunable.is_enabled())


# One lock for the switch: two of our threads interleaving set/restore could otherwise
# restore the defaults under the other's GEMM (split-K allowed again: other bits).
_LT_LOCK = threading.Lock()
# (M, N, K, dtypes) that cuBLASLt refused (torch raises before launching anything): Triton
_LT_REFUSED: set = set()


def _cublaslt_matmul(a: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ weight^T on cuBLASLt with split-K forbidden (bf16 in; bf16 or float32 out)."""
    with _LT_LOCK:
        backend = torch._C._get_blas_preferred_backend()
        reduction = torch._C._get_cublas_allow_bf16_reduced_precision_reduction()
        torch._C._set_blas_preferred_backend(torch._C._BlasBackend.Cublaslt)
        try:
            torch._C._set_cublas_allow_bf16_reduced_precision_reduction(False, False)
            if out_dtype == a.dtype:
                return torch.mm(a, weight.t())
            return torch.mm(a, weight.t(), out_dtype=out_dtype)
        finally:
            torch._C._set_cublas_allow_bf16_reduced_precision_reduction(*reduction)
            torch._C._set_blas_preferred_backend(backend)


def _normalize(config: tuple, impl: str | None) -> tuple:
    if isinstance(config[0], str):
        cfg_impl, *tiles = config
    else:  # bare (BM, BN, BK, warps, stages)
        cfg_impl, tiles = "plain", list(config)
    impl = impl or cfg_impl
    lt, plus, fallback = impl.partition("+")
    if (lt if plus else impl) not in IMPLS or (plus and (lt != "cublaslt" or fallback not in IMPLS[:-1])):
        raise ValueError(f"impl must be one of {IMPLS}, or 'cublaslt+<Triton impl>' (its fallback), got {impl!r}")
    return (impl, *tiles)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, config: tuple | None = None,
                     impl: str | None = None, allow_cublaslt: bool = True) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N] in out_dtype (default x.dtype).

    `config` / `impl` override the table (speed only: they never change bits).
    `allow_cublaslt=False` (KernelConfig.gemm_cublaslt) runs "cublaslt" entries in their
    Triton fallback (same bits)."""
    K = x.shape[-1]
    N, Kw = weight.shape
    if Kw != K:
        raise ValueError(f"invariant_matmul: x has K={K}, weight has K={Kw}")
    lead = x.shape[:-1]
    a = x.reshape(-1, K)
    M = a.shape[0]
    out_dtype = out_dtype or x.dtype
    if M == 0:
        return torch.empty((*lead, N), dtype=out_dtype, device=x.device)
    impl, bm, bn, bk, warps, stages = _normalize(config or pick_config(M, N, K, fp32_out=out_dtype == torch.float32),
                                                 impl)
    if impl.startswith("cublaslt"):
        lt_fallback = impl.partition("+")[2] or "tma"
        if lt_fallback.startswith("tma") and not _is_hopper_or_newer(a.device):
            lt_fallback = "plain"  # TMA needs Hopper; same bits
        refused_key = (M, N, K, a.dtype, out_dtype)
        if allow_cublaslt and refused_key not in _LT_REFUSED and _cublaslt_takes(a, weight, bias, out_dtype):
            try:
                return _cublaslt_matmul(a, weight, out_dtype).reshape(*lead, N)
            except RuntimeError as err:
                # no cuBLASLt algorithm for this problem: torch then wants plain cuBLAS, which
                # cannot forbid split-K, and refuses before launching anything. Any other
                # error (out of memory, a broken context) is not ours to hide.
                if "cuBLASLt" not in str(err):
                    raise
                _LT_REFUSED.add(refused_key)
        impl = lt_fallback  # the entry's Triton impl and tiles: same bits
    c = torch.empty((M, N), dtype=out_dtype, device=x.device)
    even_k = K % bk == 0
    bias_arg = bias if bias is not None else c
    too_big_key = (impl, bm, bn, bk, warps, stages, a.dtype, c.dtype)
    if impl.startswith("tma") and _tma_ok(a, weight, c) and too_big_key not in _TMA_TOO_BIG:
        from triton.runtime.errors import OutOfResources
        from triton.tools.tensor_descriptor import TensorDescriptor
        programs = min(_num_programs(x.device), triton.cdiv(M, bm) * triton.cdiv(N, bn))
        try:
            _invariant_matmul_tma_kernel[(programs,)](
                TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
                TensorDescriptor.from_tensor(c, [bm, bn]), bias_arg, M, N, K,
                HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, GROUP_M=8, NUM_PROGRAMS=programs,
                FLATTEN=impl == "tmaf", num_warps=warps, num_stages=stages, enable_fp_fusion=True)
            return c.reshape(*lead, N)
        except OutOfResources:
            # e.g. an fp32 epilogue tile too large for shared memory: the plain kernel
            # computes the same bits (raised before anything ran, so nothing is half-written)
            _TMA_TOO_BIG.add(too_big_key)
    _invariant_matmul_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        a, weight, c, bias_arg, M, N, K,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, GROUP_M=8, EVEN_K=even_k,
        num_warps=warps, num_stages=stages, enable_fp_fusion=True)
    return c.reshape(*lead, N)


def invariant_logits(hidden: torch.Tensor, weight: torch.Tensor, allow_cublaslt: bool = True) -> torch.Tensor:
    """The lm_head: the same GEMM with a float32 output (logits are never rounded to bf16)."""
    return invariant_matmul(hidden, weight, out_dtype=torch.float32, allow_cublaslt=allow_cublaslt)
