"""Gates: SwiGLU's activation (used by the MLP) and the sigmoid output gate (Qwen3-Next's
gated attention and shared expert); relu^2 (Nemotron-H's MLP)."""
from __future__ import annotations

import torch
from torch import nn

from vllm.kernels import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)


class SigmoidGate(nn.Module):
    """x * sigmoid(gate); gate of x's shape, or [.., 1] for one gate per row."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.sigmoid_gate(x, gate)


class ReluSquared(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.relu_squared(x)
