"""torch's flash varlen attention on a step's own q, k, v.

Fast mode's prefill on CUDA when no sequence of the step has cached context: the
baseline's fastest prefill. Its bits differ from the paged kernel's single-query decode
(measured on the H200), which is why invariant mode never takes it
(vllm/kernels/numerics_table.py).
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
        return varlen_attn
    except ImportError:
        return None


def flash_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int, scale: float) -> torch.Tensor | None:
    """Causal attention over packed sequences that each start at position 0; q [T, Hq, D],
    k/v [T, Hkv, D], cu_seqlens [S+1] int32. None where it does not apply (not bf16/fp16,
    not CUDA, or this torch has no varlen attention): the caller then runs the paged kernel."""
    varlen = _varlen_attn()
    if varlen is None or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    return varlen(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, window_size=(-1, 0))
