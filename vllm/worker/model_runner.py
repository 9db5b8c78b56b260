"""Model runner: turns a SchedulerOutput into one forward pass and sampled tokens.

Owns the inference-only state and composes it by noun: the caches the layers declared
(sized by `cache_budget`, allocated in `kv_cache`), the step's packed inputs
(`step_inputs`), the decode CUDA graphs and their buffers (`cuda_graphs`) and the sampling
side (`sampling_launch`). The model itself is stateless between steps.
"""
from __future__ import annotations

import gc
import logging
import time

import numpy as np
import torch

from vllm.config import EngineConfig
from vllm.core.messages import ModelRunnerOutput, SchedulerOutput
from vllm.core.request import PLACEHOLDER
from vllm.forward_context import ForwardContext, StateMetadata, set_forward_context
from vllm.host_copy import to_device
from vllm.model_loader.build import build_model
from vllm.worker.attention_backend import AttentionMetadata
from vllm.worker.cache_budget import plan_caches
from vllm.worker.cuda_graphs import DecodeGraphs
from vllm.worker.kv_cache import cache_specs
from vllm.worker.phase_timer import PhaseTimer
from vllm.worker.sampling_launch import SamplingLauncher, StepHandle
from vllm.worker.step_inputs import pack_step

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner", "StepHandle"]


