"""Optional CUDA ops from csrc/ (built only where nvcc + CUDA torch exist).

Every op has a torch fallback with identical results; `HAS_C` says whether the
compiled extension is loaded. The engine uses it only with VLLM_PARITY_USE_C=1:
on CUDA the Triton KV write (vllm/kernels/cache_write.py) is the default and
needs no build.
"""
from __future__ import annotations

import os

import torch

from vllm.kernels.cache_write import cache_kv_ref, cache_kv_triton, triton_supports

try:
    import vllm._C  # noqa: F401  (registers torch.ops.vllm_parity.*)
    HAS_C = hasattr(torch.ops, "vllm_parity") and hasattr(torch.ops.vllm_parity, "cache_kv")
except ImportError:
    HAS_C = False
USE_C = HAS_C and os.environ.get("VLLM_PARITY_USE_C") == "1"
USE_TRITON_WRITE = os.environ.get("VLLM_PARITY_TRITON_KV_WRITE", "1") == "1"


def cache_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter this step's K/V rows into their paged-cache slots (in place).

    A copy with no arithmetic: every path below puts the same values in the same places."""
    if USE_C and k.is_cuda and k.dtype == k_cache.dtype and k.stride(-1) == 1 and v.stride(-1) == 1 \
            and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2] \
            and k_cache.is_contiguous() and v_cache.is_contiguous():
        torch.ops.vllm_parity.cache_kv(k, v, k_cache, v_cache, slots)
        return
    if k.is_cuda and USE_TRITON_WRITE and triton_supports(k, v, k_cache, v_cache):
        cache_kv_triton(k, v, k_cache, v_cache, slots)
        return
    cache_kv_ref(k, v, k_cache, v_cache, slots)
