"""Fused elementwise kernels (GPU): rotary embedding for q and k in one launch,
and SiLU-and-mul. Every output element is computed from its own inputs only,
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
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
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


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    T, H, D = x.shape
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    block_h = min(triton.next_power_of_2(H), 16)
    _rope_kernel[(T, triton.cdiv(H, block_h))](x, out, cos, sin, H, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                                               cos.stride(0), HALF=D // 2, BLOCK_H=block_h, num_warps=4)
    return out


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hk, D] (last dim contiguous), cos/sin [T, D/2] float32."""
    cos, sin = cos.contiguous(), sin.contiguous()
    return _rope_launch(q, cos, sin), _rope_launch(k, cos, sin)


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
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, n, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.reshape(*x.shape[:-1], n)
