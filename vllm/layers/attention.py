"""Attention layer: projections live in the model; this layer only hands q/k/v to
the backend in the forward context (the worker's paged-KV backend during
rollout, the trainer's packed-sequence backend during training), and declares the
cache it needs (`cache_spec`), from which the worker sizes and allocates the KV cache."""
from __future__ import annotations

import torch
from torch import nn

from vllm.forward_context import get_forward_context
from vllm.layers.cache_spec import PagedKVSpec


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def cache_spec(self, numerics: str = "invariant") -> PagedKVSpec:
        """`layer_idx` is the layer's index among the model's attention layers."""
        return PagedKVSpec(self.layer_idx, self.num_kv_heads, self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        backend = get_forward_context().attention
        if backend is None:
            raise RuntimeError("the forward context has no attention backend")
        return backend.forward(self.layer_idx, q, k, v, self.scale)
