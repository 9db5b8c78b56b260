"""Gradient of token logprobs with respect to the logits, for one block of vocabulary
columns: the elementwise core of the fused logprob head's backward
(vllm/training/logprob_head.py).

For row r with target t_r, upstream gradient g_r, temperature T and the row's
log-sum-exp L_r of logits / T (saved by the forward):

    lp_r = logits[r, t_r] / T - L_r
    d lp_r / d logits[r, j] = (1[j == t_r] - exp(logits[r, j] / T - L_r)) / T

so d[r, j] = g_r / T * (1[j == t_r] - p[r, j]). One pass over the block, written
directly in the dtype the following GEMMs take (bf16 on the GPU). Gradients need not
be batch-invariant, so nothing here is part of the numerical contract; the reference is
float64 autograd (tests/test_logprob_head.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _logprob_grad_kernel(logits_ptr, lse_ptr, tgt_ptr, scale_ptr, d_ptr, n_cols, col0, inv_t,
                         stride_l, stride_d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    target = tl.load(tgt_ptr + row)
    p = tl.exp(x - lse)
    d = tl.where((cols + col0) == target, 1.0 - p, -p) * scale
    tl.store(d_ptr + row * stride_d + cols, d.to(d_ptr.dtype.element_ty), mask=mask)


def logprob_grad_block(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, row_scale: torch.Tensor,
                       col0: int, temperature: float, out_dtype: torch.dtype) -> torch.Tensor:
    """d [R, n] in out_dtype for a block of logits [R, n] holding vocabulary columns
    col0 .. col0 + n: row_scale[r] * (1[col == targets[r]] - exp(logits / T - lse[r])).
    row_scale is g / T. CUDA tensors run the Triton kernel (or CPU ones under
    TRITON_INTERPRET=1 via logprob_grad_block_triton); other CPU tensors the torch formula."""
    if logits.is_cuda:
        return logprob_grad_block_triton(logits, lse, targets, row_scale, col0, temperature, out_dtype)
    return logprob_grad_block_torch(logits, lse, targets, row_scale, col0, temperature, out_dtype)


def logprob_grad_block_torch(logits, lse, targets, row_scale, col0, temperature, out_dtype):
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    d = torch.exp(logits.to(acc) / temperature - lse.to(acc)[:, None]).neg_()
    rows = torch.arange(logits.shape[0], device=logits.device)
    local = targets - col0
    inside = (local >= 0) & (local < logits.shape[1])
    d[rows[inside], local[inside]] += 1.0
    return d.mul_(row_scale.to(acc)[:, None]).to(out_dtype)


def logprob_grad_block_triton(logits, lse, targets, row_scale, col0, temperature, out_dtype):
    R, n = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    d = torch.empty((R, n), dtype=out_dtype, device=logits.device)
    if R and n:
        block = min(triton.next_power_of_2(n), 4096)
        _logprob_grad_kernel[(R, triton.cdiv(n, block))](
            logits, lse.float().contiguous(), targets.contiguous(), row_scale.float().contiguous(), d, n, col0,
            1.0 / temperature, logits.stride(0), d.stride(0), BLOCK=block, num_warps=8 if block >= 2048 else 4,
            enable_fp_fusion=True)
    return d
