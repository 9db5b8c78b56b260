"""RMSNorm backward on the GPU: two Triton kernels instead of a dozen float32 torch
ops per norm (each a full pass over the activations, several of them broadcasts).

Forward (vllm/kernels/rowwise.py): y = w * round(x * rstd), rstd = 1 / sqrt(mean(x^2) + eps).
Backward of the unrounded formula, with g = dy * w:

    dx = rstd * g - x * rstd^3 * sum(g * x) / H      (+ dres, the residual stream's own gradient)
    dw = sum over rows of dy * x * rstd

The zero-centred norm (y = round((x * rstd) * (1 + w))) is the same formula with 1 + w in
place of w in g; its dw is unchanged (`zero_centred=True`).

`_rms_norm_dx_kernel` reads each row twice (statistics, then dx) and writes dx and
rstd; `_rms_norm_dw_kernel` reduces dy * x * rstd over row ranges into float32
partials that one small sum finishes. All arithmetic is float32. Gradients need not be
batch-invariant (only forward logprobs must match the rollout), so nothing here is
part of the numerical contract; the reference is float64 autograd
(tests/test_training_kernels.py, tests/test_gpu_training.py).

Rows are addressed as (r // INNER) * stride_outer + (r % INNER) * stride_inner, so the
per-head q/k norms read their [T, heads, D] inputs in place (a strided view of the
fused qkv output) without a copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_offsets(rows, INNER, stride_outer, stride_inner):
    r = rows.to(tl.int64)
    return (r // INNER) * stride_outer + (r % INNER) * stride_inner


@triton.jit
def _rms_norm_dx_kernel(x_ptr, w_ptr, dy_ptr, dres_ptr, dx_ptr, rstd_ptr, R, H, eps,
                        X_INNER, sx_outer, sx_inner, DY_INNER, sdy_outer, sdy_inner,
                        DRES_INNER, sdres_outer, sdres_inner,
                        HAS_DRES: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    x_row = _row_offsets(rows, X_INNER, sx_outer, sx_inner)
    dy_row = _row_offsets(rows, DY_INNER, sdy_outer, sdy_inner)
    sq = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    gx = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_ok = cols < H
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + dy_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if ZERO_CENTRED:
            w = w + 1.0
        sq += x * x
        gx += dy * w[None, :] * x
    rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / H + eps)
    coef = tl.sum(gx, axis=1) * rstd * rstd * rstd / H
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    out_row = rows.to(tl.int64) * H  # dx is allocated contiguous [R, H]
    if HAS_DRES:
        dres_row = _row_offsets(rows, DRES_INNER, sdres_outer, sdres_inner)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_ok = cols < H
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + dy_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if ZERO_CENTRED:
            w = w + 1.0
        dx = rstd[:, None] * (dy * w[None, :]) - x * coef[:, None]
        if HAS_DRES:
            dx += tl.load(dres_ptr + dres_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(dx_ptr + out_row[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_dw_kernel(x_ptr, dy_ptr, rstd_ptr, part_ptr, R, H, ROWS_PER_PROGRAM,
                        X_INNER, sx_outer, sx_inner, DY_INNER, sdy_outer, sdy_inner,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """part[s, cols] = sum over rows [s * ROWS_PER_PROGRAM, (s + 1) * ROWS_PER_PROGRAM) of dy * x * rstd."""
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    s = tl.program_id(1)
    first = s * ROWS_PER_PROGRAM
    acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for r0 in range(first, first + ROWS_PER_PROGRAM, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        ok = row_ok[:, None] & col_ok[None, :]
        x_row = _row_offsets(rows, X_INNER, sx_outer, sx_inner)
        dy_row = _row_offsets(rows, DY_INNER, sdy_outer, sdy_inner)
        x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + dy_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        acc += dy * x * rstd[:, None]
    tl.store(part_ptr + s.to(tl.int64) * H + cols, tl.sum(acc, axis=0), mask=col_ok)


def _rows_view(t: torch.Tensor, H: int) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, inner, stride_outer, stride_inner) addressing t's rows of H elements in place
    where its layout allows (2-D, or 3-D [T, heads, H]), else on a contiguous copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 3:
        return t, t.shape[1], t.stride(0), t.stride(1)
    if t.dim() != 2:
        t = t.reshape(-1, H)
        if t.stride(-1) != 1:
            t = t.contiguous()
    return t, 1, t.stride(0), 0


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


_SM_CACHE: dict = {}


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float,
                      dres: torch.Tensor | None = None, need_dx: bool = True, need_dw: bool = True,
                      zero_centred: bool = False):
    """(dx, dw) of y = rms_norm(x) * w (`zero_centred`: * (1 + w)) for the upstream gradient dy
    (x's shape, last dim H); dres, when given, is added to dx (the fused residual add's second
    gradient). dx has x's dtype and shape, dw the weight's dtype. CUDA tensors, or CPU ones
    under TRITON_INTERPRET=1."""
    H = x.shape[-1]
    shape = x.shape
    R = x.numel() // H if H else 0
    xv, x_inner, sxo, sxi = _rows_view(x, H)
    dyv, dy_inner, sdyo, sdyi = _rows_view(dy, H)
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    dx = torch.empty(shape, dtype=x.dtype, device=x.device) if (need_dx or need_dw) else None
    if R == 0:
        return (dx if need_dx else None), (torch.zeros_like(weight) if need_dw else None)
    # tiles of about 1024 elements per 4 warps (ptxas for sm_90: 64-112 registers, no spills)
    BLOCK_H = min(triton.next_power_of_2(H), 4096)
    BLOCK_R = max(1, 1024 // BLOCK_H)
    warps = 8 if BLOCK_R * BLOCK_H >= 2048 else 4
    if dres is not None:
        dresv, dres_inner, sdro, sdri = _rows_view(dres, H)
    else:
        dresv, dres_inner, sdro, sdri = dyv, 1, 0, 0
    # dx is also what computes rstd, which dw needs: run it even when only dw is wanted
    _rms_norm_dx_kernel[(triton.cdiv(R, BLOCK_R),)](
        xv, weight, dyv, dresv, dx, rstd, R, H, eps,
        x_inner, sxo, sxi, dy_inner, sdyo, sdyi, dres_inner, sdro, sdri,
        HAS_DRES=dres is not None, ZERO_CENTRED=zero_centred, BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H, num_warps=warps,
        enable_fp_fusion=True)
    dw = None
    if need_dw:
        dev = x.device
        if dev not in _SM_CACHE:
            _SM_CACHE[dev] = _num_sms(dev)
        BH = min(triton.next_power_of_2(H), 256)
        BR = max(1, 1024 // BH)
        col_blocks = triton.cdiv(H, BH)
        # enough programs to fill the GPU a few times over; each owns a contiguous row range
        splits = max(1, min(triton.cdiv(R, BR), (4 * _SM_CACHE[dev]) // col_blocks))
        rows_per = triton.cdiv(triton.cdiv(R, splits), BR) * BR
        splits = triton.cdiv(R, rows_per)
        part = torch.empty((splits, H), dtype=torch.float32, device=dev)
        _rms_norm_dw_kernel[(col_blocks, splits)](
            xv, dyv, rstd, part, R, H, rows_per, x_inner, sxo, sxi, dy_inner, sdyo, sdyi,
            BLOCK_R=BR, BLOCK_H=BH, num_warps=4, enable_fp_fusion=True)
        dw = part.sum(0).to(weight.dtype)
    return (dx if need_dx else None), dw
