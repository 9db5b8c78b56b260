"""Fused elementwise kernels (GPU): rotary embedding for q and k in one launch (full, or
partial: the first R dims of each head rotated, the rest copied), SiLU-and-mul and the
sigmoid output gate. Every output element is computed from its own inputs only,
so these are batch-invariant by construction and serve both numerics modes;
they exist to replace chains of small torch kernels in the decode step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels import torch_ops


@triton.jit
def _rope_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, n_heads, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
                 HALF: tl.constexpr, PASS: tl.constexpr, PASS_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF)
    mask = heads[:, None] < n_heads
    c = tl.load(cos_ptr + t * stride_c + cols)[None, :]
    s = tl.load(sin_ptr + t * stride_c + cols)[None, :]
    base = x_ptr + t * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    obase = out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    # same arithmetic as torch_ops.rope_one: x1*c - x2*s, x2*c + x1*s in float32, one rounding
    tl.store(obase, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(obase + HALF, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)
    if PASS > 0:
        # partial rope: the dims after the rotated 2 * HALF are copied as they are
        pcols = 2 * HALF + tl.arange(0, PASS_BLOCK)
        pmask = mask & (pcols[None, :] < 2 * HALF + PASS)
        xp = tl.load(x_ptr + t * stride_xt + heads[:, None] * stride_xh + pcols[None, :], mask=pmask, other=0.0)
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + pcols[None, :], xp, mask=pmask)


def rope_one_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One tensor's rotation: x [T, H, D] (last dim contiguous), cos/sin [T, R/2] float32
    contiguous (R = D: full rope; R < D: the first R dims rotated, the rest copied). The
    backward calls it with -sin (the adjoint rotation)."""
    T, H, D = x.shape
    half = cos.shape[-1]
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    block_h = min(triton.next_power_of_2(H), 16)
    pass_dims = D - 2 * half
    _rope_kernel[(T, triton.cdiv(H, block_h))](x, out, cos, sin, H, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                                               cos.stride(0), HALF=half, PASS=pass_dims,
                                               PASS_BLOCK=triton.next_power_of_2(max(pass_dims, 1)), BLOCK_H=block_h,
                                               num_warps=4, enable_fp_fusion=True)
    return out


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hk, D] (last dim contiguous), cos/sin [T, R/2] float32 (R <= D)."""
    cos, sin = cos.contiguous(), sin.contiguous()
    return rope_one_triton(q, cos, sin), rope_one_triton(k, cos, sin)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The Triton rotation where q and k are contiguous in head_dim (always, for the
    models' q/k views), the torch formula with the same arithmetic otherwise."""
    if q.stride(-1) == 1 and k.stride(-1) == 1:
        return rope_triton(q, k, cos, sin)
    return torch_ops.rope(q, k, cos, sin)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    # silu rounded to the model dtype first, then the product: torch's F.silu(gate) * up
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(triton.next_power_of_2(n), 2048)
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, n, x2.stride(0), out.stride(0), BLOCK=block,
                                                                num_warps=4, enable_fp_fusion=True)
    return out.reshape(*x.shape[:-1], n)


@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, out_ptr, n_cols, stride_x, stride_g, stride_gc, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    g = tl.load(g_ptr + row * stride_g + cols * stride_gc, mask=mask, other=0.0).to(tl.float32)
    # sigmoid rounded to the model dtype first, then the product: torch's x * torch.sigmoid(gate)
    s = (1.0 / (1.0 + tl.exp(-g))).to(x.dtype)
    tl.store(out_ptr + row * stride_o + cols, (x.to(tl.float32) * s.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def gate_rows(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(x as [R, N], gate as [R, N or 1], gate's column stride: 0 for one gate per row)."""
    n = x.shape[-1]
    if gate.shape[:-1] != x.shape[:-1] or gate.shape[-1] not in (n, 1):
        raise ValueError(f"gate of shape {tuple(gate.shape)} does not gate x of shape {tuple(x.shape)}")
    x2 = x.reshape(-1, n)
    g2 = gate.reshape(-1, gate.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if gate.shape[-1] == 1:
        return x2, g2, 0
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    return x2, g2, 1


def sigmoid_gate_triton(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate); gate has x's shape (a per-element gate) or x's with last dim 1
    (one gate per row, as a Linear to one output gives)."""
    x2, g2, gate_col_stride = gate_rows(x, gate)
    n = x2.shape[-1]
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block = min(triton.next_power_of_2(n), 2048)
        _sigmoid_gate_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, g2, out, n, x2.stride(0), g2.stride(0), gate_col_stride, out.stride(0), BLOCK=block, num_warps=4,
            enable_fp_fusion=True)
    return out.reshape(x.shape)
