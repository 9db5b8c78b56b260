"""Which implementation runs each op, per numerics mode and device: the one place.

`NUMERICS_TABLE[op]` holds the op's `fast` and `invariant` implementations, each
split by device (CUDA, CPU). The op shim (`vllm/kernels/ops.py`) dispatches through
it with the mode of the forward context; the execution contract names the entries
that run (`describe`), and docs/numerics.md shows the table (`markdown`, kept equal
by tests/test_numerics_table.py).

- `fast` is the measured baseline: the fastest kernels available, with no promise
  across batch layouts.
- `invariant` runs kernels whose reduction order is fixed by the problem (K, head
  dim, row length, absolute KV position) and by nothing else; docs/numerics.md says
  why each axis of a schedule cannot reach its bits.

An op whose entries are the same object in both modes has no reduction a batch can
reach (elementwise ops, gathers, copies) or is batch-invariant by construction in both
(attention off fresh prefills, sampling).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from vllm.config import NUMERICS_MODES, KernelConfig
from vllm.kernels import (attention, attention_cpu, cache_dequant, cache_write, elementwise, flash_varlen, fp8_gemm,
                          gdn_chunk, gdn_ops, leaf_tree, mamba2_chunk, mamba2_ops, matmul, moe, rowwise, torch_ops)
from vllm.sample import sampler

# the parts of vllm whose code decides a token's bits: these kernels, the layers and models
# that call them (operation order, roundings), the sampler and the per-step metadata (the
# chunk plans of the recurrent layers). The execution contract carries their source digests
# (contract.code_digests).
CODE_PACKAGES = ("kernels", "layers", "models", "sample", "forward_context.py")


@dataclass(frozen=True)
class Impl:
    """One mode's implementation of an op on each device (None: no specialised kernel,
    see the op's entry in ops.py)."""
    cuda: Callable | None
    cpu: Callable | None
    # The CUDA entry is a kernel torch cannot differentiate (Triton, or cuBLASLt behind the
    # invariant GEMM): when a gradient is asked for, the op shim runs it inside its autograd
    # Function (vllm/kernels/autograd_ops.py), whose backward is written separately.
    cuda_autograd_fn: bool = True
    # The CPU entry computes one row at a time: autograd through it builds thousands of
    # nodes per layer (a backward ~30x slower than the forward), so it also trains through
    # the autograd Function and its batched backward.
    cpu_autograd_fn: bool = False
    # Keyword arguments the CUDA entry takes from the kernel options (vllm.config.KernelConfig).
    cuda_options: Callable[[KernelConfig], dict] | None = None

    def on(self, device: torch.device, kernels: KernelConfig | None = None) -> Callable | None:
        if device.type != "cuda":
            return self.cpu
        if self.cuda_options is None or self.cuda is None:
            return self.cuda
        return functools.partial(self.cuda, **self.cuda_options(kernels or KernelConfig()))


@dataclass(frozen=True)
class OpNumerics:
    fast: Impl
    invariant: Impl

    def mode(self, numerics: str) -> Impl:
        if numerics not in NUMERICS_MODES:
            raise ValueError(f"numerics must be one of {NUMERICS_MODES}, got {numerics!r}")
        return self.invariant if numerics == "invariant" else self.fast


def _torch(fn: Callable) -> Impl:
    """A torch function on both devices (torch differentiates it itself)."""
    return Impl(cuda=fn, cpu=fn, cuda_autograd_fn=False)


def _gemm_options(kernels: KernelConfig) -> dict:
    return {"allow_cublaslt": kernels.gemm_cublaslt}


_ROPE = Impl(cuda=elementwise.rope, cpu=torch_ops.rope)
_SILU = Impl(cuda=elementwise.silu_and_mul_triton, cpu=torch_ops.silu_and_mul)
# invariant mode on CPU: every silu on ATen's vector path, whatever the row length or threads
_SILU_INVARIANT = Impl(cuda=elementwise.silu_and_mul_triton, cpu=torch_ops.silu_and_mul_chunked)
_EMBEDDING = _torch(torch_ops.embedding)
_PAGED_ATTENTION = Impl(cuda=attention.paged_attention_triton, cpu=attention_cpu.paged_attention_cpu)
_KV_WRITE = Impl(cuda=cache_write.cache_kv, cpu=cache_write.cache_kv_ref)
_KV_WRITE_FP8 = Impl(cuda=cache_write.cache_kv_fp8, cpu=cache_write.cache_kv_fp8, cuda_autograd_fn=False)
_KV_DEQUANT_FP8 = Impl(cuda=cache_dequant.dequant_kv_blocks_triton, cpu=cache_dequant.dequant_kv_blocks_ref,
                       cuda_autograd_fn=False)
