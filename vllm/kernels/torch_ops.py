"""Ops written in torch.

Fast mode runs these where no fused kernel serves the device: `F.linear` is cuBLAS on
CUDA and the CPU BLAS elsewhere, and the CPU takes every formula below. Invariant mode
on CPU runs the `*_rows` forms: every reduction on one row at a time, on a fresh
contiguous copy of one shape, so the library picks the same code path and order
whatever the batch looked like. That is slow but exact; CPU is for tests and tiny models.
Which function runs where is decided in one place: `vllm/kernels/numerics_table.py`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


# ---- whole batch (fast mode; CPU, and F.linear on CUDA) ------------------------------------
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """lm_head in the model dtype, then float32."""
    return F.linear(hidden, weight).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * (x / sqrt(mean(x^2) + eps)), statistics in float32, output in x's dtype."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual  # elementwise, in the model dtype
    return rms_norm(residual, weight, eps), residual


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = (x / sqrt(mean(x^2) + eps)) * (1 + w) in float32, rounded once to x's dtype."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps) * (1.0 + weight.float())).to(x.dtype)


def add_zero_centred_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual  # elementwise, in the model dtype
    return zero_centred_rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# A multiple of every SIMD width ATen uses (2 vectors of 16 floats / 32 bf16 on AVX-512) and
# far below its threading grain, so a chunk never has a scalar tail nor a thread split.
POINTWISE_CHUNK = 2048


def pointwise_in_chunks(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, evaluated on contiguous chunks of one fixed length.
    ATen computes silu, sigmoid and softplus with SIMD code over whole vectors and scalar
    code on a tensor's tail (and splits large tensors across threads at offsets of their
    size), and the two paths differ in the last bit: the result of an element would depend on
    where the batch, or a tensor-parallel rank's slice, put it. Fixed chunks put every element
    on the SIMD path."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % POINTWISE_CHUNK
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    out = torch.cat([fn(c) for c in flat.split(POINTWISE_CHUNK)]) if n else fn(flat)
    return out[:n].view(x.shape)


def silu_and_mul_chunked(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with every silu on ATen's vector path (pointwise_in_chunks): an
    element's bits do not depend on the row's length (a tensor-parallel rank's slice of the
    intermediate dim), the batch, or the CPU's thread count. The product is one IEEE
    multiplication: the same on either path."""
    gate, up = x.chunk(2, dim=-1)
    return pointwise_in_chunks(F.silu, gate.contiguous()) * up


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Nemotron-H's MLP activation, transformers' relu2): an exact relu, then one
    rounding of the square; elementwise, so the same bits on every path and device."""
    return torch.square(torch.relu(x))


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate): the sigmoid rounded to the model dtype, then the product (gate's
    last dim may be 1: one gate per row)."""
    return x * torch.sigmoid(gate)


def rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [T, H, D] by cos/sin [T, R/2], in float32, rounded once: the
    first R dims of each head are rotated (R = D: full rope), the rest passed through."""
    half = cos.shape[-1]
    rot = 2 * half
    xf = x[..., :rot].float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    if rot == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rot:]), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_one(q, cos, sin), rope_one(k, cos, sin)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # A gather: no reduction, identical in every mode.
    return F.embedding(ids, weight)


# ---- one row at a time (invariant mode on CPU) -----------------------------------------------
def _rows(fn, x: torch.Tensor, *args) -> torch.Tensor:
    """Apply fn to each row of x ([..., D]) separately, each as a fresh [1, D] tensor."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        probe = fn(x2[:0].clone(), *args)
        return probe.reshape(*lead, probe.shape[-1])
    outs = [fn(x2[i:i + 1].clone(), *args) for i in range(x2.shape[0])]
    out = torch.cat(outs, dim=0)
    return out.reshape(*lead, out.shape[-1])


# A one-row GEMM (the BLAS's matrix-vector kernel) computes output columns in groups of this
# many; a remainder takes another kernel, whose sums differ in the last bit. Weights are padded
# to a multiple of it, so a column's bits do not depend on how many columns the GEMM has (a
# tensor-parallel rank's slice of the rows against the whole weight).
GEMV_COLUMN_GROUP = 4


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    n = weight.shape[0]
    pad = -n % GEMV_COLUMN_GROUP
    if pad:
        weight = torch.cat((weight, weight.new_zeros(pad, weight.shape[1])))
        if bias is not None:
            bias = torch.cat((bias, bias.new_zeros(pad)))
        return _rows(lambda r: F.linear(r, weight, bias), x)[..., :n]
    return _rows(lambda r: F.linear(r, weight, bias), x)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rows(lambda r: rms_norm(r, weight, eps), x)


def add_rms_norm_rows(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, norm_rows=rms_norm_rows) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual  # elementwise: invariant
    return norm_rows(residual, weight, eps), residual


def zero_centred_rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rows(lambda r: zero_centred_rms_norm(r, weight, eps), x)


def add_zero_centred_rms_norm_rows(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm_rows(x, residual, weight, eps, norm_rows=zero_centred_rms_norm_rows)


def sigmoid_gate_rows(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) one token (index of dim 0) at a time: the vectorised and the scalar exp
    of the CPU's sigmoid differ in the last bit, and which one an element gets must not depend
    on the batch."""
    if x.shape[0] == 0:
        return sigmoid_gate(x, gate)
    return torch.cat([sigmoid_gate(x[i:i + 1].clone(), gate[i:i + 1].clone()) for i in range(x.shape[0])], dim=0)


def logits_rows(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """lm_head computed in float32 (logits are never rounded to the model dtype)."""
    return _rows(lambda r: F.linear(r.float(), weight.float()), hidden)
