"""Kernel shim: every op the model calls, dispatched on the numerics mode.

`fast` uses the fastest library kernels (cuBLAS through F.linear, torch's
fused ops). `invariant` kernels (fixed reduction order) register themselves
here from their own modules; until a verified invariant kernel exists for an
op, asking for it is an error rather than a silent fallback.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


_INVARIANT: dict[str, Callable] = {}


def register_invariant(name: str, fn: Callable) -> None:
    _INVARIANT[name] = fn


def _ensure_registered() -> None:
    if not _INVARIANT:
        import vllm.kernels.invariant  # noqa: F401  (registers on import)


def _mode() -> str:
    from vllm import forward_context

    ctx = forward_context._CURRENT
    return ctx.numerics if ctx is not None else "fast"


def _dispatch(name: str) -> Callable | None:
    if _mode() == "invariant":
        _ensure_registered()
        fn = _INVARIANT.get(name)
        if fn is None:
            raise RuntimeError(f"numerics='invariant' has no verified kernel for op {name!r}")
        return fn
    return None


def _needs_autograd(*tensors) -> bool:
    """True when an invariant kernel is asked for gradients. It runs inside an autograd
    Function with a separately verified backward: Triton kernels are not differentiable
    by themselves, and autograd through the CPU kernels' one-row-at-a-time ops builds a
    graph of thousands of nodes per layer (a backward ~30x slower than the forward)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    fn = _dispatch("linear")
    if fn is not None:
        if _needs_autograd(x, weight, bias):
            from vllm.kernels.autograd_ops import LinearFn
            return LinearFn.apply(x, weight, bias, fn)
        return fn(x, weight, bias)
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * (x / sqrt(mean(x^2) + eps)), statistics in float32, output in x's dtype."""
    fn = _dispatch("rms_norm")
    if fn is None and x.is_cuda:
        # one fused row kernel instead of ~6 torch kernels (also the invariant one)
        from vllm.kernels.rowwise import rms_norm_triton
        fn = rms_norm_triton
    if fn is not None:
        if _needs_autograd(x, weight):
            from vllm.kernels.autograd_ops import RMSNormFn
            return RMSNormFn.apply(x, weight, eps, fn)
        return fn(x, weight, eps)
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (in the model dtype); returns (rms_norm(residual'), residual')."""
    fn = _dispatch("add_rms_norm")
    if fn is None and x.is_cuda:
        from vllm.kernels.rowwise import rms_norm_triton
        fn = lambda x_, r_, w_, e_: rms_norm_triton(x_, w_, e_, residual=r_)  # noqa: E731
    if fn is not None:
        if _needs_autograd(x, residual, weight):
            from vllm.kernels.autograd_ops import AddRMSNormFn
            return AddRMSNormFn.apply(x, residual, weight, eps, fn)
        return fn(x, residual, weight, eps)
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    fn = _dispatch("silu_and_mul") or _silu_and_mul_fast
    if x.is_cuda and _needs_autograd(x):
        from vllm.kernels.autograd_ops import SiluAndMulFn
        return SiluAndMulFn.apply(x, fn)
    return fn(x)


def _silu_and_mul_fast(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from vllm.kernels.elementwise import silu_and_mul_triton
        return silu_and_mul_triton(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding. q: [T, Hq, D], k: [T, Hk, D], cos/sin: [T, D/2] float32.

    Computed in float32 and rounded once to the model dtype.
    """
    fn = _dispatch("rope") or _rope_fast
    if q.is_cuda and _needs_autograd(q, k):
        from vllm.kernels.autograd_ops import RopeFn
        return RopeFn.apply(q, k, cos, sin, fn)
    return fn(q, k, cos, sin)


def _rope_fast(q, k, cos, sin):
    if q.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:
        from vllm.kernels.elementwise import rope_triton
        return rope_triton(q, k, cos, sin)
    return _rope_one(q, cos, sin), _rope_one(k, cos, sin)


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # A gather: no reduction, identical in every mode.
    return F.embedding(ids, weight)


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """lm_head in float32 output: logits feed sampling and logprobs, both computed in float32."""
    fn = _dispatch("logits")
    if fn is not None:
        if _needs_autograd(hidden, weight):
            from vllm.kernels.autograd_ops import LinearFn
            return LinearFn.apply(hidden, weight, None, lambda x_, w_, b_: fn(x_, w_))
        return fn(hidden, weight)
    return F.linear(hidden, weight).float()
