"""Op shim: every op the model and the attention backends call, dispatched through the
numerics table (vllm/kernels/numerics_table.py) with the mode of the forward context.

On CUDA a kernel torch cannot differentiate (Triton, cuBLASLt) runs inside its autograd
Function (vllm/kernels/autograd_ops.py) when a gradient is asked for, so the training
forward computes the rollout's bits and still has a backward.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from vllm.forward_context import current_kernel_config, current_numerics
from vllm.kernels.autograd_ops import AddRMSNormFn, LinearFn, RMSNormFn, RopeFn, SigmoidGateFn, SiluAndMulFn
from vllm.kernels.moe import Routing
from vllm.kernels.moe_autograd import MergeFn, RouterFn
from vllm.kernels.numerics_table import NUMERICS_TABLE


def _kernel(op: str, x: torch.Tensor) -> tuple[Callable | None, bool]:
    """(implementation for x's device in the current mode, with the kernel options it takes
    bound; whether it needs its autograd Function)."""
    impl = NUMERICS_TABLE[op].mode(current_numerics())
    fn = impl.on(x.device, current_kernel_config())
    return fn, (impl.cuda_autograd_fn if x.is_cuda else impl.cpu_autograd_fn)


def _needs_autograd(*tensors) -> bool:
    """True when an invariant kernel is asked for gradients. It runs inside an autograd
    Function with a separately verified backward: Triton kernels are not differentiable
    by themselves, and autograd through the CPU kernels' one-row-at-a-time ops builds a
    graph of thousands of nodes per layer (a backward ~30x slower than the forward)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    fn, wrap = _kernel("linear", x)
    if wrap and _needs_autograd(x, weight, bias):
        return LinearFn.apply(x, weight, bias, fn)
    return fn(x, weight, bias)


