"""The trainer's attention backend: packed variable-length sequences, causal,
through the rollout's own paged attention kernel on a PRIVATE cache.

Each micro-batch writes its K/V into its own contiguous paged buffer (it never
reads the engine's cache) and calls the same kernel the engine calls with every
sequence as a full prefill. The kernel's output bits do not depend on physical
blocks, block size or prefill-vs-decode (docs/attention.md), so this gives the
rollout's bits; the backward is PackedAttentionFn's separate implementation.
Later features that change what the engine stores (an FP8 KV cache) apply here
through this private copy.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm.host_copy import to_device
from vllm.kernels.attention import paged_attention
from vllm.kernels.autograd_ops import PackedAttentionFn


class PackedAttentionBackend:
    def __init__(self, seq_lens: list[int], device: torch.device, block_size: int = 16):
        self.seq_lens = [int(n) for n in seq_lens]
        self.device = torch.device(device)
        self.block_size = block_size
        lens = np.asarray(self.seq_lens, dtype=np.int64)
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        self.cu = cu.tolist()
        self.max_len = int(lens.max()) if len(lens) else 0
        # each sequence owns whole blocks, consecutively from block 1 (block 0 stays
        # unused, as in the engine)
        blocks = -(-lens // block_size)
        first_block = 1 + np.concatenate(([0], np.cumsum(blocks)[:-1])) if len(lens) else blocks
        self.num_blocks = int(blocks.sum()) + 1
        width = max(int(blocks.max()) if len(lens) else 0, 1)
        col = np.arange(width, dtype=np.int64)
        table = np.where(col[None, :] < blocks[:, None], first_block[:, None] + col[None, :], 0)
        seq_of_token = np.repeat(np.arange(len(lens)), lens)
        slots = first_block[seq_of_token] * block_size + (np.arange(int(cu[-1])) - cu[:-1][seq_of_token])
        # one host -> device copy (pinned, asynchronous: the host never waits for the GPU)
        packed = to_device(np.concatenate((table.reshape(-1), cu, lens, slots)), torch.int64, self.device)
        n_table = table.size
        self.block_table = packed[:n_table].view(len(lens), width).to(torch.int32)
        self.cu_seqlens = packed[n_table:n_table + len(cu)].to(torch.int32)
        self.seq_lens_t = packed[n_table + len(cu):n_table + len(cu) + len(lens)].to(torch.int32)
        self.slots = packed[n_table + len(cu) + len(lens):]

    def _paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        shape = (self.num_blocks * self.block_size, k.shape[1], k.shape[2])
        kc = torch.zeros(shape, dtype=k.dtype, device=k.device).index_copy_(0, self.slots, k.detach())
        vc = torch.zeros(shape, dtype=v.dtype, device=v.device).index_copy_(0, self.slots, v.detach())
        view = (self.num_blocks, self.block_size, k.shape[1], k.shape[2])
        return paged_attention(q.detach(), kc.view(view), vc.view(view), self.block_table, self.cu_seqlens, self.seq_lens_t,
                               scale, max_query_len=self.max_len, max_seq_len=self.max_len)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return PackedAttentionFn.apply(q, k, v, self.cu, scale, lambda q_, k_, v_: self._paged(q_, k_, v_, scale),
                                           self.cu_seqlens)
        return self._paged(q, k, v, scale)
