"""The worker's attention backend: paged KV cache writes + paged attention.

It owns all step-specific state (slot mapping, block tables, sequence bounds),
so the model's Attention layer stays a plain module. The same tensors serve
eager steps and CUDA-graph replays (the runner copies step metadata into them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.forward_context import get_forward_context
from vllm.kernels.attention import paged_attention
from vllm.kernels.cache_write import cache_kv


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: cache slot of each new token (block * block_size + offset)
    block_table: torch.Tensor       # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor      # [S + 1] int32
    seq_lens: torch.Tensor          # [S] int32: context length including this step's tokens
    max_query_len: int
    max_seq_len: int
    # every sequence's slice starts at position 0 (no cached context): fast mode may
    # then use torch's flash varlen attention on the step's own q/k/v
    fresh_prefill: bool = False


def _flash_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
        return varlen_attn
    except ImportError:
        return None


class PagedAttentionBackend:
    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        self.k_caches, self.v_caches = k_caches, v_caches
        self.metadata: AttentionMetadata | None = None
        self.varlen = _flash_varlen() if k_caches[0].is_cuda else None

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        md = self.metadata
        kc, vc = self.k_caches[layer_idx], self.v_caches[layer_idx]
        # KV write: a scatter with no reduction, so identical in every numerics mode
        # (the Triton write on CUDA, index_copy_ elsewhere).
        cache_kv(k, v, kc, vc, md.slot_mapping)
        if (self.varlen is not None and md.fresh_prefill and q.dtype in (torch.bfloat16, torch.float16)
                and get_forward_context().numerics == "fast"):
            # The baseline's fastest prefill. Its bits differ from single-query decode
            # (measured on the H200), which is why invariant mode never takes this path.
            return self.varlen(q, k, v, md.cu_seqlens_q, md.cu_seqlens_q, md.max_query_len, md.max_query_len,
                               scale=scale, window_size=(-1, 0))
        # paged_attention picks the kernel by device; the trainer calls the same function.
        return paged_attention(q, kc, vc, md.block_table, md.cu_seqlens_q, md.seq_lens, scale,
                         max_query_len=md.max_query_len, max_seq_len=md.max_seq_len)
