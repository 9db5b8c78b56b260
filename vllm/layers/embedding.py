"""Token embedding and the lm_head (tied or not)."""
from __future__ import annotations

import torch
from torch import nn

from vllm.kernels import ops


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Produces float32 logits; shares the embedding's weight when tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None, tied_to: VocabEmbedding | None = None):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.logits(hidden, self.weight)