# Gated DeltaNet: the ops around the delta rule compute each element (conv tap sums, row
# norms) in one fixed order in both modes; the CPU entries avoid ATen's vector/scalar split
_CONV1D = Impl(cuda=gdn_ops.causal_conv1d_triton, cpu=gdn_ops.causal_conv1d_torch, cpu_autograd_fn=True)
_GDN_GATING = Impl(cuda=gdn_ops.gdn_gating_triton, cpu=gdn_ops.gdn_gating_torch, cpu_autograd_fn=True)
_RMS_NORM_GATED = Impl(cuda=gdn_ops.rms_norm_gated_triton, cpu=gdn_ops.rms_norm_gated_torch, cpu_autograd_fn=True)
_GDN_CHUNK_ALIGNED = Impl(cuda=functools.partial(gdn_chunk.gdn_chunk_triton, aligned=True),
                          cpu=functools.partial(gdn_chunk.gdn_chunk_torch, aligned=True), cpu_autograd_fn=True)
_GDN_CHUNK_STEP = Impl(cuda=functools.partial(gdn_chunk.gdn_chunk_triton, aligned=False),
                       cpu=functools.partial(gdn_chunk.gdn_chunk_torch, aligned=False), cpu_autograd_fn=True)
# Mamba-2 (Nemotron-H): the grouped gated norm as the GDN ops; the scan as the delta rule
_RMS_NORM_GATED_GROUPED = Impl(cuda=mamba2_ops.gated_norm_triton, cpu=mamba2_ops.gated_norm_torch,
                               cpu_autograd_fn=True)
_MAMBA2_CHUNK_ALIGNED = Impl(cuda=functools.partial(mamba2_chunk.mamba2_chunk_triton, aligned=True),
                             cpu=functools.partial(mamba2_chunk.mamba2_chunk_torch, aligned=True), cpu_autograd_fn=True)
_MAMBA2_CHUNK_STEP = Impl(cuda=functools.partial(mamba2_chunk.mamba2_chunk_triton, aligned=False),
                          cpu=functools.partial(mamba2_chunk.mamba2_chunk_torch, aligned=False), cpu_autograd_fn=True)
_RELU_SQUARED = _torch(torch_ops.relu_squared)
# Mixture of experts (docs/moe.md): routing and the merge train through their autograd
# Functions on both devices (vllm/kernels/moe_autograd.py); the expert MLPs wrap their own
# grouped GEMMs, and the shim hands them its silu_and_mul
_MOE_ROUTE_FAST = Impl(cuda=moe.route_fast, cpu=moe.route_fast, cpu_autograd_fn=True)
_MOE_ROUTE_INVARIANT = Impl(cuda=moe.route_invariant, cpu=moe.route_invariant, cpu_autograd_fn=True)
_MOE_MERGE_FAST = Impl(cuda=moe.merge_fast, cpu=moe.merge_fast, cpu_autograd_fn=True)
_LOG_SOFTMAX = _torch(sampler.batch_invariant_log_softmax)
_SAMPLER = _torch(sampler.Sampler)