def tree_linear(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T as the K-leaf tree of row-parallel layers
    (vllm/kernels/leaf_tree.py) -> float32 [..., N], the subtree root of `leaves` leaves (fast
    mode: one plain GEMM, no tree). Its backward is the plain GEMM of LinearFn: gradients
    need no tree."""
    fn, wrap = _kernel("tree_linear", x)
    if wrap and _needs_autograd(x, weight):
        return LinearFn.apply(x, weight, None, lambda x_, w_, b_: fn(x_, w_, leaves))
    return fn(x, weight, leaves)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_fp8: torch.Tensor, weight_scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Block-scaled FP8 linear (vllm/kernels/fp8_gemm.py): x quantized per token per 128
    channels, times the fp8 weight copy. `weight` (the master) only receives the gradient
    (straight-through estimator, FP8LinearFn) when one is asked for."""
    fn, _ = _kernel("fp8_linear", x)
    if _needs_autograd(x, weight, bias):
        from vllm.kernels.fp8_gemm import FP8LinearFn
        return FP8LinearFn.apply(x, weight, weight_fp8, weight_scale_inv, bias, fn)
    return fn(x, weight_fp8, weight_scale_inv, bias)


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """lm_head in float32 output: logits feed sampling and logprobs, both computed in float32."""
    fn, wrap = _kernel("logits", hidden)
    if wrap and _needs_autograd(hidden, weight):
        return LinearFn.apply(hidden, weight, None, lambda x_, w_, b_: fn(x_, w_))
    return fn(hidden, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * (x / sqrt(mean(x^2) + eps)), statistics in float32, output in x's dtype."""
    fn, wrap = _kernel("rms_norm", x)
    if wrap and _needs_autograd(x, weight):
        return RMSNormFn.apply(x, weight, eps, fn)
    return fn(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (in the model dtype); returns (rms_norm(residual'), residual')."""
    fn, wrap = _kernel("add_rms_norm", x)
    if wrap and _needs_autograd(x, residual, weight):
        return AddRMSNormFn.apply(x, residual, weight, eps, fn)
    return fn(x, residual, weight, eps)


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = (x / sqrt(mean(x^2) + eps)) * (1 + w): float32 throughout, rounded once to x's dtype."""
    fn, wrap = _kernel("zero_centred_rms_norm", x)
    if wrap and _needs_autograd(x, weight):
        return RMSNormFn.apply(x, weight, eps, fn, True)
    return fn(x, weight, eps)


def add_zero_centred_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (in the model dtype); returns (zero_centred_rms_norm(residual'), residual')."""
    fn, wrap = _kernel("add_zero_centred_rms_norm", x)
    if wrap and _needs_autograd(x, residual, weight):
        return AddRMSNormFn.apply(x, residual, weight, eps, fn, True)
    return fn(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    fn, wrap = _kernel("silu_and_mul", x)
    if wrap and _needs_autograd(x):
        return SiluAndMulFn.apply(x, fn)
    return fn(x)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), gate of x's shape or with last dim 1 (one gate per row); the sigmoid
    is rounded to the model dtype, then the product, as torch computes it."""
    fn, wrap = _kernel("sigmoid_gate", x)
    if wrap and _needs_autograd(x, gate):
        return SigmoidGateFn.apply(x, gate, fn)
    return fn(x, gate)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding. q: [T, Hq, D], k: [T, Hk, D], cos/sin: [T, R/2]
    float32: the first R dims of each head are rotated (R = D: the full rope), the rest passed
    through (partial rope).

    Computed in float32 and rounded once to the model dtype.
    """
    fn, wrap = _kernel("rope", q)
    if wrap and _needs_autograd(q, k):
        return RopeFn.apply(q, k, cos, sin, fn)
    return fn(q, k, cos, sin)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    fn, _ = _kernel("embedding", weight)
    return fn(ids, weight)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, md, conv_state: torch.Tensor | None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv (+ bias [D]) over the step's packed sequences, then SiLU: x [T, D],
    weight [D, W]; the W - 1 inputs before a sequence's first new token come from its slot of
    `conv_state` [slots, W - 1, D] (which is updated in place), none for a sequence at position 0
    (vllm/kernels/gdn_ops.py)."""
    fn, wrap = _kernel("causal_conv1d", x)
    if wrap and _needs_autograd(x, weight, bias):
        from vllm.kernels.gdn_ops import CausalConv1dFn
        return CausalConv1dFn.apply(x, weight, md, conv_state, fn, bias)
    return fn(x, weight, md, conv_state) if bias is None else fn(x, weight, md, conv_state, bias)


def gdn_gating(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor):
    """Gated DeltaNet's per-token gates: (l2-normalised q, k, g = -exp(A_log) softplus(a + dt_bias)
    in float32, beta = sigmoid(b) in float32)."""
    fn, wrap = _kernel("gdn_gating", q)
    if wrap and _needs_autograd(q, k, a, b, A_log, dt_bias):
        from vllm.kernels.gdn_ops import GdnGatingFn
        return GdnGatingFn.apply(q, k, a, b, A_log, dt_bias, fn)
    return fn(q, k, a, b, A_log, dt_bias)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, md, state: dict | None, *, chunk_size: int) -> torch.Tensor:
    """The gated delta rule over the step's tokens (docs/hybrid.md): q, k [T, Hk, K], v [T, Hv, V],
    g, beta [T, Hv] float32 -> [T, Hv, V]; `state`: the layer's cached state tensors by name
    (None: fresh sequences, nothing kept: the trainer)."""
    op = "gated_delta_rule_decode" if md.max_query_len == 1 and state is not None else "gated_delta_rule"
    fn, wrap = _kernel(op, q)
    if wrap and _needs_autograd(q, k, v, g, beta):
        from vllm.kernels.gdn_chunk import GatedDeltaRuleFn
        return GatedDeltaRuleFn.apply(functools.partial(fn, chunk_size=chunk_size), q, k, v, g, beta, scale, md,
                                      chunk_size)
    return fn(q, k, v, g, beta, scale, md, state, chunk_size=chunk_size)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(z), rounded as transformers' gated RMSNorm: x, z [..., V]."""
    fn, wrap = _kernel("rms_norm_gated", x)
    if wrap and _needs_autograd(x, z, weight):
        from vllm.kernels.gdn_ops import RMSNormGatedFn
        return RMSNormGatedFn.apply(x, z, weight, eps, fn)
    return fn(x, z, weight, eps)


def mamba2_scan(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, dt_min: float, md, state: dict | None, *,
                chunk_size: int) -> torch.Tensor:
    """The Mamba-2 scan over the step's tokens (docs/hybrid.md, "Mamba-2"): x [T, H, P], dt [T, H]
    (before softplus), B, C [T, G, N], dt_bias, A_log, D [H] -> y [T, H, P] (D x included);
    `state`: the layer's cached state tensors by name (None: fresh sequences, nothing kept: the
    trainer)."""
    op = "mamba2_scan_decode" if md.max_query_len == 1 and state is not None else "mamba2_scan"
    fn, wrap = _kernel(op, x)
    if wrap and _needs_autograd(x, dt, dt_bias, A_log, B, C, D):
        from vllm.kernels.mamba2_chunk import Mamba2ChunkScanFn
        return Mamba2ChunkScanFn.apply(functools.partial(fn, chunk_size=chunk_size), x, dt, dt_bias, A_log, B, C, D,
                                       dt_min, md, chunk_size)
    return fn(x, dt, dt_bias, A_log, B, C, D, dt_min, md, state, chunk_size=chunk_size)


def rms_norm_gated_grouped(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                           groups: int) -> torch.Tensor:
    """weight * rmsnorm(x * silu(z)) with the statistics over each of `groups` equal slices of a
    row, rounded as transformers' Mamba-2 gated norm: x, z [T, D], weight [D]."""
    fn, wrap = _kernel("rms_norm_gated_grouped", x)
    if wrap and _needs_autograd(x, z, weight):
        from vllm.kernels.mamba2_ops import GatedNormFn
        return GatedNormFn.apply(x, z, weight, eps, groups, fn)
    return fn(x, z, weight, eps, groups)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2, elementwise (Nemotron-H's MLP activation)."""
    fn, _ = _kernel("relu_squared", x)
    return fn(x)


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """The router's float32 logits [T, E] -> each token's top-k experts, their weights and
    the full probabilities (vllm/kernels/moe.py)."""
    fn, wrap = _kernel("moe_route", logits)
    if wrap and _needs_autograd(logits):
        weights, probs, ids = RouterFn.apply(logits, top_k, norm_topk_prob, fn)
        return Routing(ids, weights, probs)
    return fn(logits, top_k, norm_topk_prob)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token's k expert MLPs, unweighted -> y [T, k, H] (float32 in invariant mode, the
    model dtype in fast mode); their activation is this shim's silu_and_mul."""
    fn, _ = _kernel("moe_experts", x)
    return fn(x, w13, w2, ids, silu_and_mul)


def moe_merge(y: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """sum over slots of y [T, k, H] * w [T, k] -> [T, H] in out_dtype."""
    fn, wrap = _kernel("moe_merge", y)
    if wrap and _needs_autograd(y, w):
        return MergeFn.apply(y, w, out_dtype, fn)
    return fn(y, w, out_dtype)


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """Scatter this step's K/V rows [T, Hkv, D] into their paged-cache slots, in place."""
    fn, _ = _kernel("kv_cache_write", k)
    fn(k, v, k_cache, v_cache, slots)


def kv_cache_write_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize this step's K/V rows by the FP8 KV rule and scatter payload and scales."""
    fn, _ = _kernel("kv_cache_write_fp8", k)
    fn(k, v, k_cache, v_cache, k_scale, v_scale, slots)


def kv_cache_dequant_fp8(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                         k_out: torch.Tensor, v_out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         max_seq_len: int) -> None:
    """Dequantize the blocks this step's sequences use (below their lengths) into the
    model-dtype copies k_out / v_out, at the same block ids (vllm/kernels/cache_dequant.py)."""
    fn, _ = _kernel("kv_cache_dequant_fp8", k_out)
    fn(k_cache, v_cache, k_scale, v_scale, k_out, v_out, block_table, seq_lens, max_seq_len)


def kv_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What an FP8 KV cache returns for K/V rows x (quantize + dequantize, vllm/kernels/fp8.py)."""
    from vllm.kernels.fp8 import kv_round_trip as round_trip
    return round_trip(x)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, *, max_query_len: int,
              max_seq_len: int, fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal paged attention for this step's queries, whose K/V are already in the cache
    (arguments as in vllm.kernels.attention.paged_attention_triton).

    `fresh_kv`: the step's own (k, v), passed when every sequence starts at position 0 (no
    cached context), so a mode may use a kernel on the step's own tensors instead (for an
    FP8 cache: their round trip through it). An FP8 cache is read through its model-dtype
    copy (`kv_cache_dequant_fp8`), so the caches here are always in q's dtype."""
    if fresh_kv is not None and max_query_len > 1:
        fn, _ = _kernel("fresh_prefill_attention", q)
        out = fn(q, *fresh_kv, cu_seqlens_q, max_query_len, scale) if fn is not None else None
        if out is not None:
            return out
    fn, _ = _kernel("decode_attention" if max_query_len == 1 else "prefill_attention", q)
    return fn(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale,
              max_query_len=max_query_len, max_seq_len=max_seq_len)
