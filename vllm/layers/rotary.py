"""Rotary position embedding (neox / rotate-half layout) with optional llama3 or linear scaling,
over the whole head or (partial rope, `rotary_dim` < head_dim) over its first `rotary_dim` dims.

The cos/sin table is a buffer computed once in float32 (so it is the same
whatever dtype the model runs in); lookups by absolute position are gathers.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from vllm.kernels import ops
from vllm.layers.rope_config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths are divided by
        # `factor`, short ones kept, the band in between interpolated smoothly.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling,
                 rotary_dim: int | None = None):
        """`rotary_dim`: how many leading dims of each head rotate (None: all of them); the
        frequencies are those of a head of that size, as transformers computes them."""
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        self.rotary_dim = rotary_dim
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # Not persistent: derived from the config, never loaded from or saved to a checkpoint.
        self.register_buffer("cos_table", freqs.cos(), persistent=False)
        self.register_buffer("sin_table", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_table.index_select(0, positions)
        sin = self.sin_table.index_select(0, positions)
        return ops.apply_rope(q, k, cos, sin)
