"""RMSNorm, optionally fused with the residual add that precedes it: Llama's form and the
zero-centred form of Qwen3-Next / Qwen3.5."""
from __future__ import annotations

import torch
from torch import nn

from vllm.kernels import ops


class RMSNorm(nn.Module):
    """y = w * round(x * rstd) (transformers' LlamaRMSNorm: two roundings)."""
    initial_weight = 1.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((hidden_size,), self.initial_weight, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class ZeroCentredRMSNorm(RMSNorm):
    """y = round((x * rstd) * (1 + w)): the weight is stored as its offset from one (zero
    means the identity scale) and the output is rounded once (transformers'
    Qwen3NextRMSNorm / Qwen3_5RMSNorm)."""
    initial_weight = 0.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.zero_centred_rms_norm(x, self.weight, self.eps)
        return ops.add_zero_centred_rms_norm(x, residual, self.weight, self.eps)


def pre_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
    """A pre-norm layer's (normed input, residual stream): norm(x + residual) with the add fused
    into the norm; for the first layer (residual None) norm(x), x starting the stream."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)
