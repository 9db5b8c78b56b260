"""Row-wise kernel with a fixed reduction order: RMSNorm, optionally fused with
the residual add, in two forms: Llama's `w * round(x * rstd)` and the zero-centred
`round((x * rstd) * (1 + w))` (Qwen3-Next, Qwen3.5: weights stored as offsets from one,
one rounding). (Log-softmax lives with the sampler: vllm/sample/sampler.py,
`batch_invariant_log_softmax`, shared by rollout and trainer.)

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
                     HAS_RES: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr):
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
        if ZERO_CENTRED:
            # (x * rstd) * (1 + w) in float32, rounded once (transformers' Qwen3NextRMSNorm)
            y = (x * rstd) * (1.0 + w)
        else:
            # normalised value rounded to the model dtype, then scaled by the weight (HF's two roundings)
            y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    zero_centred: bool = False):
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
                                  HAS_RES=residual is not None, ZERO_CENTRED=zero_centred, BLOCK=BLOCK,
                                  num_warps=4 if BLOCK <= 1024 else 8, enable_fp_fusion=True)
    if residual is not None:
        return out.reshape(shape), res_out.reshape(shape)
    return out.reshape(shape)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual) in one launch; the sum is rounded to the
    model dtype first, as in torch."""
    return rms_norm_triton(x, weight, eps, residual=residual)


def zero_centred_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(x * rstd) * (1 + w), rounded once to x's dtype."""
    return rms_norm_triton(x, weight, eps, zero_centred=True)


def add_zero_centred_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(zero-centred rms_norm(x + residual), x + residual) in one launch, the sum rounded first."""
    return rms_norm_triton(x, weight, eps, residual=residual, zero_centred=True)
