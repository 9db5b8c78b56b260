"""Mamba-2 mixer (Nemotron-H): one input projection (z | x B C | dt), a causal depthwise conv
(with bias) over x, B, C with a cached window, the selective scan with an fp32 state [heads,
head_dim, d_state] per sequence, a gated RMSNorm whose statistics run over groups, and the
output projection.

The layer declares its cache (`cache_spec`): per sequence slot the conv window, the state and,
in the invariant mode, the rows of the partial chunk (x, B and dt; C of earlier rows is never
needed). Its numerics are the chunked form everywhere in that mode (docs/hybrid.md, "Mamba-2"):
prefill, training and decode all compute a chunk of C rows from the state at the chunk's
first row, on the absolute C grid of the sequence, by one kernel. The fast mode is the native
form: step-grid chunked prefill, the selective state update for decode.

Parameters keep transformers' names and layouts: `in_proj` (rows z, x, B, C, dt),
`conv1d.weight` [conv_dim, 1, W] and `conv1d.bias`, `dt_bias`, `A_log`, `D` [heads],
`norm.weight` [heads * head_dim], `out_proj`.
"""
from __future__ import annotations

import torch
from torch import nn

from vllm.kernels import ops
from vllm.kernels.chunk_scan import ROUNDED_STATE
from vllm.layers.cache_spec import RecurrentStateSpec, StateTensor
from vllm.layers.linear import Linear
from vllm.layers.recurrent_parts import Conv1dParams, NormParams, step_state


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                 conv_kernel: int, chunk_size: int, dt_min: float, norm_eps: float, state_idx: int,
                 use_bias: bool = False, use_conv_bias: bool = True, dtype: torch.dtype | None = None):
        """`state_idx`: the layer's index among the model's recurrent layers (its state in the
        state backend). `chunk_size`: the checkpoint's, the grid of the invariant mode's states.
        `dt_min`: the lower clamp of the time step (config time_step_limit[0])."""
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba_num_heads={num_heads} must be a multiple of n_groups={n_groups}")
        self.state_idx = state_idx
        self.num_heads, self.head_dim, self.n_groups, self.state_size = num_heads, head_dim, n_groups, state_size
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * state_size
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.dt_min = float(dt_min)
        self.in_proj = Linear(hidden_size, self.inner + self.conv_dim + num_heads, bias=use_bias, dtype=dtype)
        self.conv1d = Conv1dParams(self.conv_dim, conv_kernel, bias=use_conv_bias, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.ones(num_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.ones(num_heads, dtype=dtype), requires_grad=False)
        self.norm = NormParams(self.inner, norm_eps, dtype)
        self.out_proj = Linear(self.inner, hidden_size, bias=use_bias, dtype=dtype)

    def cache_spec(self, numerics: str) -> RecurrentStateSpec:
        C, H, P, G, N = self.chunk_size, self.num_heads, self.head_dim, self.n_groups, self.state_size
        tensors = [StateTensor("conv", (self.conv_kernel - 1, self.conv_dim)),
                   StateTensor("ssm", (H, P, N), torch.float32)]
        if numerics == "invariant":
            # the rows of the partial chunk, which a later step of the chunk recomputes from
            tensors += [StateTensor("buf_x", (C, H, P)), StateTensor("buf_B", (C, G, N)),
                        StateTensor("buf_dt", (C, H), torch.float32),
                        # the state rounded to the model dtype, which decode steps read
                        StateTensor(ROUNDED_STATE, (H, P, N))]
        snapshot = ("conv", "ssm", ROUNDED_STATE) if numerics == "invariant" else ("conv", "ssm")
        return RecurrentStateSpec(self.state_idx, "mamba2", tuple(tensors), C, snapshot=snapshot)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        md, cache = step_state(self.state_idx)
        T = hidden.shape[0]
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.state_size
        proj = self.in_proj(hidden)
        z, xbc, dt = proj.split([self.inner, self.conv_dim, H], dim=-1)  # views of one row
        conv_w = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        xbc = ops.causal_conv1d(xbc, conv_w, md, None if cache is None else cache["conv"], self.conv1d.bias)
        x, B, C = xbc.split([self.inner, G * N, G * N], dim=-1)
        y = ops.mamba2_scan(x.view(T, H, P), dt, self.dt_bias, self.A_log, B.view(T, G, N), C.view(T, G, N), self.D,
                            self.dt_min, md, cache, chunk_size=self.chunk_size)
        y = ops.rms_norm_gated_grouped(y.view(T, self.inner), z, self.norm.weight, self.norm.eps, G)
        return self.out_proj(y)
