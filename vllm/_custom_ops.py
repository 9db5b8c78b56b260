"""Optional CUDA ops from csrc/ (built only where nvcc + CUDA torch exist).

Every op has a torch fallback with identical results; `HAS_C` says whether the
compiled extension is loaded. The engine uses it only with VLLM_PARITY_USE_C=1
until tests/test_custom_ops.py has passed on the H200 (it has not been run
there yet).
"""
from __future__ import annotations

import os

import torch

try:
    import vllm._C  # noqa: F401  (registers torch.ops.vllm_parity.*)
    HAS_C = hasattr(torch.ops, "vllm_parity") and hasattr(torch.ops.vllm_parity, "cache_kv")
except ImportError:
    HAS_C = False
USE_C = HAS_C and os.environ.get("VLLM_PARITY_USE_C") == "1"


def cache_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter this step's K/V rows into their paged-cache slots (in place)."""
    if USE_C and k.is_cuda and k.dtype == k_cache.dtype and k.stride(-1) == 1 and v.stride(-1) == 1 \
            and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]:
        torch.ops.vllm_parity.cache_kv(k, v, k_cache, v_cache, slots)
        return
    k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1]).index_copy_(0, slots, v.to(v_cache.dtype))