NUMERICS_TABLE: dict[str, OpNumerics] = {
    # GEMMs: cuBLAS picks split-K / tiles by M; the invariant GEMM fixes the order by K.
    "linear": OpNumerics(
        fast=_torch(torch_ops.linear),
        invariant=Impl(cuda=matmul.invariant_matmul, cpu=torch_ops.linear_rows, cuda_options=_gemm_options,
                       cpu_autograd_fn=True)),
    # Row-parallel GEMMs (o_proj, down_proj) under tensor parallelism with K leaves: a rank's
    # subtree root in float32 (vllm/kernels/leaf_tree.py). Fast mode has no tree: each rank one
    # library GEMM, the partials summed.
    "tree_linear": OpNumerics(
        fast=_torch(leaf_tree.linear_partial_fast),
        invariant=Impl(cuda=leaf_tree.tree_linear_triton, cpu=leaf_tree.tree_linear_rows, cuda_options=_gemm_options,
                       cpu_autograd_fn=True)),
    "logits": OpNumerics(
        fast=_torch(torch_ops.logits),
        invariant=Impl(cuda=matmul.invariant_logits, cpu=torch_ops.logits_rows, cuda_options=_gemm_options,
                       cpu_autograd_fn=True)),
    # FP8 linear layers (quantization="fp8"): on CUDA in both modes the fixed-tile Triton FP8
    # GEMM, or from fp8_gemm.CUBLASLT_MIN_M rows cuBLASLt with the same bits (proved per
    # weight shape); on CPU the per-block tree-sum kernel (invariant) or dequantize + BLAS (fast).
    "fp8_linear": OpNumerics(
        fast=Impl(cuda=fp8_gemm.fp8_linear_cuda, cpu=fp8_gemm.fp8_linear_dequant, cuda_options=_gemm_options),
        invariant=Impl(cuda=fp8_gemm.fp8_linear_cuda, cpu=fp8_gemm.fp8_linear_rows, cuda_options=_gemm_options)),
    # Norms: one Triton program per row on CUDA in both modes; torch on CPU.
    "rms_norm": OpNumerics(
        fast=Impl(cuda=rowwise.rms_norm_triton, cpu=torch_ops.rms_norm),
        invariant=Impl(cuda=rowwise.rms_norm_triton, cpu=torch_ops.rms_norm_rows, cpu_autograd_fn=True)),
    "add_rms_norm": OpNumerics(
        fast=Impl(cuda=rowwise.add_rms_norm_triton, cpu=torch_ops.add_rms_norm),
        invariant=Impl(cuda=rowwise.add_rms_norm_triton, cpu=torch_ops.add_rms_norm_rows, cpu_autograd_fn=True)),
    # Zero-centred RMSNorm (Qwen3-Next, Qwen3.5): (x * rstd) * (1 + w), one rounding; the same
    # row kernel with its flag set.
    "zero_centred_rms_norm": OpNumerics(
        fast=Impl(cuda=rowwise.zero_centred_rms_norm_triton, cpu=torch_ops.zero_centred_rms_norm),
        invariant=Impl(cuda=rowwise.zero_centred_rms_norm_triton, cpu=torch_ops.zero_centred_rms_norm_rows,
                       cpu_autograd_fn=True)),
    "add_zero_centred_rms_norm": OpNumerics(
        fast=Impl(cuda=rowwise.add_zero_centred_rms_norm_triton, cpu=torch_ops.add_zero_centred_rms_norm),
        invariant=Impl(cuda=rowwise.add_zero_centred_rms_norm_triton, cpu=torch_ops.add_zero_centred_rms_norm_rows,
                       cpu_autograd_fn=True)),
    # Elementwise and gathers: each element depends on its own inputs only.
    "rope": OpNumerics(fast=_ROPE, invariant=_ROPE),
    "silu_and_mul": OpNumerics(fast=_SILU, invariant=_SILU_INVARIANT),
    # x * sigmoid(gate) (Qwen3-Next's attention output gate and shared-expert gate). The CPU's
    # sigmoid takes a vectorised or a scalar exp by where an element falls in the loop, which a
    # gate of one element per row [T, 1] makes depend on T: invariant mode goes row by row.
    "sigmoid_gate": OpNumerics(
        fast=Impl(cuda=elementwise.sigmoid_gate_triton, cpu=torch_ops.sigmoid_gate),
        invariant=Impl(cuda=elementwise.sigmoid_gate_triton, cpu=torch_ops.sigmoid_gate_rows, cpu_autograd_fn=True)),
    "embedding": OpNumerics(fast=_EMBEDDING, invariant=_EMBEDDING),
    # Attention. A prefill step whose sequences all start at position 0 may take a kernel on
    # the step's own q/k/v (None: prefill_attention runs); every other step reads the cache.
    "fresh_prefill_attention": OpNumerics(
        fast=Impl(cuda=flash_varlen.flash_prefill_attention, cpu=None),
        invariant=Impl(cuda=None, cpu=None)),
    "prefill_attention": OpNumerics(fast=_PAGED_ATTENTION, invariant=_PAGED_ATTENTION),
    "decode_attention": OpNumerics(fast=_PAGED_ATTENTION, invariant=_PAGED_ATTENTION),
    "kv_cache_write": OpNumerics(fast=_KV_WRITE, invariant=_KV_WRITE),
    # FP8 KV cache (kv_cache_dtype="fp8"): quantize per token per kv head, then the same copy
    "kv_cache_write_fp8": OpNumerics(fast=_KV_WRITE_FP8, invariant=_KV_WRITE_FP8),
    # ... and read: the step's blocks dequantized into a model-dtype copy that the attention
    # ops above then read (one read path: every schedule and the trainer run the same kernel)
    "kv_cache_dequant_fp8": OpNumerics(fast=_KV_DEQUANT_FP8, invariant=_KV_DEQUANT_FP8),
    # Gated DeltaNet (docs/hybrid.md). Invariant: the chunked form on the sequence's absolute
    # grid everywhere -- a decode step recomputes its partial chunk from the rows its state
    # kept, with the prefill's kernel and tiles. Fast: the native form, chunks from each step's
    # first token for prefills and the fused recurrence for decode.
    "causal_conv1d": OpNumerics(fast=_CONV1D, invariant=_CONV1D),
    "gdn_gating": OpNumerics(fast=_GDN_GATING, invariant=_GDN_GATING),
    "rms_norm_gated": OpNumerics(fast=_RMS_NORM_GATED, invariant=_RMS_NORM_GATED),
    "gated_delta_rule": OpNumerics(fast=_GDN_CHUNK_STEP, invariant=_GDN_CHUNK_ALIGNED),
    "gated_delta_rule_decode": OpNumerics(
        fast=Impl(cuda=gdn_ops.gdn_recurrent_triton, cpu=gdn_ops.gdn_recurrent_torch), invariant=_GDN_CHUNK_ALIGNED),
    # Mamba-2 (docs/hybrid.md, "Mamba-2"): the same scheme as the delta rule. Invariant: the
    # chunked scan on the sequence's absolute grid everywhere, a decode step recomputing its
    # partial chunk from the rows its state kept. Fast: chunks from each step's first token for
    # prefills, the selective state update for decode. The gated norm (the gate before the
    # norm, statistics per group) and relu^2 have no reduction a batch reaches.
    "rms_norm_gated_grouped": OpNumerics(fast=_RMS_NORM_GATED_GROUPED, invariant=_RMS_NORM_GATED_GROUPED),
    "mamba2_scan": OpNumerics(fast=_MAMBA2_CHUNK_STEP, invariant=_MAMBA2_CHUNK_ALIGNED),
    "mamba2_scan_decode": OpNumerics(
        fast=Impl(cuda=mamba2_ops.selective_state_update_triton, cpu=mamba2_ops.selective_state_update_torch),
        invariant=_MAMBA2_CHUNK_ALIGNED),
    "relu_squared": OpNumerics(fast=_RELU_SQUARED, invariant=_RELU_SQUARED),
    # Mixture of experts (docs/moe.md). Invariant: softmax by a fixed pairwise sum and top-k by
    # a stable sort (ties to the lower expert id); each (token, slot) row of the expert MLPs
    # one float32 reduction along K whatever the batch (grouped Triton GEMM, or one [1, K] row
    # at a time on CPU), the down projection kept in float32; the merge in slot order, one
    # rounding. Fast: torch softmax + topk, torch's grouped GEMM (a per-expert loop on CPU) in
    # the model dtype, a torch sum over slots.
    "moe_route": OpNumerics(fast=_MOE_ROUTE_FAST, invariant=_MOE_ROUTE_INVARIANT),
    "moe_experts": OpNumerics(
        fast=Impl(cuda=moe.experts_fast, cpu=moe.experts_loop, cuda_autograd_fn=False),
        invariant=Impl(cuda=moe.experts_grouped_triton, cpu=moe.experts_rows_cpu, cuda_autograd_fn=False)),
    "moe_merge": OpNumerics(
        fast=_MOE_MERGE_FAST,
        invariant=Impl(cuda=moe.merge_slots_triton, cpu=moe.merge_slots_torch, cpu_autograd_fn=True)),
    # Logprobs and sampling: fixed pairwise trees and exact ops in both modes (docs/sampling.md);
    # the sampler takes its fused Gumbel-max path on CUDA for rows without truncation.
    "log_softmax": OpNumerics(fast=_LOG_SOFTMAX, invariant=_LOG_SOFTMAX),
    "sampling": OpNumerics(fast=_SAMPLER, invariant=_SAMPLER),
}


