"""Batch-invariant GEMM: y = x @ W^T (+ b), one fixed reduction order along K.

Each output element is produced by ONE program that walks K from 0 to K in
order, accumulating in float32 with the `acc = tl.dot(a, b, acc)` form: no
split-K, no atomics, no dependence of the K order on M. Tile shapes (BM, BN,
BK, warps, stages) may follow M: measured on the H200 this form gives
bit-identical results for every tile shape tried (../shared/NOTES.md), and the
start-up self-check (`vllm/kernels/selfcheck.py`) re-verifies it for the
loaded model's shapes on the machine at hand.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _invariant_matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    # Grouped launch order so consecutive programs share W tiles in L2 (order of
    # programs never affects bits: each output tile belongs to exactly one program).
    group = GROUP_M * num_pid_n
    gid = pid // group
    first_m = gid * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m

    # int64 offsets: lm_head outputs exceed 2^31 elements at large M
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rn[None, :] * stride_bn + rk[:, None] * stride_bk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        k_left = K - k * BK
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(rn[None, :] < N) & (rk[:, None] < k_left), other=0.0)
        acc = tl.dot(a, b, acc)  # this form (not `acc += tl.dot`) keeps bits independent of BK/BM
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _invariant_matmul_tma_kernel(
    a_desc, b_desc, c_desc, bias_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Persistent variant (Hopper TMA loads/stores, one program per SM walking output
    tiles). Per output tile it is the same computation as _invariant_matmul_kernel:
    K from 0 upward in BK steps, `acc = tl.dot(a, b, acc)` in fp32 (TMA zero-fills the
    K tail, adding exact zeros). Candidate for large M: benchmarks/kernels/gemm.py
    --sweep times it and checks its bits against the plain kernel before it may enter
    the config table."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        gid = tile // group
        first_m = gid * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % size_m
        pid_n = (tile % group) // size_m
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(0, tl.cdiv(K, BK)):
            a = a_desc.load([pid_m * BM, ki * BK])
            b = b_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        if HAS_BIAS:
            rn = pid_n * BN + tl.arange(0, BN)
            acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        c_desc.store([pid_m * BM, pid_n * BN], acc.to(c_desc.dtype))


# (max M, BM, BN, BK, num_warps, num_stages). Tile shapes never change bits
# (tests/test_invariant_kernels.py, the start-up self-check and
# benchmarks/kernels/gemm.py --sweep all verify it), so they may follow M, N
# and K freely; the values below are the H200 sweep's winners
# (benchmarks/NOTES.md). Wide outputs (the lm_head) get their own table.
GPU_CONFIGS: list[tuple[int, int, int, int, int, int]] = [
    (16, 16, 32, 512, 4, 3),
    (32, 16, 64, 256, 4, 4),
    (64, 64, 32, 256, 4, 4),
    (128, 64, 64, 128, 4, 4),
    (256, 64, 128, 64, 4, 4),
    (512, 128, 128, 64, 8, 4),
    (1 << 62, 256, 128, 64, 8, 3),
]
GPU_CONFIGS_WIDE: list[tuple[int, int, int, int, int, int]] = [
    (16, 16, 64, 128, 4, 5),
    (32, 32, 128, 128, 4, 4),
    (64, 64, 128, 128, 4, 4),
    (128, 128, 128, 64, 8, 3),
    (256, 128, 128, 64, 4, 4),
    (1 << 62, 128, 256, 64, 8, 4),
]
WIDE_N = 65536
# The Triton interpreter (CPU tests) emulates tl.dot with numpy, where the K
# tile DOES change bits (each tile's partial product is rounded before it is
# added), so it gets one fixed tile shape for every M.
INTERPRET_CONFIGS: list[tuple[int, int, int, int, int, int]] = [
    (1 << 62, 16, 16, 16, 1, 1),
]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pick_config(M: int, N: int = 0, configs=None) -> tuple[int, int, int, int, int]:
    if configs is not None:
        table = configs
    elif _interpreting():
        table = INTERPRET_CONFIGS
    else:
        table = GPU_CONFIGS_WIDE if N >= WIDE_N else GPU_CONFIGS
    for max_m, bm, bn, bk, warps, stages in table:
        if M <= max_m:
            return bm, bn, bk, warps, stages
    raise AssertionError("config table must end with an unbounded entry")


def _tma_ok(a: torch.Tensor, weight: torch.Tensor, c: torch.Tensor) -> bool:
    # TMA needs 16-byte aligned row strides and base addresses, unit inner stride
    return all(t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (a, weight, c))


def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, config: tuple | None = None,
                     impl: str = "plain") -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N] in out_dtype (default x.dtype)."""
    K = x.shape[-1]
    N, Kw = weight.shape
    if Kw != K:
        raise ValueError(f"invariant_matmul: x has K={K}, weight has K={Kw}")
    lead = x.shape[:-1]
    a = x.reshape(-1, K)
    M = a.shape[0]
    c = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return c.reshape(*lead, N)
    bm, bn, bk, warps, stages = config or pick_config(M, N)
    if impl == "tma" and _tma_ok(a, weight, c):
        from triton.tools.tensor_descriptor import TensorDescriptor
        programs = min(_num_programs(x.device), triton.cdiv(M, bm) * triton.cdiv(N, bn))
        _invariant_matmul_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
            TensorDescriptor.from_tensor(c, [bm, bn]), bias if bias is not None else c, M, N, K,
            HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, GROUP_M=8, NUM_PROGRAMS=programs,
            num_warps=warps, num_stages=stages)
        return c.reshape(*lead, N)
    if impl not in ("plain", "tma"):
        raise ValueError(f"impl must be 'plain' or 'tma', got {impl!r}")
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _invariant_matmul_kernel[grid](
        a, weight, c, bias if bias is not None else c,
        M, N, K,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
    )
    return c.reshape(*lead, N)
