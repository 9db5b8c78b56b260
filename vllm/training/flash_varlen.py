"""The baseline a user compares the trainer against: the same model class in
`fast` mode with torch's flash varlen attention (which has its own backward).
Used by benchmarks/train_step.py; no parity promise."""
from __future__ import annotations

import torch


class FlashVarlenBackend:
    def __init__(self, seq_lens: list[int], device):
        cu = [0]
        for n in seq_lens:
            cu.append(cu[-1] + n)
        self.cu = torch.tensor(cu, dtype=torch.int32, device=device)
        self.max_len = max(seq_lens)
        from torch.nn.attention.varlen import varlen_attn
        self.varlen = varlen_attn

    def forward(self, layer_idx, q, k, v, scale):
        return self.varlen(q, k, v, self.cu, self.cu, self.max_len, self.max_len, scale=scale, window_size=(-1, 0))
