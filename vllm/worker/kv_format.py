"""What one KV-cache layer stores: the payload dtype and, for an FP8 cache, a scale per
token per kv head, plus the one model-dtype copy of a layer that FP8 reads dequantize into
(vllm/kernels/cache_dequant.py). The one place the runner's allocation, capacity and
sleep/wake sizes come from (docs/kv_cache.md)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn  # the payload of vllm.kernels.fp8's KV rule (the worker reads rules through the op shim)


@dataclass(frozen=True)
class KVFormat:
    model_dtype: torch.dtype
    kv_cache_dtype: str  # "auto" | "fp8" (canonical, vllm.config.check_kv_cache_dtype)

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the K and V payload tensors."""
        return FP8_DTYPE if self.fp8 else self.model_dtype

    def payload_bytes(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one layer's K (or V) payload."""
        return num_blocks * block_size * num_kv_heads * head_dim * torch.empty((), dtype=self.dtype).element_size()

    def scale_bytes(self, num_blocks: int, block_size: int, num_kv_heads: int) -> int:
        """Bytes of one layer's K (or V) scales (float32 per token per kv head; 0 unless fp8)."""
        return num_blocks * block_size * num_kv_heads * 4 if self.fp8 else 0

    def dequant_bytes(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of the model-dtype K (or V) copy an FP8 cache is read through (one layer's
        worth, shared by all layers; 0 unless fp8)."""
        if not self.fp8:
            return 0
        return num_blocks * block_size * num_kv_heads * head_dim * torch.empty((), dtype=self.model_dtype).element_size()

    def bytes_per_block(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of every layer for one block of `block_size` tokens, scales and the FP8
        read copy included."""
        return 2 * (num_layers * (self.payload_bytes(1, block_size, num_kv_heads, head_dim)
                                  + self.scale_bytes(1, block_size, num_kv_heads))
                    + self.dequant_bytes(1, block_size, num_kv_heads, head_dim))

    def capacity_tokens(self, budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int,
                        head_dim: int) -> int:
        """Tokens a KV budget of `budget_bytes` holds (whole blocks)."""
        per_block = self.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim)
        return int(budget_bytes // per_block) * block_size
