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
            # a plain reference, not a submodule: the embedding is registered where it lives
            self.__dict__["_tied_embedding"] = tied_to
            self.__dict__["_tied_param"] = tied_to.weight   # the Parameter the head holds while tied
            self.register_load_state_dict_post_hook(_retie)
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.logits(hidden, self.weight)


def _retie(head: LMHead, incompatible_keys) -> None:
    """After load_state_dict: `assign=True` gives the head and the embedding a Parameter each,
    which would then train apart (and save_pretrained write two tensors a tied config denies).
    The head takes the embedding's Parameter again; when both were loaded they must have held
    the same values. The embedding is loaded before the head (model classes build it first)."""
    emb = head.__dict__["_tied_embedding"]
    if head.weight is emb.weight:
        return
    # a state dict without the head's key (an HF tied checkpoint, strict=False) leaves the head
    # its old Parameter: nothing to compare, it follows the embedding
    loaded = head.weight is not head.__dict__["_tied_param"]
    if loaded and (head.weight.shape != emb.weight.shape or not torch.equal(head.weight.detach(), emb.weight.detach())):
        raise ValueError("lm_head.weight differs from the embedding weight it is tied to (tie_word_embeddings)")
    head.weight = emb.weight
    head.__dict__["_tied_param"] = emb.weight
