"""Backward kernels (GPU) of the fused elementwise ops in vllm/kernels/elementwise.py:
one launch per op instead of a chain of float32 torch ops, a concatenation and casts.

* SiLU-and-mul, x = [g | u], y = silu(g) * u:
  dg = dy * u * s * (1 + g * (1 - s)), du = dy * g * s, s = sigmoid(g), in float32,
  written into one [.., 2I] gradient (no torch.cat).
* RoPE: rotation by angle a per (position, frequency) is orthogonal, so its adjoint is
  the rotation by -a: the forward kernel itself with sin negated,
  (d1 c + d2 s, d2 c - d1 s); dims a partial rope passes through pass their gradient through.
* Sigmoid gate, y = x * s, s = sigmoid(g): dx = dy * s, dg = dy * x * s * (1 - s), in float32
  (summed over the row where one gate serves the whole row).

Gradients need not be batch-invariant; references: float64 autograd
(tests/test_training_kernels.py on CPU through TRITON_INTERPRET=1, tests/test_gpu_training.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.elementwise import gate_rows, rope_one_triton


@triton.jit
def _silu_mul_bwd_kernel(x_ptr, dy_ptr, dx_ptr, n_cols, stride_x, stride_dy, stride_dx, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    tl.store(dx_ptr + row * stride_dx + cols, dg.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + row * stride_dx + n_cols + cols, du.to(dx_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_backward(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx [.., 2I] (x's dtype) of y = silu(x[.., :I]) * x[.., I:] for the upstream dy [.., I]."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    dy2 = dy.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    dx = torch.empty((x2.shape[0], 2 * n), dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block = min(triton.next_power_of_2(n), 2048)
        _silu_mul_bwd_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, dy2, dx, n, x2.stride(0), dy2.stride(0), dx.stride(0), BLOCK=block, num_warps=4, enable_fp_fusion=True)
    return dx.reshape(x.shape)


def rope_backward(dq: torch.Tensor | None, dk: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor):
    """(dq_in, dk_in): the adjoint of the neox rotation, i.e. the forward rotation with -sin.
    dq [T, Hq, D], dk [T, Hk, D]; cos/sin [T, D/2] float32 as in the forward."""
    cos, neg_sin = cos.contiguous(), (-sin).contiguous()

    def one(d):
        if d is None:
            return None
        if d.stride(-1) != 1:
            d = d.contiguous()
        return rope_one_triton(d, cos, neg_sin)
    return one(dq), one(dk)


@triton.jit
def _sigmoid_gate_bwd_kernel(x_ptr, g_ptr, dy_ptr, dx_ptr, dg_ptr, n_cols, stride_x, stride_g, stride_gc, stride_dy,
                             stride_dx, stride_dg, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols * stride_gc, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(dx_ptr + row * stride_dx + cols, (dy * s).to(dx_ptr.dtype.element_ty), mask=mask)
    # per element, in float32 (a per-row gate sums these afterwards)
    tl.store(dg_ptr + row * stride_dg + cols, dy * x * s * (1.0 - s), mask=mask)


def sigmoid_gate_backward(x: torch.Tensor, gate: torch.Tensor, dy: torch.Tensor, need_dx: bool = True,
                          need_dgate: bool = True):
    """(dx, dgate) of y = x * sigmoid(gate) for the upstream dy (x's shape); dgate has
    gate's shape and dtype (a per-row gate [.., 1] gets its row's sum)."""
    x2, g2, gate_col_stride = gate_rows(x, gate)
    n = x2.shape[-1]
    dy2 = dy.reshape(-1, n)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    dg = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0] and n:
        block = min(triton.next_power_of_2(n), 2048)
        _sigmoid_gate_bwd_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, g2, dy2, dx, dg, n, x2.stride(0), g2.stride(0), gate_col_stride, dy2.stride(0), dx.stride(0),
            dg.stride(0), BLOCK=block, num_warps=4, enable_fp_fusion=True)
    if gate_col_stride == 0:
        dg = dg.sum(-1, keepdim=True)
    return (dx.reshape(x.shape) if need_dx else None), (dg.to(gate.dtype).reshape(gate.shape) if need_dgate else None)
