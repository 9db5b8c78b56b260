"""Row-wise kernels with a fixed reduction order: RMSNorm (optionally fused with
the residual add) and log-softmax.

One program owns one row and reduces it in chunks of a BLOCK fixed by the row
length only, accumulating a per-lane float32 vector that is summed once at the
end: the order depends on the row length, never on how many rows there are or
where a row sits in the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _block(n: int, cap: int = 8192) -> int:
    return min(triton.next_power_of_2(n), cap)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            # the residual sum is rounded to the model dtype, exactly as `x + residual` in torch
            x = (x + r).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
            x = x.to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        if HAS_RES:
            x = tl.load(res_out_ptr + row * stride_ro + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # normalised value rounded to the model dtype, then scaled by the weight (HF's two roundings)
        n = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (n * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    shape = x.shape
    H = shape[-1]
    x2 = x.reshape(-1, H)
    out = torch.empty_like(x2)
    rows = x2.shape[0]
    if residual is not None:
        r2 = residual.reshape(-1, H)
        res_out = torch.empty_like(r2)
    else:
        r2, res_out = x2, out
    if rows:
        BLOCK = _block(H)
        _rms_norm_kernel[(rows,)](x2, r2, weight, out, res_out, H, eps,
                                  x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
                                  HAS_RES=residual is not None, BLOCK=BLOCK, num_warps=4 if BLOCK <= 1024 else 8)
    if residual is not None:
        return out.reshape(shape), res_out.reshape(shape)
    return out.reshape(shape)


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, temp_ptr, V, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + row)
    # pass 1: max (exact: max is order independent)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temp
        m = tl.maximum(m, x)
    mx = tl.max(m, axis=0)
    # pass 2: sum of exp in chunk order, per lane, then one tree sum of fixed shape
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temp
        s += tl.exp(x - mx)
    lse = mx + tl.log(tl.sum(s, axis=0))
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=0.0).to(tl.float32) / temp
        tl.store(out_ptr + row * stride_o + cols, x - lse, mask=cols < V)


def log_softmax_triton(x: torch.Tensor, temperature: torch.Tensor | float = 1.0) -> torch.Tensor:
    """float32 log_softmax(x / temperature) over the last dim, one program per row.

    `temperature` is a float or a per-row float32 tensor (rows with 0 must be given 1 by the caller).
    """
    V = x.shape[-1]
    x2 = x.reshape(-1, V)
    rows = x2.shape[0]
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if not torch.is_tensor(temperature):
        temperature = torch.full((rows,), float(temperature), dtype=torch.float32, device=x.device)
    temperature = temperature.to(torch.float32).contiguous()
    if rows:
        _log_softmax_kernel[(rows,)](x2, out, temperature, V, x2.stride(0), out.stride(0),
                                            BLOCK=_block(V, 4096), num_warps=8)
    return out.reshape(x.shape)
