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

import torch

from vllm.kernels import ops
from vllm.kernels.autograd_ops import PackedAttentionFn


class PackedAttentionBackend:
    def __init__(self, seq_lens: list[int], device: torch.device, block_size: int = 16):
        self.seq_lens = list(seq_lens)
        self.device = torch.device(device)
        self.block_size = block_size
        cu = [0]
        for n in self.seq_lens:
            cu.append(cu[-1] + n)
        self.cu = cu
        blocks = [-(-n // block_size) for n in self.seq_lens]
        self.num_blocks = sum(blocks) + 1  # block 0 stays unused, as in the engine
        table = torch.zeros(len(self.seq_lens), max(blocks), dtype=torch.int32)
        slots = []
        nxt = 1
        for i, (n, b) in enumerate(zip(self.seq_lens, blocks)):
            table[i, :b] = torch.arange(nxt, nxt + b, dtype=torch.int32)
            slots.append(torch.arange(nxt * block_size, nxt * block_size + n))
            nxt += b
        self.block_table = table.to(self.device)
        self.slots = torch.cat(slots).to(self.device)
        self.cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=self.device)
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32, device=self.device)

    def _paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        shape = (self.num_blocks * self.block_size, k.shape[1], k.shape[2])
        kc = torch.zeros(shape, dtype=k.dtype, device=k.device).index_copy_(0, self.slots, k.detach())
        vc = torch.zeros(shape, dtype=v.dtype, device=v.device).index_copy_(0, self.slots, v.detach())
        view = (self.num_blocks, self.block_size, k.shape[1], k.shape[2])
        # no fresh_kv: the paged kernel on this private cache is what reproduces the rollout's
        # bits in invariant mode (fast mode runs the same kernel; it promises nothing)
        return ops.attention(q.detach(), kc.view(view), vc.view(view), self.block_table, self.cu_seqlens,
                             self.seq_lens_t, scale, max_query_len=max(self.seq_lens), max_seq_len=max(self.seq_lens))

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return PackedAttentionFn.apply(q, k, v, self.cu, scale, lambda q_, k_, v_: self._paged(q_, k_, v_, scale))
        return self._paged(q, k, v, scale)
