"""The trainer's attention backend: packed variable-length sequences, causal,
through the rollout's own paged attention kernel.

The K/V of a micro-batch are the kernel's cache as they are: viewed as a paged cache
of block size 1 (token t is block t, each sequence's block table row the identity on
its token range), so nothing is copied and the engine's cache is never read. The
kernel's output bits do not depend on physical blocks, block size or
prefill-vs-decode (docs/attention.md: K/V are gathered per token position), so every
sequence computed as a full prefill gives the rollout's bits; the backward is
PackedAttentionFn's separate implementation.

With an FP8 KV cache (kv_cache_dtype="fp8") the trainer keeps its private FP8 copy: K/V
go through the cache's round trip (quantize per token per head, dequantize to the model
dtype: vllm.kernels.fp8) before attention, with a straight-through gradient, so the
kernel reads exactly the values the engine's cache returns.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm.forward_context import StateBackend, StateMetadata
from vllm.host_copy import to_device
from vllm.kernels import ops
from vllm.kernels.autograd_ops import PackedAttentionFn
from vllm.kernels.fp8 import kv_round_trip_ste


class PackedAttentionBackend:
    def __init__(self, seq_lens: list[int], device: torch.device, kv_cache_dtype: str = "auto"):
        self.fp8_kv = kv_cache_dtype == "fp8"
        self.seq_lens = [int(n) for n in seq_lens]
        self.device = torch.device(device)
        lens = np.asarray(self.seq_lens, dtype=np.int64)
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        self.cu = cu.tolist()
        self.max_len = int(lens.max()) if len(lens) else 0
        # one small pinned, asynchronous host -> device copy (the host never waits for the GPU)
        meta = to_device(np.concatenate((cu, lens)), torch.int64, self.device).to(torch.int32)
        self.cu_seqlens, self.seq_lens_t = meta[:len(cu)], meta[len(cu):]
        # block table row s: blocks cu[s], cu[s] + 1, ... (entries past a sequence's
        # length are never read); built on the device
        width = max(self.max_len, 1)
        self.block_table = self.cu_seqlens[:-1, None] + torch.arange(width, dtype=torch.int32, device=self.device)

    def state_backend(self) -> StateBackend:
        """The recurrent layers' view of the micro-batch: every sequence starts at position 0
        (a fresh state, as a rollout's prefill from an empty cache), and nothing is cached."""
        n = len(self.seq_lens)
        return StateBackend(StateMetadata(self.cu_seqlens, torch.zeros(n, dtype=torch.int32, device=self.device), None,
                                          self.max_len, np.zeros(n, dtype=np.int64),
                                          np.asarray(self.seq_lens, dtype=np.int64)))

    def _paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # [T, Hk, D] -> a cache of T blocks of one token (any strides with D contiguous). No
        # fresh_kv: the paged kernel on this cache is what reproduces the rollout's bits in
        # invariant mode (fast mode runs the same kernel; it promises nothing)
        return ops.attention(q.detach(), k.detach().unsqueeze(1), v.detach().unsqueeze(1), self.block_table,
                             self.cu_seqlens, self.seq_lens_t, scale, max_query_len=self.max_len,
                             max_seq_len=self.max_len)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if self.fp8_kv:
            k, v = kv_round_trip_ste(k), kv_round_trip_ste(v)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return PackedAttentionFn.apply(q, k, v, self.cu, scale, lambda q_, k_, v_: self._paged(q_, k_, v_, scale),
                                           self.cu_seqlens)
        return self._paged(q, k, v, scale)
