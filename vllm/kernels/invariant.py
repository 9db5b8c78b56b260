"""Registers the `invariant` numerics mode's kernels into the op shim.

GPU: Triton kernels whose reduction order is fixed by the problem's K / row
length alone (matmul.py, rowwise.py, attention.py).
CPU: the same contract with torch, by construction: every reduction runs on
one row at a time, on a fresh contiguous copy, with an identical shape, so the
library picks the same code path and order whatever the batch looked like.
That is slow but exact; CPU is for tests and tiny models.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.kernels import ops

KERNEL_VERSION = "invariant-v1"


def _rows(fn, x: torch.Tensor, *args) -> torch.Tensor:
    """Apply fn to each row of x ([..., D]) separately, each as a fresh [1, D] tensor."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        probe = fn(x2[:0].clone(), *args)
        return probe.reshape(*lead, probe.shape[-1])
    outs = [fn(x2[i:i + 1].clone(), *args) for i in range(x2.shape[0])]
    out = torch.cat(outs, dim=0)
    return out.reshape(*lead, out.shape[-1])


# ---- CPU -------------------------------------------------------------------------------
def _linear_cpu(x, weight, bias=None):
    return _rows(lambda r: F.linear(r, weight, bias), x)


def _rms_norm_cpu(x, weight, eps):
    def one(r):
        rf = r.float()
        var = rf.pow(2).mean(-1, keepdim=True)
        return weight * (rf * torch.rsqrt(var + eps)).to(r.dtype)
    return _rows(one, x)


def _add_rms_norm_cpu(x, residual, weight, eps):
    residual = x + residual  # elementwise: invariant
    return _rms_norm_cpu(residual, weight, eps), residual


def _logits_cpu(hidden, weight):
    return _rows(lambda r: F.linear(r.float(), weight.float()), hidden)


# ---- GPU -------------------------------------------------------------------------------
def _linear_gpu(x, weight, bias=None):
    from vllm.kernels.matmul import invariant_matmul
    return invariant_matmul(x, weight, bias)


def _rms_norm_gpu(x, weight, eps):
    from vllm.kernels.rowwise import rms_norm_triton
    return rms_norm_triton(x, weight, eps)


def _add_rms_norm_gpu(x, residual, weight, eps):
    from vllm.kernels.rowwise import rms_norm_triton
    return rms_norm_triton(x, weight, eps, residual=residual)


def _logits_gpu(hidden, weight):
    from vllm.kernels.matmul import invariant_matmul
    return invariant_matmul(hidden, weight, out_dtype=torch.float32)


def _on(dev_fn_cpu, dev_fn_gpu):
    def dispatch(x, *args):
        return (dev_fn_gpu if x.is_cuda else dev_fn_cpu)(x, *args)
    return dispatch


def register() -> None:
    ops.register_invariant("linear", _on(_linear_cpu, _linear_gpu))
    ops.register_invariant("rms_norm", _on(_rms_norm_cpu, _rms_norm_gpu))
    ops.register_invariant("add_rms_norm", _on(_add_rms_norm_cpu, _add_rms_norm_gpu))
    ops.register_invariant("logits", _on(_logits_cpu, _logits_gpu))
    # Elementwise ops compute every element on its own: their bits cannot depend
    # on the batch, so the fast implementations are already invariant.
    ops.register_invariant("silu_and_mul", lambda x: ops._silu_and_mul_fast(x))
    ops.register_invariant("rope", ops._rope_fast)


register()
