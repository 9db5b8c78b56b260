"""Gated activation used by the MLP."""
from __future__ import annotations

import torch
from torch import nn

from vllm.kernels import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
