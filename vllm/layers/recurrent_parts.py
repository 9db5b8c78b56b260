"""What the recurrent mixers (Gated DeltaNet: gated_deltanet.py; Mamba-2: mamba2.py) share
around their kernels: the parameters of the causal conv and of the gated norm under
transformers' names, and the step's state they read and write."""
from __future__ import annotations

import torch
from torch import nn

from vllm.forward_context import StateMetadata, get_forward_context


class Conv1dParams(nn.Module):
    """`conv1d.weight` [channels, 1, W] (and `conv1d.bias` [channels] with `bias`) under
    transformers' names (a depthwise nn.Conv1d there); the conv itself is ops.causal_conv1d."""

    def __init__(self, channels: int, width: int, bias: bool, dtype: torch.dtype | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width, dtype=dtype), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(channels, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)


class NormParams(nn.Module):
    """`norm.weight` [dim] and the eps of a gated RMSNorm applied by an op."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)


def step_state(state_idx: int) -> tuple[StateMetadata, dict[str, torch.Tensor] | None]:
    """The step's sequences and the layer's cache tensors (None: no cache, the trainer) from
    the forward context's state backend."""
    state = get_forward_context().state
    if state is None:
        raise RuntimeError("the forward context has no state backend (a recurrent layer needs one)")
    return state.metadata, state.layer(state_idx)
