"""Paged KV-cache write: this step's K and V rows scattered into their cache slots.

On CUDA one Triton launch per layer writes both K and V (the torch reference is two
indexed copies, which on the H200 cost ~350 us per layer for a 16k-token prefill chunk
because the strided K/V views are first made contiguous). Elsewhere, and for shapes the
kernel does not take, the torch reference runs. A pure copy: no arithmetic, so it cannot
change a bit in any numerics mode; it only has to put every element where the reference
puts it, which the tests check element for element.

Caches are contiguous [num_blocks, block_size, num_kv_heads, head_dim]; K and V may be
strided views (e.g. slices of a fused qkv output) contiguous in head_dim.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU machines without triton
    HAS_TRITON = False


def cache_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Reference: slot s = block * block_size + offset; row t goes to cache[block, offset],
    one index_copy_ per cache. Slots are >= 0 (the engine sends padding rows to the null
    block 0; the Triton kernel also skips negative slots, a guard the reference does not
    need). No host sync."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("cache_kv_ref: the caches must be contiguous [blocks, block_size, heads, head_dim]")
    k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1]).index_copy_(0, slots, v.to(v_cache.dtype))


if HAS_TRITON:
    @triton.jit
    def _cache_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                         block_size,
                         NUM_HEADS: tl.constexpr, HEADS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // block_size
            off = slot % block_size
            h = tl.arange(0, HEADS_POW2)[:, None]
            d = tl.arange(0, HEAD_DIM)[None, :]
            mask = h < NUM_HEADS
            kv = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
            tl.store(kc_ptr + blk * stride_kcb + off * stride_kct + h * stride_kch + d, kv, mask=mask)
            vv = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
            tl.store(vc_ptr + blk * stride_vcb + off * stride_vct + h * stride_vch + d, vv, mask=mask)


def triton_supports(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Same dtype in and out (no conversion inside the copy), power-of-two head_dim,
    head_dim contiguous everywhere."""
    d = k.shape[-1]
    return (HAS_TRITON and k.dim() == 3 and v.shape == k.shape and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
            and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and d >= 16 and d & (d - 1) == 0
            and k_cache.shape[2:] == k.shape[1:]
            and all(t.stride(-1) == 1 for t in (k, v, k_cache, v_cache)))


def cache_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor) -> None:
    """The Triton write (CUDA, or CPU under TRITON_INTERPRET=1 in tests)."""
    if not triton_supports(k, v, k_cache, v_cache):
        raise ValueError("cache_kv_triton: k/v [T, H, D] and caches [blocks, block_size, H, D] of one dtype, "
                         "power-of-two D, contiguous in D")
    T, H, D = k.shape
    if T == 0:
        return
    _cache_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1],
        NUM_HEADS=H, HEADS_POW2=triton.next_power_of_2(H), HEAD_DIM=D,
        num_warps=4 if H * D >= 1024 else 1, enable_fp_fusion=True)


def cache_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Scatter this step's K/V rows into their paged-cache slots (in place): the Triton
    write on CUDA where it takes the shapes, the reference otherwise (same bytes)."""
    if k.is_cuda and triton_supports(k, v, k_cache, v_cache):
        cache_kv_triton(k, v, k_cache, v_cache, slots)
    else:
        cache_kv_ref(k, v, k_cache, v_cache, slots)


def cache_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor) -> None:
    """FP8 cache write: quantize K/V by the KV rule (vllm/kernels/fp8.py: one float32 scale per
    token per kv head), then copy the payload bytes (as uint8, the same copy as `cache_kv`)
    and the scales [blocks, block_size, heads] into their slots."""
    from vllm.kernels.fp8 import quantize_kv

    kq, ks = quantize_kv(k)
    vq, vs = quantize_kv(v)
    cache_kv(kq.view(torch.uint8), vq.view(torch.uint8), k_cache.view(torch.uint8), v_cache.view(torch.uint8), slots)
    k_scale.view(-1, k_scale.shape[-1]).index_copy_(0, slots, ks)
    v_scale.view(-1, v_scale.shape[-1]).index_copy_(0, slots, vs)