class ModelRunner:
    # what LLM.collective_rpc may call by name: methods that leave the engine's record of
    # this worker true. Steps, sleep and wake_up change state the engine keeps in step with
    # (its scheduler, its prefix cache, whether it is asleep): they are reached through it.
    RPC_METHODS = ("get_model", "kv_cache_bytes", "verify_graph_pointers")

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.dtype
        mc = config.model
        self.block_size = config.cache.block_size
        t0 = time.perf_counter()
        mem_before_load = 0
        if self.device.type == "cuda":
            # an engine the caller dropped that something still holds in a reference cycle
            # keeps its caches until the collector runs: collect now, before this engine
            # counts the memory that is free for its own KV cache
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            mem_before_load = torch.cuda.memory_allocated(self.device)
        self.model, self.self_check_report = build_model(mc, config.numerics_spec, self.device,
                                                         load_format=config.load_format,
                                                         self_check_tokens=config.scheduler.max_num_batched_tokens,
                                                         keep_master_weights=config.keep_master_weights)
        self.load_time = time.perf_counter() - t0
        if self.device.type == "cuda" and (self.self_check_report is not None or not config.keep_master_weights):
            # its check batches are not the engine's, nor the master weights dropped after
            # load: keep them out of the peak that sizes the KV cache
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        self.timer = PhaseTimer(self.device, config.step_profile)
        # the timer's method, not one of this runner's: a bound method of the runner held by
        # its own launcher would be a reference cycle, and a dropped engine's caches would stay
        # allocated until the garbage collector happened to run
        self.sampling = SamplingLauncher(config, self.model, self.device, self.timer.mark)
        self.cache_specs = cache_specs(self.model, config.numerics)  # what the model's layers declare
        self.cache_plan = plan_caches(config, self.model, self.cache_specs, self.device, mem_before_load)
        # sleep mode on CUDA: the caches live in one driver VMM region, so waking maps new
        # pages at the same address and captured graphs stay valid (vllm/worker/cuda_vmm.py)
        self.kv_cache = self.cache_plan.allocate(self.device, vmm=config.cache.enable_sleep_mode)
        self.attn = self.kv_cache.backend()
        p = self.cache_plan
        logger.info("KV cache: %s, %d blocks x %d = %d tokens (%.1f KiB per token over all layers)",
                    "fp8 e4m3 + fp32 scale per token per head" if p.kv_format.fp8 else str(self.dtype),
                    p.num_blocks, self.block_size, p.num_blocks * self.block_size,
                    p.kv_bytes_per_block / self.block_size / 1024)
        if self.cache_specs.recurrent:
            logger.info("recurrent states: %d layers, %d slots + %d prefix-cache snapshots, %.1f MiB",
                        len(self.cache_specs.recurrent), p.num_state_slots - 1, p.num_state_snapshots,
                        p.state_bytes / 2**20)
        self.decode_graphs = DecodeGraphs(config, self.model, self.kv_cache, self.attn,
                                          bool(self.cache_specs.recurrent), self.device)
        if self.device.type == "cuda" and not config.enforce_eager:
            self.decode_graphs.capture()

    # ---- what the executor reports ---------------------------------------------------------
    def get_model(self) -> torch.nn.Module:
        """The model this worker computes with (upstream's worker method of that name)."""
        return self.model

    @property
    def num_blocks(self) -> int:
        return self.cache_plan.num_blocks

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    # ---- sleep mode -----------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        return self.kv_cache.sleeping

    def kv_cache_bytes(self) -> int:
        return self.kv_cache.nbytes()

    def sleep(self) -> int:
        """Release the KV cache's memory; returns the bytes released. The cache tensors
        keep their shapes; their contents are gone (the engine drops its prefix cache)."""
        return self.kv_cache.release()

    def wake_up(self) -> None:
        """Take the KV cache's memory back, zero-filled as at start-up. With the VMM region
        the addresses are unchanged, so the captured graphs are replayed as they are."""
        if self.kv_cache.restore() and self.decode_graphs.graphs:
            self.decode_graphs.recapture()

    # ---- graph pointers (weights written in place) -------------------------------------------
    def record_graph_pointers(self) -> None:
        self.decode_graphs.record_pointers()

    def weights_changed(self) -> None:
        """The parameters were written (weight sync, optimizer step): verify before the next replay."""
        self.decode_graphs.pointers_unverified = True

    def verify_graph_pointers(self) -> None:
        """Raise StaleGraphPointers if any tensor the graphs read moved (no-op without graphs)."""
        self.decode_graphs.verify_pointers()

    def _h2d(self, values, dtype: torch.dtype | None = None) -> torch.Tensor:
        return to_device(values, dtype, self.device)  # never a host sync (vllm/host_copy.py)

    # ---- one step ---------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(sched))

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for the step and bring its sampled tokens (and logprobs) to the host."""
        return self.sampling.collect(handle)

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: StepHandle | None = None) -> StepHandle:
        """Enqueue the step's GPU work (forward, logits, sampling) without waiting for it.

        Tokens not known yet on the host (PLACEHOLDER: sampled by the still-running
        step `prev`) are filled on the device from prev's sampled-token tensor."""
        if not sched.requests:
            return StepHandle([], [], None, {})
        self.timer.mark(None)
        inputs = pack_step(sched.requests, self.block_size)
        cu = inputs.cu
        recurrent = bool(self.cache_specs.recurrent)
        state_slots = np.fromiter((r.state_slot for r in sched.requests), dtype=np.int32,
                                  count=len(sched.requests)) if recurrent else None
        if recurrent:
            # prefix-cache hits start from a snapshot: copied into the sequence's slot first
            loads = [(r.state_load, r.state_slot) for r in sched.requests if r.state_load >= 0]
            if loads:
                self.kv_cache.copy_state_slots([a for a, _ in loads], [b for _, b in loads])
        fill_rows, fill_src = [], []
        if prev is not None:
            for i, r in enumerate(sched.requests):
                if r.token_ids and r.token_ids[-1] == PLACEHOLDER:
                    fill_rows.append(int(cu[i + 1]) - 1)
                    fill_src.append(prev.row_of[r.req_id])
            inputs.input_ids[fill_rows] = 0
        if (inputs.input_ids < 0).any():
            raise RuntimeError("a placeholder token reached the runner without the step that samples it")
        self.timer.mark("prepare")
        max_q = inputs.max_query_len
        graph_bs = self.decode_graphs.size_for(inputs.num_seqs) if max_q == 1 else None

        def fill(ids_dev: torch.Tensor) -> None:
            if fill_rows:
                ids_dev[self._h2d(fill_rows, torch.long)] = prev.token_ids[self._h2d(fill_src, torch.long)]
        if graph_bs is not None:
            hidden = self.decode_graphs.run(graph_bs, inputs, fill, state_slots)
            self.timer.mark("forward_graph")
            rows = [i for i, r in enumerate(sched.requests) if r.sample]
        else:
            md = AttentionMetadata(
                slot_mapping=self._h2d(inputs.slots),
                block_table=self._h2d(inputs.table),
                cu_seqlens_q=self._h2d(cu.astype(np.int32)),
                seq_lens=self._h2d(inputs.seq_lens.astype(np.int32)),
                max_query_len=max_q, max_seq_len=int(inputs.seq_lens.max()),
                fresh_prefill=inputs.fresh_prefill)
            self.attn.metadata = md
            state = None
            if recurrent:
                state = self.kv_cache.state_backend(StateMetadata(
                    md.cu_seqlens_q, self._h2d(inputs.starts.astype(np.int32)), self._h2d(state_slots), max_q,
                    host_start_pos=inputs.starts, host_q_lens=inputs.q_lens))
            ids_dev = self._h2d(inputs.input_ids)
            fill(ids_dev)
            with set_forward_context(ForwardContext(self.attn, self.config.numerics, self.config.kernels, state)):
                hidden = self.model(ids_dev, self._h2d(inputs.positions))
            self.timer.mark("forward_decode_eager" if max_q == 1 else "forward_prefill")
            last = cu[1:] - 1
            rows = [int(last[i]) for i, r in enumerate(sched.requests) if r.sample]
        if recurrent:
            # a sequence whose step ended on the states' grid leaves a prefix-cache snapshot
            saves = [(r.state_slot, r.state_save) for r in sched.requests if r.state_save >= 0]
            if len({b for _, b in saves}) != len(saves):   # one index_copy_: repeated targets race on the GPU
                raise RuntimeError(f"two state snapshots of one step share a slot: {saves}")
            if saves:
                self.kv_cache.copy_state_slots([a for a, _ in saves], [b for _, b in saves])
        # only requests that asked are looked at: nothing for a step without any
        prompt_parts = self.sampling.prompt_logprobs(hidden, sched, cu) if sched.prompt_logprob_indices else None
        sampled_reqs = [r for r in sched.requests if r.sample]
        if not sampled_reqs:
            return self.sampling.prompt_only(prompt_parts)
        with set_forward_context(ForwardContext(None, self.config.numerics, self.config.kernels)):
            # a decode step where every request samples needs every row, in order: no gather
            # (nor the index copy) on the hot path; a copy would not change a bit anyway
            picked = hidden if len(rows) == hidden.shape[0] else hidden.index_select(0, self._h2d(rows, torch.long))
            logits = self.model.compute_logits(picked)
        self.timer.mark("logits")
        handle = self.sampling.launch(logits, sampled_reqs, prev)
        if prompt_parts:
            handle.prompt_parts = prompt_parts
        self.timer.mark("sample")
        return handle