def kernel_for(op: str, numerics: str, device: torch.device | str, kernels: KernelConfig | None = None) -> Callable | None:
    """The implementation of `op` that runs in `numerics` mode on `device` (with the kernel
    options it takes bound)."""
    return NUMERICS_TABLE[op].mode(numerics).on(torch.device(device), kernels)


def _name(fn: Callable | None) -> str | None:
    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        args = ", ".join(f"{k}={v}" for k, v in fn.keywords.items())
        return f"{_name(fn.func)}({args})"
    return f"{fn.__module__.removeprefix('vllm.')}.{fn.__qualname__}"


def describe(numerics: str, device: torch.device | str, kernels: KernelConfig | None = None) -> dict[str, str | None]:
    """{op: implementation} for one mode, device and set of kernel options, as the
    execution contract records it."""
    return {op: _name(kernel_for(op, numerics, device, kernels)) for op in NUMERICS_TABLE}


def markdown() -> str:
    """The table as docs/numerics.md shows it."""
    lines = ["| op | fast, CUDA | fast, CPU | invariant, CUDA | invariant, CPU |",
             "| --- | --- | --- | --- | --- |"]
    for op, entry in NUMERICS_TABLE.items():
        cells = [_name(fn) for impl in (entry.fast, entry.invariant) for fn in (impl.cuda, impl.cpu)]
        lines.append(f"| {op} | " + " | ".join(f"`{c}`" if c else "-" for c in cells) + " |")
    return "\n".join(lines) + "\n"
