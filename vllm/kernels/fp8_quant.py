"""Activation quantization for the FP8 linear layers in one Triton kernel: the CUDA
implementation of `vllm.kernels.fp8.quantize_act` (which stays the reference and the CPU path),
bit-identical to it (fp8 bytes and float32 scales; tests/test_fp8_quant.py).

Per token per 128 channels, exactly the rule of vllm/kernels/fp8.py:
    amax  = max |x.float()|                  (zero padding of the last group changes nothing)
    scale = amax / 448 (IEEE division), 1.0 when amax == 0
    q     = e4m3fn(clamp(x / scale, -448, 448))   round to nearest, ties to even

The fp8 byte is built with explicit fp32/integer arithmetic instead of the hardware cast, so
the kernel computes the same bytes under TRITON_INTERPRET=1 (whose fp32 -> fp8 conversion does
not round to nearest even) as on the GPU: |v| is rounded to the e4m3 grid by adding and
subtracting 2^(e + 20) (an fp32 add rounds to nearest even at the grid step 2^(e - 3), where
e = max(floor(log2 |v|), -6), the subnormal exponent), then sign, exponent and 3 mantissa
bits are packed into the byte.

One launch replaces the reference's ~10 torch ops (what "fp8 lin" paid over "fp8 gemm" at
small M). The scale layout is the caller's choice (the values are the same): M-contiguous
([K/128, M] storage, returned as its [M, K/128] transpose view), where the GEMM's per-K-block
scale load is one vector, or row-major, where a row's consecutive K blocks share a cache
sector (what the decode-sized GEMMs run faster with; benchmarks/NOTES.md).
"""
from __future__ import annotations

import torch

from vllm.kernels.fp8 import BLOCK, FP8_DTYPE, FP8_MAX

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

ROWS_PER_PROGRAM = 16

if HAS_TRITON:
    @triton.jit
    def _quantize_act_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sk,
                             ROWS: tl.constexpr, BLOCK_K: tl.constexpr, FMAX: tl.constexpr):
        pid_r = tl.program_id(0)
        kb = tl.program_id(1)
        rows = pid_r * ROWS + tl.arange(0, ROWS)
        cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        r_ok = rows < M
        ok = r_ok[:, None] & (cols < K)[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, FMAX), 1.0)
        v = tl.math.div_rn(x, scale[:, None])
        v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
        # round |v| to the e4m3 grid (ties to even) by one fp32 add at the right magnitude
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80  # arithmetic shift: 0x80 for negatives (incl. -0), else 0
        a = tl.abs(v)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        big = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)
        r = (a + big) - big
        rb = r.to(tl.int32, bitcast=True)
        normal = ((((rb >> 23) & 0xFF) - 127 + 7) << 3) | ((rb >> 20) & 7)
        sub = (r * 512.0).to(tl.int32)  # r < 2^-6: a multiple of 2^-9, exact
        mag = tl.where(r >= 0.015625, normal, sub)
        byte = (sign | mag).to(tl.uint8)
        tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], byte, mask=ok)
        tl.store(s_ptr + kb * stride_sk + rows64 * stride_sm, scale, mask=r_ok)


def quantize_act_triton(x: torch.Tensor, m_major: bool = True, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scale [M, ceil(K/128)]); the same values as
    fp8.quantize_act. `m_major`: the scale tensor stored M-contiguous (strides (1, M)),
    else row-major. `rows` (>= M): allocate that many rows (the M-contiguous scales then
    have strides (1, rows)) for a GEMM that only takes row counts of some multiple; rows
    past M are left unwritten, and a GEMM's row r reads only row r, so they reach no
    output row below M."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if x.dim() != 2:
        raise ValueError("quantize_act_triton: x must be [M, K]")
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    rows = M if rows is None else rows
    if rows < M:
        raise ValueError(f"quantize_act_triton: rows={rows} < M={M}")
    kb = -(-K // BLOCK)
    q = torch.empty(rows, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(kb, rows, dtype=torch.float32, device=x.device).t() if m_major else \
        torch.empty(rows, kb, dtype=torch.float32, device=x.device)
    if M and K:
        grid = (triton.cdiv(M, ROWS_PER_PROGRAM), kb)
        _quantize_act_kernel[grid](x, q.view(torch.uint8), s, M, K, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                   ROWS=ROWS_PER_PROGRAM, BLOCK_K=BLOCK, FMAX=FP8_MAX, num_warps=4,
                                   enable_fp_fusion=True)
    return q, s
