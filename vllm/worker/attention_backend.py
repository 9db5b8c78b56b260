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
    """`k_scales`/`v_scales`: None for a cache in the model dtype; for an FP8 cache, each
    layer's float32 scales [blocks, block_size, kv heads] next to its float8_e4m3fn payload,
    and `dequant`: per layer the (k, v) model-dtype copy [blocks, block_size, kv heads,
    head_dim] its read goes through (layers of one shape share one copy). Every read -- prefill, chunked prefill, decode --
    dequantizes the blocks the step uses into that copy and runs the model-dtype attention
    on it, the kernel the trainer runs on its round-tripped K/V (docs/fp8.md)."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 k_scales: list[torch.Tensor] | None = None, v_scales: list[torch.Tensor] | None = None,
                 dequant: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        if (k_scales is None) != (dequant is None):
            raise ValueError("an FP8 cache needs its scales and a model-dtype dequantization copy")
        self.k_caches, self.v_caches = k_caches, v_caches
        self.k_scales, self.v_scales = k_scales, v_scales
        self.dequant = dequant
        self.metadata: AttentionMetadata | None = None

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        md = self.metadata
        kc, vc = self.k_caches[layer_idx], self.v_caches[layer_idx]
        if self.k_scales is None:
            ops.kv_cache_write(k, v, kc, vc, md.slot_mapping)
            return ops.attention(q, kc, vc, md.block_table, md.cu_seqlens_q, md.seq_lens, scale,
                                 max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
                                 fresh_kv=(k, v) if md.fresh_prefill else None)
        ks, vs = self.k_scales[layer_idx], self.v_scales[layer_idx]
        ops.kv_cache_write_fp8(k, v, kc, vc, ks, vs, md.slot_mapping)
        kd, vd = self.dequant[layer_idx]
        ops.kv_cache_dequant_fp8(kc, vc, ks, vs, kd, vd, md.block_table, md.seq_lens, md.max_seq_len)
        # a kernel on the step's own K/V must see what the cache returns: the round trip
        fresh = (ops.kv_round_trip(k), ops.kv_round_trip(v)) if md.fresh_prefill else None
        return ops.attention(q, kd, vd, md.block_table, md.cu_seqlens_q, md.seq_lens, scale,
                             max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, fresh_kv=fresh)
