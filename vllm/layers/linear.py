"""Linear layers with weight loaders attached to their parameters.

Fused projections (qkv, gate_up) hold one weight; the loader knows where each
HF shard (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`) goes. Models
contain no parallelism: tensor parallelism would be applied after build.
"""
from __future__ import annotations

import torch
from torch import nn

from vllm.kernels import ops


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """Several HF projections stacked along the output dim, loaded shard by shard.

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
        self.weight.weight_loader = self._load_shard
        if self.bias is not None:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard_id]
        target = param.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch for shard {shard_id!r}: expected {tuple(target.shape)}, got {tuple(loaded.shape)}")
        with torch.no_grad():
            target.copy_(loaded)

    def split_shards(self, tensor: torch.Tensor) -> dict:
        """Inverse of loading: the fused parameter back into HF shards (for save_pretrained)."""
        return {sid: tensor.narrow(0, off, size) for sid, (off, size) in self.shard_offsets.items()}
