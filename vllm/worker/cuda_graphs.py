"""CUDA graphs of the decode forward, one per batch size, and the persistent input buffers
they read.

A decode step of n sequences replays the smallest captured size >= n; rows past n are
padding (context length 0, KV written to the null block, recurrent state in the null slot,
position 0) and are never read back. The addresses a graph reads are recorded at capture and
checked before the first replay after the weights change (vllm/worker/graph_pointers.py).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import torch
from torch import nn

from vllm.config import EngineConfig
from vllm.forward_context import ForwardContext, StateMetadata, set_forward_context
from vllm.worker.attention_backend import AttentionMetadata, PagedAttentionBackend
from vllm.worker.graph_pointers import GraphPointerTable
from vllm.worker.kv_cache import LayerCaches
from vllm.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

def default_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


class DecodeGraphs:
    def __init__(self, config: EngineConfig, model: nn.Module, kv_cache: LayerCaches, attn: PagedAttentionBackend,
                 recurrent: bool, device: torch.device):
        self.config, self.model, self.kv_cache, self.attn, self.recurrent = config, model, kv_cache, attn, recurrent
        self.device = device
        self.max_blocks_per_seq = -(-config.model.max_model_len // config.cache.block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.batch_sizes: list[int] = []
        self.buffers: dict[str, torch.Tensor] = {}
        self.pointers: GraphPointerTable | None = None
        self.pointers_unverified = False

    # ---- pointers -----------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a captured graph reads: parameters, KV caches, input/output buffers."""
        out = {f"param:{n}": p for n, p in self.model.named_parameters()}
        out.update(self.kv_cache.graph_tensors())
        out.update({f"workspace:g_{name}": t for name, t in self.buffers.items()})
        return out

    def record_pointers(self) -> None:
        self.pointers = GraphPointerTable(self.tensors())
        self.pointers_unverified = False

    def verify_pointers(self) -> None:
        """Raise StaleGraphPointers if any tensor the graphs read moved (no-op without graphs)."""
        if self.pointers is not None:
            self.pointers.check(self.tensors())
        self.pointers_unverified = False

    # ---- capture and replay -------------------------------------------------------------
    def size_for(self, n: int) -> int | None:
        for s in self.batch_sizes:
            if s >= n:
                return s
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        sizes = self.config.cuda_graph_batch_sizes or default_graph_batch_sizes(self.config.scheduler.max_num_seqs)
        max_bs = max(sizes)
        dev = self.device
        b = self.buffers = {}
        b["input_ids"] = torch.zeros(max_bs, dtype=torch.long, device=dev)
        b["positions"] = torch.zeros(max_bs, dtype=torch.long, device=dev)
        b["slots"] = torch.zeros(max_bs, dtype=torch.long, device=dev)  # padding rows write into the null block
        b["table"] = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        b["cu"] = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        b["seq_lens"] = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        b["hidden"] = torch.zeros(max_bs, self.model.config.hidden_size, dtype=self.config.dtype, device=dev)
        if self.recurrent:
            # padding rows: the null slot, position 0 (a fresh state: nothing is read)
            b["state_slots"] = torch.zeros(max_bs, dtype=torch.int32, device=dev)
            b["start_pos"] = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        for bs in sorted(sizes, reverse=True):
            md = AttentionMetadata(b["slots"][:bs], b["table"][:bs], b["cu"][:bs + 1], b["seq_lens"][:bs],
                                   max_query_len=1, max_seq_len=self.config.model.max_model_len)
            b["seq_lens"][:bs].fill_(1)
            self.attn.metadata = md

            def context() -> ForwardContext:
                # a fresh state metadata for each use: the chunk plan a recurrent layer derives
                # from the slots and positions (and caches per step) must be computed inside
                # the capture, so that every replay recomputes it from the graph's inputs
                state = None
                if self.recurrent:
                    state = self.kv_cache.state_backend(StateMetadata(b["cu"][:bs + 1], b["start_pos"][:bs],
                                                                      b["state_slots"][:bs], 1))
                return ForwardContext(self.attn, self.config.numerics, self.config.kernels, state)
            with set_forward_context(context()):
                for _ in range(2):  # warm up: Triton autotuning/compilation happens outside capture
                    b["hidden"][:bs] = self.model(b["input_ids"][:bs], b["positions"][:bs])
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with set_forward_context(context()), torch.cuda.graph(g, pool=pool):
                b["hidden"][:bs] = self.model(b["input_ids"][:bs], b["positions"][:bs])
            self.graphs[bs] = g
        b["seq_lens"].zero_()
        torch.cuda.synchronize()
        self.batch_sizes = sorted(sizes)
        self.record_pointers()
        logger.info("captured %d CUDA graphs in %.1f s", len(sizes), time.perf_counter() - t0)

    def recapture(self) -> None:
        """After the caches moved (sleep mode without a VMM region): the old graphs point at
        freed addresses."""
        self.graphs.clear()
        self.capture()

    def run(self, bs: int, inputs: StepInputs, fill: Callable[[torch.Tensor], None] | None = None,
            state_slots: np.ndarray | None = None) -> torch.Tensor:
        """Replay the graph of size `bs` on a decode step (one token per sequence); returns
        the hidden states of its rows."""
        b = self.buffers
        n = len(inputs.input_ids)
        pin = lambda a: torch.from_numpy(a).pin_memory()  # non_blocking copies need pinned sources
        b["input_ids"][:n].copy_(pin(inputs.input_ids), non_blocking=True)
        b["positions"][:n].copy_(pin(inputs.positions), non_blocking=True)
        b["slots"][:n].copy_(pin(inputs.slots), non_blocking=True)
        b["table"][:n].zero_()
        b["table"][:n, :inputs.table.shape[1]].copy_(pin(inputs.table), non_blocking=True)
        b["seq_lens"][:n].copy_(pin(inputs.seq_lens.astype(np.int32)), non_blocking=True)
        if state_slots is not None:
            b["state_slots"][:n].copy_(pin(state_slots), non_blocking=True)
            b["start_pos"][:n].copy_(pin(inputs.positions.astype(np.int32)), non_blocking=True)
        if bs > n:
            # padding rows: context length 0 (attention writes nothing that is read), KV
            # written to the null block
            b["seq_lens"][n:bs].zero_()
            b["slots"][n:bs].zero_()
            b["input_ids"][n:bs].zero_()
            b["positions"][n:bs].zero_()
            if state_slots is not None:
                b["state_slots"][n:bs].zero_()
                b["start_pos"][n:bs].zero_()
        if fill is not None:
            fill(b["input_ids"])
        if self.pointers_unverified:
            self.verify_pointers()
        self.graphs[bs].replay()
        return b["hidden"][:n]
