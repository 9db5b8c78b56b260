"""FP8 KV cache read: the blocks a step's sequences use, dequantized into a model-dtype copy.

Every attention read of an FP8 cache goes through this op and then through the same
attention kernel a model-dtype cache uses (the one the trainer runs on its private FP8
copy, `vllm.kernels.fp8.kv_round_trip`). So prefill, chunked prefill, decode, prefix-cache
hits and the trainer see the same model-dtype K/V and run the same arithmetic on them.

Dequantizing inside the attention kernel instead (fp8 tile -> fp32 * scale -> bf16 in
registers, then the dots) gave the same values but not the same bits across tile heights:
at head_dim 128 on the H200, a decode or a 7-token chunk of an FP8 cache differed from the
full prefill's row in 13 of 47 and 185 of 600 rows, while the same kernel over a bf16
cache holding the dequantized values differed in none (docs/fp8.md).

The copy is one layer's K and V in the model dtype, `[blocks, block_size, kv heads,
head_dim]`, shared by all layers and indexed by the same block ids as the cache, so the
attention call keeps the step's block table. Only blocks below each sequence's length are
written; a block shared by several sequences (a prefix-cache hit) is written with the same
values by each. The formula is `vllm.kernels.fp8.dequantize_kv`'s: fp8 -> float32, times the
float32 scale, one rounding to the model dtype (elementwise: no batch can reach its bits).
"""
from __future__ import annotations

import torch

from vllm.kernels.fp8 import dequantize_kv

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU machines without triton
    HAS_TRITON = False

# Programs per step ~ this many per sequence-split; rows of one block handled per iteration.
TARGET_PROGRAMS = 528  # 4 per SM on an H200 (132 SMs)
ROW_TILE = 32


def _check(k_cache, v_cache, k_scale, v_scale, k_out, v_out) -> None:
    if k_cache.shape != v_cache.shape or k_out.shape != k_cache.shape or v_out.shape != k_cache.shape:
        raise ValueError("FP8 caches and their model-dtype copies must share one shape [blocks, block_size, heads, D]")
    if k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_cache.shape[:3]:
        raise ValueError("k_scale/v_scale must be [blocks, block_size, kv heads]")
    if not all(t.is_contiguous() for t in (k_cache, v_cache, k_scale, v_scale, k_out, v_out)):
        raise ValueError("FP8 caches, scales and copies must be contiguous")


def dequant_kv_blocks_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                          k_out: torch.Tensor, v_out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          max_seq_len: int | None = None) -> None:
    """Reference (and the CPU op): every block a sequence uses below its length, dequantized
    with `fp8.dequantize_kv` into the same block of k_out / v_out. Host-syncs on seq_lens."""
    del max_seq_len
    _check(k_cache, v_cache, k_scale, v_scale, k_out, v_out)
    bs = k_cache.shape[1]
    n_blocks = (seq_lens.long() + bs - 1) // bs
    width = block_table.shape[1]
    used = torch.arange(width, device=block_table.device)[None, :] < n_blocks[:block_table.shape[0], None]
    blocks = torch.unique(block_table[:seq_lens.shape[0]][used[:seq_lens.shape[0]]].long())
    if blocks.numel() == 0:
        return
    k_out[blocks] = dequantize_kv(k_cache[blocks], k_scale[blocks], k_out.dtype)
    v_out[blocks] = dequantize_kv(v_cache[blocks], v_scale[blocks], v_out.dtype)


if HAS_TRITON:
    @triton.jit
    def _dequant_blocks_kernel(kc_ptr, vc_ptr, ks_ptr, vs_ptr, ko_ptr, vo_ptr, bt_ptr, seqlen_ptr,
                               stride_bt, n_split,
                               BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               ROW_TILE: tl.constexpr):
        """Program (sequence, j) dequantizes the sequence's blocks j, j + n_split, ...; a block
        is ROWS = block_size * kv_heads rows of HEAD_DIM values with one scale per row."""
        seq = tl.program_id(0)
        j = tl.program_id(1)
        seq_len = tl.load(seqlen_ptr + seq)
        n_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        offs_r = tl.arange(0, ROW_TILE)
        offs_d = tl.arange(0, HEAD_DIM)
        for i in range(j, n_blocks, n_split):
            blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + i).to(tl.int64)
            for r0 in range(0, ROWS, ROW_TILE):
                rows = r0 + offs_r
                ok = rows < ROWS
                row = blk * ROWS + rows
                idx = row[:, None] * HEAD_DIM + offs_d[None, :]
                ks = tl.load(ks_ptr + row, mask=ok, other=1.0)
                vs = tl.load(vs_ptr + row, mask=ok, other=1.0)
                k = tl.load(kc_ptr + idx, mask=ok[:, None], other=0.0)
                v = tl.load(vc_ptr + idx, mask=ok[:, None], other=0.0)
                tl.store(ko_ptr + idx, (k.to(tl.float32) * ks[:, None]).to(ko_ptr.dtype.element_ty), mask=ok[:, None])
                tl.store(vo_ptr + idx, (v.to(tl.float32) * vs[:, None]).to(vo_ptr.dtype.element_ty), mask=ok[:, None])


def dequant_kv_blocks_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                             v_scale: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
                             block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int) -> None:
    """The Triton op (CUDA, or CPU under TRITON_INTERPRET=1 in tests): no host sync; the grid
    depends on the batch's shape (sequences, `max_seq_len`, a host bound) only, so a CUDA
    graph captures it."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    _check(k_cache, v_cache, k_scale, v_scale, k_out, v_out)
    num_seqs = seq_lens.shape[0]
    nb, bs, heads, d = k_cache.shape
    if num_seqs == 0 or max_seq_len <= 0:
        return
    if d & (d - 1) or block_table.stride(-1) != 1:
        raise ValueError("dequant_kv_blocks_triton: power-of-two head_dim and a row-contiguous block table")
    max_blocks = -(-max_seq_len // bs)
    n_split = max(1, min(max_blocks, -(-TARGET_PROGRAMS // num_seqs)))
    _dequant_blocks_kernel[(num_seqs, n_split)](
        k_cache, v_cache, k_scale, v_scale, k_out, v_out, block_table, seq_lens,
        block_table.stride(0), n_split,
        BLOCK_SIZE=bs, ROWS=bs * heads, HEAD_DIM=d, ROW_TILE=ROW_TILE, num_warps=4, enable_fp_fusion=True)
