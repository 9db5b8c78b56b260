"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): projections, a causal depthwise
conv over q/k/v with a cached window, the gated delta rule with a recurrent state per
sequence, and a gated RMSNorm.

The layer declares its cache (`cache_spec`): per sequence slot a conv window, the matrix
state and, in the invariant mode, the rows of the partial chunk. Its numerics are the
chunked form everywhere in that mode (docs/hybrid.md): prefill, training and decode all
compute a chunk of C rows from the state at the chunk's first row, on the absolute C grid
of the sequence, by the same kernels; a decode step computes the new row of its partial
chunk from the rows it kept (and their rows of T and v_new). The fast mode is the native
form: chunked prefill, fused recurrent decode.

Parameters keep transformers' names and layouts: `in_proj_qkvz` / `in_proj_ba` (Qwen3-Next:
rows grouped per key head: q, k, then the value and z rows of its value heads; b, a per
key head) or `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` (Qwen3.5: q of all
heads, k, v), `conv1d.weight` [conv_dim, 1, W], `dt_bias`, `A_log`, `norm.weight`, `out_proj`.
"""
from __future__ import annotations

import torch
from torch import nn

from vllm.kernels import ops
from vllm.kernels.chunk_scan import ROUNDED_STATE
from vllm.layers.cache_spec import RecurrentStateSpec, StateTensor
from vllm.layers.linear import Linear
from vllm.layers.recurrent_parts import Conv1dParams, NormParams, step_state

# The chunk of the chunked form, and so the grid of the invariant mode's states (a
# prefix-cache snapshot is taken only at multiples of it): the execution contract names it.
GDN_CHUNK_SIZE = 64


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, rms_norm_eps: float, state_idx: int, split_projections: bool = False,
                 dtype: torch.dtype | None = None):
        """`state_idx`: the layer's index among the model's recurrent layers (its state in the
        state backend). `split_projections`: Qwen3.5's four input projections instead of
        Qwen3-Next's two grouped ones."""
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} must be a multiple of linear_num_key_heads={num_k_heads}")
        self.state_idx = state_idx
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.scale = head_k_dim ** -0.5
        self.split_projections = split_projections
        if split_projections:
            self.in_proj_qkv = Linear(hidden_size, self.conv_dim, dtype=dtype)
            self.in_proj_z = Linear(hidden_size, self.value_dim, dtype=dtype)
            self.in_proj_b = Linear(hidden_size, num_v_heads, dtype=dtype)
            self.in_proj_a = Linear(hidden_size, num_v_heads, dtype=dtype)
        else:
            self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, dtype=dtype)
            self.in_proj_ba = Linear(hidden_size, 2 * num_v_heads, dtype=dtype)
        self.conv1d = Conv1dParams(self.conv_dim, conv_kernel, bias=False, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(num_v_heads, dtype=dtype), requires_grad=False)
        self.norm = NormParams(head_v_dim, rms_norm_eps, dtype)
        self.out_proj = Linear(self.value_dim, hidden_size, dtype=dtype)

    def cache_spec(self, numerics: str) -> RecurrentStateSpec:
        C = GDN_CHUNK_SIZE
        tensors = [StateTensor("conv", (self.conv_kernel - 1, self.conv_dim)),
                   StateTensor("ssm", (self.hv, self.dk, self.dv), torch.float32)]
        if numerics == "invariant":
            # the rows of the partial chunk, which a later step of the chunk recomputes from
            tensors += [StateTensor("buf_k", (C, self.hk, self.dk)), StateTensor("buf_v", (C, self.hv, self.dv)),
                        StateTensor("buf_g", (C, self.hv), torch.float32),
                        StateTensor("buf_beta", (C, self.hv), torch.float32),
                        # the partial chunk's rows of T = (I + A)^-1 and of v_new, so a decode
                        # step solves only its 16-row block row of T and computes its new rows
                        # of v_new (gdn_chunk.DECODE_CACHE);
                        # a snapshot, at a multiple of C, has no partial chunk to keep
                        StateTensor("t_cache", (self.hv, C, C), torch.float32),
                        StateTensor("t_pos", (self.hv,), torch.int32),
                        StateTensor("buf_vn", (C, self.hv, self.dv)),
                        # the state rounded to the model dtype, which decode steps read
                        StateTensor(ROUNDED_STATE, (self.hv, self.dk, self.dv))]
        snapshot = ("conv", "ssm", ROUNDED_STATE) if numerics == "invariant" else ("conv", "ssm")
        return RecurrentStateSpec(self.state_idx, "gated_deltanet", tuple(tensors), C, snapshot=snapshot)

    def _project(self, x: torch.Tensor):
        """(mixed q|k|v [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]) in transformers' order."""
        T = x.shape[0]
        if self.split_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(T, self.hv, self.dv),
                    self.in_proj_b(x), self.in_proj_a(x))
        r = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(T, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        ba = self.in_proj_ba(x).view(T, self.hk, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(T, self.key_dim), k.reshape(T, self.key_dim), v.reshape(T, self.value_dim)), dim=-1)
        return mixed, z.reshape(T, self.hv, self.dv), b.reshape(T, self.hv), a.reshape(T, self.hv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        md, cache = step_state(self.state_idx)
        T = x.shape[0]
        mixed, z, b, a = self._project(x)
        conv_w = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        y = ops.causal_conv1d(mixed, conv_w, md, None if cache is None else cache["conv"])
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, g, beta = ops.gdn_gating(q.view(T, self.hk, self.dk), k.view(T, self.hk, self.dk), a, b,
                                       self.A_log, self.dt_bias)
        o = ops.gated_delta_rule(q, k, v.reshape(T, self.hv, self.dv), g, beta, self.scale, md, cache,
                                 chunk_size=GDN_CHUNK_SIZE)
        o = ops.rms_norm_gated(o, z, self.norm.weight, self.norm.eps)  # [T, Hv, Dv] views, read in place
        return self.out_proj(o.reshape(T, self.value_dim))
