"""Attention layer: projections live in the model; this layer only hands q/k/v to
the backend in the forward context (the worker's paged-KV backend during
rollout, the trainer's packed-sequence backend during training), and declares the
cache it needs (`kv_cache_spec`), from which the worker sizes and allocates the KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.forward_context import get_forward_context


@dataclass(frozen=True)
class PagedKVSpec:
    """A layer's paged K/V cache: per block of tokens, K and V of `num_kv_heads` x `head_dim`
    (in the engine's KV format: the model dtype or FP8 with scales), addressed by the
    layer's index in the attention backend."""
    layer_idx: int
    num_kv_heads: int
    head_dim: int


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def kv_cache_spec(self) -> PagedKVSpec:
        return PagedKVSpec(self.layer_idx, self.num_kv_heads, self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        backend = get_forward_context().attention
        if backend is None:
            raise RuntimeError("the forward context has no attention backend")
        return backend.forward(self.layer_idx, q, k, v, self.scale)
