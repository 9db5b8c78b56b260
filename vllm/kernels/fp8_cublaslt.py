"""Block-scaled FP8 GEMM on cuBLASLt (Hopper, cuBLAS >= 12.9): y = x @ w.T with the scales of
vllm/kernels/fp8.py, x per token per 128 channels (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F)
and w per 128 x 128 block (..._BLK128x128_32F).

Called through ctypes on the libcublasLt that torch already loaded (no build step). Every
reduction scheme is forbidden (CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK = NONE) and no
workspace is offered, so no output is ever summed across programs: each output element is
one float32 sequence of 128-wide K blocks, whatever tile cuBLAS picks for M. On the H200
(cuBLASLt 13.1) that made its bits equal to the Triton kernel's (vllm/kernels/fp8_gemm.py)
for Qwen3-8B's four shapes at every M measured, with every algorithm cuBLAS offered
(benchmarks/kernels/fp8_cublaslt.py); the engine still proves it per weight shape before
using it (fp8_gemm.cublaslt_verified).

Layout: torch's row-major x [M, K] is cuBLAS's column-major K x M and w [N, K] is K x N, so
y^T (N x M, column-major = row-major y [M, N]) = op(A) B with A = w (transposed, the "TN"
form Hopper FP8 takes) and B = x. Scale layouts cuBLAS reads (found by the benchmark: the
other three combinations are 10-30% off): activation scales M-contiguous (strides (1, M),
what quantize_act_triton(m_major=True) writes), weight scales [N/128, K/128] row-major (as
fp8.quantize_weight returns them). cuBLAS refuses M that is not a multiple of 4 (measured
M = 1, 2, 3, 5, 6, 7 refused; 4, 8, 12, 100, 1028 taken): callers pad the rows.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import torch

from vllm.kernels.fp8 import BLOCK

_OP_N, _OP_T = 0, 1
_R_32F, _R_16BF, _R_8F_E4M3 = 0, 14, 28
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_VEC128_32F, _SCALE_BLK128X128_32F = 4, 5
_PREF_MAX_WORKSPACE_BYTES, _PREF_REDUCTION_SCHEME_MASK = 1, 3
_REDUCTION_NONE = 0
_ALGO_CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                "inner": 7, "cluster": 8}
_HEURISTICS = 8

# cuBLAS takes row counts of this multiple only (see the module docstring).
ROW_MULTIPLE = 4


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    """The libcublasLt mapped into this process by torch (the one its own GEMMs call)."""
    torch.cuda.current_blas_handle()  # makes torch load cuBLAS(Lt)
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcublasLt.so" in line})
    if not paths:
        raise CublasLtError("libcublasLt is not loaded in this process")
    return ctypes.CDLL(paths[0])


def version() -> int:
    return int(_lib().cublasLtGetVersion())


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cublasStatus {status}")


def _set(fn, obj, attr: int, value) -> None:
    _check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"set attribute {attr}")


@functools.lru_cache(maxsize=None)
def _handle(index: int) -> ctypes.c_void_p:
    h = ctypes.c_void_p()
    with torch.cuda.device(index):
        _check(_lib().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h


def _layout(dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
    lay = ctypes.c_void_p()
    _check(_lib().cublasLtMatrixLayoutCreate(ctypes.byref(lay), ctypes.c_int(dtype), ctypes.c_uint64(rows),
                                             ctypes.c_uint64(cols), ctypes.c_int64(ld)), "cublasLtMatrixLayoutCreate")
    return lay


class _Plan:
    """Descriptors and the chosen algorithm for one (device, M, N, K, x row stride, out dtype).
    The matmul descriptor carries the scale pointers, so calls on one plan are serialised."""

    def __init__(self, index: int, M: int, N: int, K: int, ldx: int, out_dtype: torch.dtype, algo_index: int,
                 scale_ptrs: tuple[int, int]):
        lib = _lib()
        out_type = {torch.bfloat16: _R_16BF, torch.float32: _R_32F}[out_dtype]
        self.lock = threading.Lock()
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), ctypes.c_int(_COMPUTE_32F),
                                            ctypes.c_int(_R_32F)), "cublasLtMatmulDescCreate")
        sd = lib.cublasLtMatmulDescSetAttribute
        _set(sd, self.desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        _set(sd, self.desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        _set(sd, self.desc, _DESC_A_SCALE_MODE, ctypes.c_int32(_SCALE_BLK128X128_32F))
        _set(sd, self.desc, _DESC_B_SCALE_MODE, ctypes.c_int32(_SCALE_VEC128_32F))
        _set(sd, self.desc, _DESC_FAST_ACCUM, ctypes.c_int8(0))
        # the heuristic checks the scale pointers (set per call after this)
        _set(sd, self.desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(scale_ptrs[0]))
        _set(sd, self.desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(scale_ptrs[1]))
        self.a = _layout(_R_8F_E4M3, K, N, K)
        self.b = _layout(_R_8F_E4M3, K, M, ldx)
        self.d = _layout(out_type, N, M, N)
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            sp = lib.cublasLtMatmulPreferenceSetAttribute
            _set(sp, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(0))
            _set(sp, pref, _PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(_REDUCTION_NONE))
            results = (_Heuristic * _HEURISTICS)()
            n = ctypes.c_int(0)
            with torch.cuda.device(index):
                _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(index), self.desc, self.a, self.b, self.d, self.d,
                                                          pref, ctypes.c_int(_HEURISTICS), results, ctypes.byref(n)),
                       "cublasLtMatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if n.value == 0:
            raise CublasLtError(f"cuBLASLt has no block-scaled FP8 algorithm for M={M} N={N} K={K}")
        self.candidates = [results[i].algo for i in range(n.value)]
        self.algo = self.candidates[min(algo_index, n.value - 1)]
        self.index = index

    def config(self, algo: _Algo | None = None) -> dict:
        algo = algo or self.algo
        out = {}
        for name, attr in _ALGO_CONFIG.items():
            v = ctypes.c_uint32(0)
            w = ctypes.c_size_t(0)
            if _lib().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v),
                                                           ctypes.sizeof(v), ctypes.byref(w)) == 0:
                out[name] = int(v.value)
        return out


_PLANS: dict[tuple, _Plan] = {}
_PLANS_LOCK = threading.Lock()
_ALPHA, _BETA = ctypes.c_float(1.0), ctypes.c_float(0.0)


def plan(index: int, M: int, N: int, K: int, ldx: int, out_dtype: torch.dtype, algo_index: int = 0,
         scale_ptrs: tuple[int, int] = (0, 0)) -> _Plan:
    key = (index, M, N, K, ldx, out_dtype, algo_index)
    with _PLANS_LOCK:
        p = _PLANS.get(key)
        if p is None:
            p = _PLANS[key] = _Plan(index, M, N, K, ldx, out_dtype, algo_index, scale_ptrs)
    return p


def takes(N: int, K: int, wq: torch.Tensor, bias, out_dtype: torch.dtype) -> bool:
    """The cases this path was measured for: CUDA, no bias (the Triton kernel adds it before
    rounding; cuBLAS's epilogue was never compared), bf16 out (float32 out was never
    compared), K and N multiples of 128, a contiguous 16-byte aligned weight."""
    return (wq.is_cuda and bias is None and out_dtype == torch.bfloat16
            and K % BLOCK == 0 and N % BLOCK == 0 and wq.is_contiguous() and wq.data_ptr() % 16 == 0)


def fp8_gemm_cublaslt(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                      out_dtype: torch.dtype, algo_index: int = 0) -> torch.Tensor:
    """xq [M, K] fp8 (M a multiple of ROW_MULTIPLE, rows 16-byte aligned), xs [M, K/128]
    float32 M-contiguous (copied to that layout when it is not), wq [N, K] fp8, ws
    [N/128, K/128] float32 -> [M, N] out_dtype. algo_index: which of cuBLAS's ranked
    algorithms (the benchmark's every-algorithm check; the engine takes the first).
    Raises CublasLtError when cuBLAS refuses the problem."""
    M, K = xq.shape
    N = wq.shape[0]
    if M % ROW_MULTIPLE or xq.stride(1) != 1 or xq.stride(0) % 16 or xq.data_ptr() % 16:
        raise CublasLtError(f"cuBLASLt FP8 GEMM: M={M} must be a multiple of {ROW_MULTIPLE}, rows 16-byte aligned")
    if xs.stride(0) != 1 or (M > 1 and xs.stride(1) != M):
        xs = xs.t().contiguous().t()
    ws = ws.contiguous()
    p = plan(xq.device.index, M, N, K, xq.stride(0), out_dtype, algo_index, (ws.data_ptr(), xs.data_ptr()))
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    lib = _lib()
    stream = ctypes.c_void_p(torch.cuda.current_stream(xq.device).cuda_stream)
    with p.lock:
        sd = lib.cublasLtMatmulDescSetAttribute
        _set(sd, p.desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(ws.data_ptr()))
        _set(sd, p.desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(xs.data_ptr()))
        _check(lib.cublasLtMatmul(_handle(p.index), p.desc, ctypes.byref(_ALPHA), ctypes.c_void_p(wq.data_ptr()), p.a,
                                  ctypes.c_void_p(xq.data_ptr()), p.b, ctypes.byref(_BETA),
                                  ctypes.c_void_p(y.data_ptr()), p.d, ctypes.c_void_p(y.data_ptr()), p.d,
                                  ctypes.byref(p.algo), None, ctypes.c_size_t(0), stream), "cublasLtMatmul")
    return y
