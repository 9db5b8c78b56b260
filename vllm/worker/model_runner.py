"""Model runner: turns a SchedulerOutput into one forward pass and sampled tokens.

Owns the inference-only state: the caches the layers declared (paged KV, recurrent
states), the attention and state backends' step metadata, persistent input buffers and
the CUDA graphs captured for decode batches. The model itself is stateless between steps.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.config import EngineConfig
from vllm.core.messages import ModelRunnerOutput, PromptLogprobsChunk, SampledToken, SchedulerOutput
from vllm.core.request import PLACEHOLDER
from vllm.forward_context import ForwardContext, StateMetadata, set_forward_context
from vllm.host_copy import to_device
from vllm.model_loader.build import build_model
from vllm.sample.sampler import (Penalties, Sampler, SamplerOutput, SamplingBatch, TokenMask, prompt_logprob_values,
                                  stable_topk)
from vllm.worker.attention_backend import AttentionMetadata
from vllm.worker.kv_cache import LayerCaches, bytes_per_block, cache_specs, state_bytes
from vllm.worker.kv_format import KVFormat
from vllm.worker.graph_pointers import GraphPointerTable

logger = logging.getLogger(__name__)


@dataclass
class StepHandle:
    """A launched step: its sampled requests, the sampler outputs still on the device,
    and the sampled token ids as one device tensor (row_of: request id -> row)."""
    reqs: list
    groups: list
    token_ids: torch.Tensor | None
    row_of: dict
    event: object = None   # CUDA event recorded after the host copies were enqueued
    # prompt logprobs: (per request (id, slice, first row in the outputs), SamplerOutput
    # with token_ids = the targets), one per logprobs mode
    prompt_parts: list = field(default_factory=list)


def default_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.dtype
        self.kv_format = KVFormat(config.dtype, config.numerics_spec.kv_cache_dtype)
        mc = config.model
        self.block_size = config.cache.block_size
        self.max_model_len = mc.max_model_len
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._mem_before_load = torch.cuda.memory_allocated(self.device)
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
        self.sampler = Sampler(fused_gumbel=config.kernels.fused_gumbel)
        self.cache_specs = cache_specs(self.model, config.numerics)  # what the model's layers declare
        self.kv_specs = self.cache_specs.paged
        # recurrent states: slot 0 null, one slot per running sequence, then the snapshots
        # the prefix cache keeps at multiples of the states' chunk size
        if self.cache_specs.recurrent:
            self.num_state_slots = 1 + config.scheduler.max_num_seqs
            self.num_state_snapshots = config.cache.state_snapshots(config.scheduler.max_num_seqs)
        else:
            self.num_state_slots = self.num_state_snapshots = 0
        self.state_bytes = state_bytes(self.cache_specs.recurrent, self.dtype, self.num_state_slots,
                                       self.num_state_snapshots)
        self.num_blocks = self._decide_num_blocks()
        # sleep mode on CUDA: the caches live in one driver VMM region, so waking maps new
        # pages at the same address and captured graphs stay valid (vllm/worker/cuda_vmm.py)
        self.kv_cache = LayerCaches.allocate(self.kv_specs, self.kv_format, self.num_blocks, self.block_size,
                                             self.device, vmm=config.cache.enable_sleep_mode,
                                             state_specs=self.cache_specs.recurrent, num_slots=self.num_state_slots,
                                             num_snapshots=self.num_state_snapshots)
        self.attn = self.kv_cache.backend()
        logger.info("KV cache: %s, %d blocks x %d = %d tokens (%.1f KiB per token over all layers)",
                    "fp8 e4m3 + fp32 scale per token per head" if self.kv_format.fp8 else str(self.dtype),
                    self.num_blocks, self.block_size, self.num_blocks * self.block_size,
                    self.kv_bytes_per_block() / self.block_size / 1024)
        if self.cache_specs.recurrent:
            logger.info("recurrent states: %d layers, %d slots + %d prefix-cache snapshots, %.1f MiB",
                        len(self.cache_specs.recurrent), self.num_state_slots - 1, self.num_state_snapshots,
                        self.state_bytes / 2**20)
        # synchronise at phase boundaries and accumulate wall time per phase (benchmarks
        # print it; off by default because syncs cost time)
        self.profile = config.step_profile
        self.timings: dict[str, float] = defaultdict(float)
        self._t = 0.0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_batch_sizes: list[int] = []
        # addresses the graphs read, taken at capture; checked before the first replay
        # after the weights change (vllm/worker/graph_pointers.py)
        self.graph_pointers: GraphPointerTable | None = None
        self._pointers_unverified = False
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_graphs()

    # ---- memory ---------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return bytes_per_block(self.kv_specs, self.kv_format, self.block_size)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _decide_num_blocks(self) -> int:
        cc = self.config.cache
        per_block = self.kv_bytes_per_block()
        if cc.num_gpu_blocks is not None:
            n = cc.num_gpu_blocks
        elif per_block == 0:
            # no paged layer: blocks are bookkeeping only (every sequence's full context fits)
            n = 1 + self.config.scheduler.max_num_seqs * self.max_blocks_per_seq
        elif self.device.type == "cuda":
            n = self._profile_gpu_blocks()
        else:
            n = (cc.cpu_kv_cache_bytes - self.state_bytes) // per_block
        if n < 2:
            raise ValueError(f"not enough memory for the KV cache (recurrent states take {self.state_bytes} bytes): "
                             "raise gpu_memory_utilization / cpu_kv_cache_bytes, lower max_num_seqs or "
                             "num_state_snapshots, or use a smaller max_model_len")
        return int(n)

    @torch.inference_mode()
    def _profile_gpu_blocks(self) -> int:
        # Peak activation memory of the largest step the scheduler may build, measured
        # by running it once against a tiny dummy cache.
        torch.cuda.synchronize()
        n_tok = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        nb = -(-n_tok // self.block_size)  # the step's blocks, after the null block
        # the states are allocated here at their final size (fixed by max_num_seqs), so the
        # peak measured includes them
        dummy = LayerCaches.allocate(self.kv_specs, self.kv_format, 1 + nb, self.block_size, self.device,
                                     state_specs=self.cache_specs.recurrent, num_slots=self.num_state_slots,
                                     num_snapshots=self.num_state_snapshots)
        backend = dummy.backend()
        cu = torch.tensor([0, n_tok], dtype=torch.int32, device=self.device)
        backend.metadata = AttentionMetadata(
            slot_mapping=torch.arange(self.block_size, self.block_size + n_tok, device=self.device),
            block_table=torch.arange(1, nb + 1, dtype=torch.int32, device=self.device)[None],
            cu_seqlens_q=cu, seq_lens=torch.tensor([n_tok], dtype=torch.int32, device=self.device),
            max_query_len=n_tok, max_seq_len=n_tok)
        state = dummy.state_backend(StateMetadata(
            cu, torch.zeros(1, dtype=torch.int32, device=self.device),
            torch.ones(1, dtype=torch.int32, device=self.device), n_tok, np.zeros(1, np.int64), np.array([n_tok])))
        ids = torch.zeros(n_tok, dtype=torch.long, device=self.device)
        with set_forward_context(ForwardContext(backend, self.config.numerics, self.config.kernels, state)):
            h = self.model(ids, torch.arange(n_tok, device=self.device))
            self.model.compute_logits(h[-self.config.scheduler.max_num_seqs:])
        torch.cuda.synchronize()
        # This engine's own peak: weights + the largest step's activations (other
        # engines in the process, e.g. a trainer, are not ours to count).
        own_peak = torch.cuda.max_memory_allocated() - self._mem_before_load - self.state_bytes
        del dummy, backend, state, h
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        weights = torch.cuda.memory_allocated() - self._mem_before_load
        budget = total * self.config.cache.gpu_memory_utilization - own_peak
        # Never more than is actually free now, and keep room for CUDA graphs, the
        # sampler's [B, V] temporaries and fragmentation.
        budget = min(budget, free - (own_peak - weights)) - (2 << 30) - self.state_bytes
        return int(budget // self.kv_bytes_per_block())

    # ---- sleep mode -------------------------------------------------------------------
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
        if self.kv_cache.restore() and self.graphs:
            self.graphs.clear()
            self._capture_graphs()  # the old graphs point at the freed addresses

    def _mark(self, phase: str | None) -> None:
        if not self.profile:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if phase is not None:
            self.timings[phase] += now - self._t
        self._t = now

    # ---- inputs -----------------------------------------------------------------------
    def _prepare(self, sched: SchedulerOutput):
        """Pack the step into flat arrays with a handful of numpy calls (no per-token Python)."""
        reqs = sched.requests
        n = len(reqs)
        bs = self.block_size
        q_lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=n)
        starts = np.fromiter((r.num_computed for r in reqs), dtype=np.int64, count=n)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        input_ids = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in reqs), dtype=np.int64, count=total)
        seq_of_token = np.repeat(np.arange(n), q_lens)
        positions = np.arange(total, dtype=np.int64) - cu[:-1][seq_of_token] + starts[seq_of_token]
        width = max(len(r.block_table) for r in reqs)
        table = np.zeros((n, width), dtype=np.int32)
        for i, r in enumerate(reqs):
            table[i, :len(r.block_table)] = r.block_table
        slots = table[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = starts + q_lens
        return input_ids, positions, slots, table, cu, seq_lens, starts, q_lens

    # ---- one step ---------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: "StepHandle | None" = None) -> "StepHandle":
        """Enqueue the step's GPU work (forward, logits, sampling) without waiting for it.

        Tokens not known yet on the host (PLACEHOLDER: sampled by the still-running
        step `prev`) are filled on the device from prev's sampled-token tensor."""
        if not sched.requests:
            return StepHandle([], [], None, {})
        self._mark(None)
        input_ids, positions, slots, table, cu, seq_lens, starts, q_lens = self._prepare(sched)
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
            input_ids[fill_rows] = 0
        if (input_ids < 0).any():
            raise RuntimeError("a placeholder token reached the runner without the step that samples it")
        self._mark("prepare")
        n_seqs = len(sched.requests)
        max_q = int((cu[1:] - cu[:-1]).max())
        graph_bs = self._graph_size(n_seqs) if max_q == 1 else None

        def fill(ids_dev: torch.Tensor) -> None:
            if fill_rows:
                ids_dev[self._h2d(fill_rows, torch.long)] = prev.token_ids[self._h2d(fill_src, torch.long)]
        if graph_bs is not None:
            hidden = self._run_graph(graph_bs, input_ids, positions, slots, table, seq_lens, fill, state_slots)
            self._mark("forward_graph")
            rows = [i for i, r in enumerate(sched.requests) if r.sample]
        else:
            md = AttentionMetadata(
                slot_mapping=self._h2d(slots),
                block_table=self._h2d(table),
                cu_seqlens_q=self._h2d(cu.astype(np.int32)),
                seq_lens=self._h2d(seq_lens.astype(np.int32)),
                max_query_len=max_q, max_seq_len=int(seq_lens.max()),
                fresh_prefill=bool(max_q > 1 and (seq_lens == cu[1:] - cu[:-1]).all()))
            self.attn.metadata = md
            state = None
            if recurrent:
                state = self.kv_cache.state_backend(StateMetadata(
                    md.cu_seqlens_q, self._h2d(starts.astype(np.int32)), self._h2d(state_slots), max_q,
                    host_start_pos=starts, host_q_lens=q_lens))
            ids_dev = self._h2d(input_ids)
            fill(ids_dev)
            with set_forward_context(ForwardContext(self.attn, self.config.numerics, self.config.kernels, state)):
                hidden = self.model(ids_dev, self._h2d(positions))
            self._mark("forward_decode_eager" if max_q == 1 else "forward_prefill")
            last = cu[1:] - 1
            rows = [int(last[i]) for i, r in enumerate(sched.requests) if r.sample]
        if recurrent:
            # a sequence whose step ended on the states' grid leaves a prefix-cache snapshot
            saves = [(r.state_slot, r.state_save) for r in sched.requests if r.state_save >= 0]
            if saves:
                self.kv_cache.copy_state_slots([a for a, _ in saves], [b for _, b in saves])
        # only requests that asked are looked at: nothing for a step without any
        prompt_parts = self._prompt_logprobs_launch(hidden, sched, cu) if sched.prompt_logprob_indices else None
        sampled_reqs = [r for r in sched.requests if r.sample]
        if not sampled_reqs:
            handle = StepHandle([], [], None, {})
            if prompt_parts:
                handle.prompt_parts = prompt_parts
                if self.device.type == "cuda" and self.config.async_scheduling:
                    handle.event = torch.cuda.Event()
                    handle.event.record()
            return handle
        with set_forward_context(ForwardContext(None, self.config.numerics, self.config.kernels)):
            # a decode step where every request samples needs every row, in order: no gather
            # (nor the index copy) on the hot path; a copy would not change a bit anyway
            picked = hidden if len(rows) == hidden.shape[0] else hidden.index_select(0, self._h2d(rows, torch.long))
            logits = self.model.compute_logits(picked)
        self._mark("logits")
        handle = self._sample_launch(logits, sampled_reqs, prev)
        if prompt_parts:
            handle.prompt_parts = prompt_parts
        self._mark("sample")
        return handle

    def _prompt_logprobs_launch(self, hidden: torch.Tensor, sched: SchedulerOutput, cu) -> list:
        """Prompt logprobs of the step's rows at prompt positions (the requests that asked).

        The same logprob head as the sampled tokens: the model's compute_logits on the
        rows, then the sampler's operations on float32 logits (prompt_logprob_values), so
        a prompt token's logprob has the bits the sampler gives when it samples that token
        after the same prefix, and Policy.token_logprobs' bits. Rows go through the head
        in chunks of at most rows_per_chunk (the trainer's float32 logits budget): every
        op is per row, so the chunking changes no bit."""
        from vllm.training.logprob_head import rows_per_chunk
        by_mode: dict[str, list] = {}
        for i in sched.prompt_logprob_indices:
            r = sched.requests[i]
            by_mode.setdefault(r.prompt_logprobs.logprobs_mode, []).append((r.req_id, r.prompt_logprobs, int(cu[i])))
        chunk = rows_per_chunk(self.config.model.vocab_size)
        parts = []
        with set_forward_context(ForwardContext(None, self.config.numerics, self.config.kernels)):
            for mode, items in by_mode.items():
                counts = [len(pl.targets) for _, pl, _ in items]
                rows = np.concatenate([np.arange(base + pl.first_row, base + pl.first_row + len(pl.targets))
                                       for _, pl, base in items])
                rows_t = self._h2d(rows, torch.long)
                targets_t = self._h2d(list(itertools.chain.from_iterable(pl.targets for _, pl, _ in items)), torch.long)
                temps_t = self._h2d(np.repeat([pl.temperature for _, pl, _ in items], counts), torch.float32)
                num_top = max(pl.num_top for _, pl, _ in items)
                values, ranks, top_v, top_i = [], [], [], []
                for a in range(0, len(rows), chunk):
                    b = min(len(rows), a + chunk)
                    dist = prompt_logprob_values(self.model.compute_logits(hidden.index_select(0, rows_t[a:b])),
                                                 temps_t[a:b], mode)
                    v = dist.gather(1, targets_t[a:b, None])
                    values.append(v[:, 0])
                    ranks.append((dist > v).sum(dim=-1) + 1)   # an exact integer count, as the sampler's
                    if num_top > 0:
                        tv, ti = stable_topk(dist, num_top)
                        top_v.append(tv)
                        top_i.append(ti)
                    del dist
                out = SamplerOutput(token_ids=targets_t, logprobs=torch.cat(values), ranks=torch.cat(ranks),
                                    topk_ids=torch.cat(top_i) if num_top > 0 else None,
                                    topk_logprobs=torch.cat(top_v) if num_top > 0 else None)
                offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
                parts.append(([(rid, pl, int(o)) for (rid, pl, _), o in zip(items, offsets)], self._to_host_async(out)))
        self._mark("prompt_logprobs")
        return parts

    def _h2d(self, values, dtype: torch.dtype | None = None) -> torch.Tensor:
        return to_device(values, dtype, self.device)  # never a host sync (vllm/host_copy.py)

    def _penalties(self, reqs, prev: "StepHandle | None") -> Penalties | None:
        """The Penalties of a sampler call over `reqs` (None when none has any). An output
        token still on the device (PLACEHOLDER, async scheduling) is read from `prev`."""
        rows = [j for j, r in enumerate(reqs) if r.penalties is not None]
        if not rows:
            return None
        out_ids, out_slot, prompt_ids, prompt_slot, fill_slot, fill_src = [], [], [], [], [], []
        for slot, j in enumerate(rows):
            r = reqs[j]
            _, _, rep, prompt, output = r.penalties
            for t in output:
                if t == PLACEHOLDER:
                    fill_slot.append(slot)
                    fill_src.append(prev.row_of[r.req_id])
                else:
                    out_ids.append(t)
                    out_slot.append(slot)
            if rep != 1.0:
                prompt_ids += prompt
                prompt_slot += [slot] * len(prompt)
        ids, slots = self._h2d(out_ids, torch.long), self._h2d(out_slot, torch.long)
        if fill_slot:
            ids = torch.cat([ids, prev.token_ids[self._h2d(fill_src, torch.long)]])
            slots = torch.cat([slots, self._h2d(fill_slot, torch.long)])
        return Penalties(rows=self._h2d(rows, torch.long),
                         presence=self._h2d([reqs[j].penalties[0] for j in rows], torch.float32),
                         frequency=self._h2d([reqs[j].penalties[1] for j in rows], torch.float32),
                         repetition=self._h2d([reqs[j].penalties[2] for j in rows], torch.float32),
                         output_ids=ids, output_slot=slots,
                         prompt_ids=self._h2d(prompt_ids, torch.long), prompt_slot=self._h2d(prompt_slot, torch.long))

    def _token_mask(self, reqs) -> TokenMask | None:
        """The grammar masks of a sampler call over `reqs` (None when no row is constrained):
        the scheduler computed each from its request's own matcher."""
        rows = [j for j, r in enumerate(reqs) if r.grammar_bitmask is not None]
        if not rows:
            return None
        return TokenMask(rows=self._h2d(rows, torch.long),
                         bitmask=self._h2d(np.stack([reqs[j].grammar_bitmask for j in rows]), torch.int32))

    def _sample_launch(self, logits: torch.Tensor, reqs, prev: "StepHandle | None" = None) -> "StepHandle":
        eos_rows = [i for i, r in enumerate(reqs) for _ in r.allowed_eos_ids]
        if eos_rows:
            eos_cols = [t for r in reqs for t in r.allowed_eos_ids]
            logits[self._h2d(eos_rows, torch.long), self._h2d(eos_cols, torch.long)] = float("-inf")
        # One sampler call per logprobs mode keeps every row's result its own.
        by_mode: dict = {}
        for i, r in enumerate(reqs):
            by_mode.setdefault(r.logprobs_mode if r.num_logprobs >= 0 else None, []).append(i)
        groups = []
        token_ids = torch.empty(len(reqs), dtype=torch.long, device=self.device)
        for mode, idx in by_mode.items():
            sub = [reqs[i] for i in idx]
            batch = SamplingBatch.from_lists(
                temperature=[r.temperature for r in sub], top_k=[r.top_k for r in sub], top_p=[r.top_p for r in sub],
                min_p=[r.min_p for r in sub], seeds=[r.seed for r in sub], positions=[r.output_index for r in sub],
                device=self.device, max_num_logprobs=max(r.num_logprobs for r in sub),
                logprobs_mode=mode or "tempered_logprobs")
            batch.penalties = self._penalties(sub, prev)
            batch.token_mask = self._token_mask(sub)
            so = self.sampler(logits if len(by_mode) == 1 else logits.index_select(0, self._h2d(idx, torch.long)), batch)
            if len(by_mode) == 1:
                token_ids = so.token_ids
            else:
                token_ids[self._h2d(idx, torch.long)] = so.token_ids
            groups.append((idx, self._to_host_async(so)))
        event = None
        if self.device.type == "cuda" and self.config.async_scheduling:
            event = torch.cuda.Event()
            event.record()
        return StepHandle(reqs, groups, token_ids, {r.req_id: i for i, r in enumerate(reqs)}, event)

    def _to_host_async(self, so):
        """Start copying the sampler's outputs into pinned host memory, so that waiting for
        this step (an event) does not also wait for the step enqueued after it."""
        if self.device.type != "cuda" or not self.config.async_scheduling:
            return so  # synchronous loop: collect() reads the device tensors right away
        from dataclasses import replace

        def host(t):
            if t is None:
                return None
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            return buf
        return replace(so, token_ids=host(so.token_ids), logprobs=host(so.logprobs), ranks=host(so.ranks),
                       topk_ids=host(so.topk_ids), topk_logprobs=host(so.topk_logprobs))

    def collect(self, handle: "StepHandle") -> ModelRunnerOutput:
        """Wait for the step and bring its sampled tokens (and logprobs) to the host."""
        result: dict[str, SampledToken] = {}
        if handle.event is not None:
            handle.event.synchronize()
        for idx, so in handle.groups:
            ids = so.token_ids.tolist()
            lps = so.logprobs.tolist() if so.logprobs is not None else None
            ranks = so.ranks.tolist() if so.ranks is not None else None
            top_ids = so.topk_ids.tolist() if so.topk_ids is not None else None
            top_lps = so.topk_logprobs.tolist() if so.topk_logprobs is not None else None
            for j, i in enumerate(idx):
                r = handle.reqs[i]
                tok = SampledToken(token_id=ids[j])
                if r.num_logprobs >= 0 and lps is not None:
                    tok.logprob, tok.rank = lps[j], ranks[j]
                    if r.num_logprobs > 0 and top_ids is not None:
                        tok.top = list(zip(top_ids[j][:r.num_logprobs], top_lps[j][:r.num_logprobs]))
                result[r.req_id] = tok
        prompt: dict[str, PromptLogprobsChunk] = {}
        for items, so in handle.prompt_parts:
            lps, ranks = so.logprobs.tolist(), so.ranks.tolist()
            top_ids = so.topk_ids.tolist() if so.topk_ids is not None else None
            top_lps = so.topk_logprobs.tolist() if so.topk_logprobs is not None else None
            for rid, pl, o in items:
                k = pl.num_top
                entries = [(lps[j], ranks[j], list(zip(top_ids[j][:k], top_lps[j][:k])) if k > 0 else [])
                           for j in range(o, o + len(pl.targets))]
                prompt[rid] = PromptLogprobsChunk(pl.first_position + 1, entries)
        return ModelRunnerOutput(sampled=result, prompt_logprobs=prompt)

    # ---- CUDA graphs ------------------------------------------------------------------
    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a captured graph reads: parameters, KV caches, input/output workspaces."""
        out = {f"param:{n}": p for n, p in self.model.named_parameters()}
        out.update(self.kv_cache.graph_tensors())
        for name in ("g_input_ids", "g_positions", "g_slots", "g_table", "g_cu", "g_seq_lens", "g_hidden",
                     "g_state_slots", "g_start_pos"):
            t = getattr(self, name, None)
            if t is not None:
                out[f"workspace:{name}"] = t
        return out

    def record_graph_pointers(self) -> None:
        self.graph_pointers = GraphPointerTable(self.graph_tensors())
        self._pointers_unverified = False

    def weights_changed(self) -> None:
        """The parameters were written (weight sync, optimizer step): verify before the next replay."""
        self._pointers_unverified = True

    def verify_graph_pointers(self) -> None:
        """Raise StaleGraphPointers if any tensor the graphs read moved (no-op without graphs)."""
        if self.graph_pointers is not None:
            self.graph_pointers.check(self.graph_tensors())
        self._pointers_unverified = False

    def _graph_size(self, n: int) -> int | None:
        for s in self.graph_batch_sizes:
            if s >= n:
                return s
        return None

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        sizes = self.config.cuda_graph_batch_sizes or default_graph_batch_sizes(self.config.scheduler.max_num_seqs)
        max_bs = max(sizes)
        dev = self.device
        self.g_input_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.g_positions = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.g_slots = torch.zeros(max_bs, dtype=torch.long, device=dev)  # padding rows write into the null block
        self.g_table = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.g_cu = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.g_seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.g_hidden = torch.zeros(max_bs, self.model.config.hidden_size, dtype=self.dtype, device=dev)
        if self.cache_specs.recurrent:
            # padding rows: the null slot, position 0 (a fresh state: nothing is read)
            self.g_state_slots = torch.zeros(max_bs, dtype=torch.int32, device=dev)
            self.g_start_pos = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        for bs in sorted(sizes, reverse=True):
            md = AttentionMetadata(self.g_slots[:bs], self.g_table[:bs], self.g_cu[:bs + 1], self.g_seq_lens[:bs],
                                   max_query_len=1, max_seq_len=self.max_model_len)
            self.g_seq_lens[:bs].fill_(1)
            self.attn.metadata = md
            def context() -> ForwardContext:
                # a fresh state metadata for each use: the chunk plan a recurrent layer derives
                # from the slots and positions (and caches per step) must be computed inside
                # the capture, so that every replay recomputes it from the graph's inputs
                state = None
                if self.cache_specs.recurrent:
                    state = self.kv_cache.state_backend(StateMetadata(self.g_cu[:bs + 1], self.g_start_pos[:bs],
                                                                      self.g_state_slots[:bs], 1))
                return ForwardContext(self.attn, self.config.numerics, self.config.kernels, state)
            with set_forward_context(context()):
                for _ in range(2):  # warm up: Triton autotuning/compilation happens outside capture
                    self.g_hidden[:bs] = self.model(self.g_input_ids[:bs], self.g_positions[:bs])
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with set_forward_context(context()), torch.cuda.graph(g, pool=pool):
                self.g_hidden[:bs] = self.model(self.g_input_ids[:bs], self.g_positions[:bs])
            self.graphs[bs] = g
        self.g_seq_lens.zero_()
        torch.cuda.synchronize()
        self.graph_batch_sizes = sorted(sizes)
        self.record_graph_pointers()
        logger.info("captured %d CUDA graphs in %.1f s", len(sizes), time.perf_counter() - t0)

    def _run_graph(self, bs: int, input_ids, positions, slots, table, seq_lens, fill=None,
                   state_slots=None) -> torch.Tensor:
        n = len(input_ids)
        pin = lambda a: torch.from_numpy(a).pin_memory()  # non_blocking copies need pinned sources
        self.g_input_ids[:n].copy_(pin(input_ids), non_blocking=True)
        self.g_positions[:n].copy_(pin(positions), non_blocking=True)
        self.g_slots[:n].copy_(pin(slots), non_blocking=True)
        self.g_table[:n].zero_()
        self.g_table[:n, :table.shape[1]].copy_(pin(table), non_blocking=True)
        self.g_seq_lens[:n].copy_(pin(seq_lens.astype(np.int32)), non_blocking=True)
        if state_slots is not None:
            self.g_state_slots[:n].copy_(pin(state_slots), non_blocking=True)
            self.g_start_pos[:n].copy_(pin(positions.astype(np.int32)), non_blocking=True)
        if bs > n:
            # Padding rows: context length 0 (attention writes nothing that is read), KV written to the null block.
            self.g_seq_lens[n:bs].zero_()
            self.g_slots[n:bs].zero_()
            self.g_input_ids[n:bs].zero_()
            self.g_positions[n:bs].zero_()
            if state_slots is not None:
                self.g_state_slots[n:bs].zero_()
                self.g_start_pos[n:bs].zero_()
        if fill is not None:
            fill(self.g_input_ids)
        if self._pointers_unverified:
            self.verify_graph_pointers()
        self.graphs[bs].replay()
        return self.g_hidden[:n]
