"""How many KV blocks and state slots the worker's caches get, from what the layers declare
and the memory budget.

Recurrent states are a fixed reservation (one slot per schedulable sequence, slot 0 null,
then the prefix-cache snapshots), taken first; paged KV blocks get what is left. On CUDA the
budget is measured: the largest step the scheduler may build runs once against a one-step
cache, and the peak it reaches (weights + activations + states) comes off the device's share.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from vllm.config import EngineConfig
from vllm.forward_context import ForwardContext, StateMetadata, set_forward_context
from vllm.worker.attention_backend import AttentionMetadata
from vllm.worker.kv_cache import CacheSpecs, LayerCaches, bytes_per_block, state_bytes
from vllm.worker.kv_format import KVFormat

# kept free of the KV cache on CUDA: graphs, the sampler's [B, V] temporaries, fragmentation
CUDA_HEADROOM_BYTES = 2 << 30


@dataclass(frozen=True)
class CachePlan:
    specs: CacheSpecs
    kv_format: KVFormat
    block_size: int
    num_blocks: int
    num_state_slots: int        # slot 0 null + one per schedulable sequence (0: no recurrent layer)
    num_state_snapshots: int
    state_bytes: int

    @property
    def kv_bytes_per_block(self) -> int:
        return bytes_per_block(self.specs.paged, self.kv_format, self.block_size)

    def allocate(self, device: torch.device, num_blocks: int | None = None, vmm: bool = False) -> LayerCaches:
        return LayerCaches.allocate(self.specs.paged, self.kv_format, self.num_blocks if num_blocks is None else num_blocks,
                                    self.block_size, device, vmm=vmm, state_specs=self.specs.recurrent,
                                    num_slots=self.num_state_slots, num_snapshots=self.num_state_snapshots)


def plan_caches(config: EngineConfig, model: nn.Module, specs: CacheSpecs, device: torch.device,
                mem_before_load: int = 0) -> CachePlan:
    """The plan for `model`'s declared caches (`mem_before_load`: CUDA memory allocated before
    the model was built, not this engine's)."""
    cc, sc = config.cache, config.scheduler
    if specs.recurrent:
        num_slots, num_snapshots = 1 + sc.max_num_seqs, cc.state_snapshots(sc.max_num_seqs)
    else:
        num_slots = num_snapshots = 0
    plan = CachePlan(specs, KVFormat(config.dtype, config.numerics_spec.kv_cache_dtype), cc.block_size, 0,
                     num_slots, num_snapshots, state_bytes(specs.recurrent, config.dtype, num_slots, num_snapshots))
    per_block = plan.kv_bytes_per_block
    max_blocks_per_seq = -(-config.model.max_model_len // cc.block_size)
    if cc.num_gpu_blocks is not None:
        n = cc.num_gpu_blocks
    elif per_block == 0:
        # no paged layer: blocks are bookkeeping only (every sequence's full context fits)
        n = 1 + sc.max_num_seqs * max_blocks_per_seq
    elif device.type == "cuda":
        n = _profile_gpu_blocks(config, model, plan, device, mem_before_load)
    else:
        n = (cc.cpu_kv_cache_bytes - plan.state_bytes) // per_block
    if n < 2:
        raise ValueError(f"not enough memory for the KV cache (recurrent states take {plan.state_bytes} bytes): "
                         "raise gpu_memory_utilization / cpu_kv_cache_bytes, lower max_num_seqs or "
                         "num_state_snapshots, or use a smaller max_model_len")
    return CachePlan(specs, plan.kv_format, plan.block_size, int(n), num_slots, num_snapshots, plan.state_bytes)


@torch.inference_mode()
def _profile_gpu_blocks(config: EngineConfig, model: nn.Module, plan: CachePlan, device: torch.device,
                        mem_before_load: int) -> int:
    """Peak activation memory of the largest step the scheduler may build, measured by
    running it once against a tiny dummy cache; the blocks that fit in what is left."""
    torch.cuda.synchronize()
    bs = plan.block_size
    n_tok = min(config.scheduler.max_num_batched_tokens, config.model.max_model_len)
    nb = -(-n_tok // bs)  # the step's blocks, after the null block
    # the states are allocated here at their final size (fixed by max_num_seqs), so the peak
    # measured includes them
    dummy = plan.allocate(device, num_blocks=1 + nb)
    backend = dummy.backend()
    cu = torch.tensor([0, n_tok], dtype=torch.int32, device=device)
    backend.metadata = AttentionMetadata(
        slot_mapping=torch.arange(bs, bs + n_tok, device=device),
        block_table=torch.arange(1, nb + 1, dtype=torch.int32, device=device)[None],
        cu_seqlens_q=cu, seq_lens=torch.tensor([n_tok], dtype=torch.int32, device=device),
        max_query_len=n_tok, max_seq_len=n_tok)
    state = dummy.state_backend(StateMetadata(
        cu, torch.zeros(1, dtype=torch.int32, device=device),
        torch.ones(1, dtype=torch.int32, device=device), n_tok, np.zeros(1, np.int64), np.array([n_tok])))
    ids = torch.zeros(n_tok, dtype=torch.long, device=device)
    with set_forward_context(ForwardContext(backend, config.numerics, config.kernels, state)):
        h = model(ids, torch.arange(n_tok, device=device))
        model.compute_logits(h[-config.scheduler.max_num_seqs:])
    torch.cuda.synchronize()
    # this engine's own peak: weights + the largest step's activations (other engines in the
    # process, e.g. a trainer, are not ours to count)
    own_peak = torch.cuda.max_memory_allocated() - mem_before_load - plan.state_bytes
    del dummy, backend, state, h
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    weights = torch.cuda.memory_allocated() - mem_before_load
    budget = total * config.cache.gpu_memory_utilization - own_peak
    # never more than is actually free now
    budget = min(budget, free - (own_peak - weights)) - CUDA_HEADROOM_BYTES - plan.state_bytes
    return int(budget // plan.kv_bytes_per_block)
