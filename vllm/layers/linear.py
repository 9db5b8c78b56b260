"""Linear layers; fused projections (qkv, gate_up) stack several HF projections.

`FusedLinear.shard` is the one definition of where each shard's rows live: the
model's HF-name mapping (`vllm.models.weights`) reads and writes through it.
Models contain no parallelism: tensor parallelism would be applied after build.
"""
from __future__ import annotations

import torch
from torch import nn

from vllm.kernels import ops


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """Several HF projections stacked along the output dim.

    `shard_sizes` maps a shard id (e.g. "q", "k", "v" or 0, 1) to its output rows,
    in stacking order.
    """

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, dtype=dtype)
        self.shard_offsets: dict = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def shard(self, tensor: torch.Tensor, shard_id) -> torch.Tensor:
        """The rows of `tensor` (this layer's weight or bias, or its gradient) that hold
        shard `shard_id`: a view, so writing into it writes the parameter."""
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard_id]
        return tensor.narrow(0, offset, size)
