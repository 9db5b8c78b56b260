"""The worker's attention backend: paged KV cache writes + paged attention.

It owns all step-specific state (slot mapping, block tables, sequence bounds),
so the model's Attention layer stays a plain module. The same tensors serve
eager steps and CUDA-graph replays (the runner copies step metadata into them).
Which kernels run is the numerics table's choice (vllm/kernels/numerics_table.py),
reached through the op shim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.kernels import ops


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: cache slot of each new token (block * block_size + offset)
    block_table: torch.Tensor       # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor      # [S + 1] int32
    seq_lens: torch.Tensor          # [S] int32: context length including this step's tokens
    max_query_len: int
    max_seq_len: int
    # every sequence's slice starts at position 0 (no cached context): a mode may then
    # compute attention on the step's own q/k/v
    fresh_prefill: bool = False


class PagedAttentionBackend:
    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        self.k_caches, self.v_caches = k_caches, v_caches
        self.metadata: AttentionMetadata | None = None

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        md = self.metadata
        kc, vc = self.k_caches[layer_idx], self.v_caches[layer_idx]
        ops.kv_cache_write(k, v, kc, vc, md.slot_mapping)
        return ops.attention(q, kc, vc, md.block_table, md.cu_seqlens_q, md.seq_lens, scale,
                             max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
                             fresh_kv=(k, v) if md.fresh_prefill else None)
