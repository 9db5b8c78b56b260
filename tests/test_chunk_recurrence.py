"""The chunk-to-chunk delta rule of Gated DeltaNet's training backward
(vllm/kernels/chunk_recurrence.py): the Triton programs (interpreted on CPU) and the torch
loops against float64 autograd of the plain recurrence, and the float64 loops by gradcheck."""
from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton
import triton.language as tl

from vllm.kernels import chunk_recurrence as cr
from vllm.kernels.training_tiles import round_bf16
from vllm.testing.chunked_scan import DEVICE as DEV, rel_err


def autograd_recurrence(u, w, kd, e):
    """The recurrence as plain differentiable torch (the definition the backward must match)."""
    S = u.new_zeros((*u.shape[:2], w.shape[-1], u.shape[-1]))
    states, vns = [], []
    for c in range(u.shape[2]):
        states.append(S)
        vn = u[:, :, c] - w[:, :, c] @ S
        vns.append(vn)
        S = S * e[:, :, c, None, None] + kd[:, :, c].transpose(-1, -2) @ vn
    return torch.stack(states, 2), torch.stack(vns, 2)


def make(B, H, nC, C, K, V, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(B, H, nC, C, V, generator=gen)
    w = torch.randn(B, H, nC, C, K, generator=gen) / K
    kd = torch.randn(B, H, nC, C, K, generator=gen) / K
    e = torch.rand(B, H, nC, generator=gen) * 0.5 + 0.5
    gs = torch.randn(B, H, nC, K, V, generator=gen)
    gvn = torch.randn(B, H, nC, C, V, generator=gen)
    return [t.to(dtype) for t in (u, w, kd, e)], [t.to(dtype) for t in (gs, gvn)]


def reference(inputs, grads):
    xs = [t.double().requires_grad_() for t in inputs]
    states, vn = autograd_recurrence(*xs)
    loss = (states * grads[0].double()).sum() + (vn * grads[1].double()).sum()
    d = torch.autograd.grad(loss, xs, allow_unused=True)
    return (states, vn), [torch.zeros_like(x) if g is None else g for g, x in zip(d, xs)]


# (B, H, nC, C, K, V): padded tiles (C, K, V not powers of two) and V split over programs
SHAPES = [(1, 2, 3, 16, 16, 32), (2, 1, 4, 5, 12, 20), (1, 1, 2, 16, 16, 80), (1, 1, 1, 16, 16, 16)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_forward_and_backward_match_float64(shape, impl, monkeypatch):
    monkeypatch.setattr(cr, "BLOCK_V_MAX", 32)  # two V tiles at V 40/80: the parts program's V loop
    inputs, grads = make(*shape, seed=sum(shape))
    (s64, v64), d64 = reference(inputs, grads)
    fwd = getattr(cr, f"recurrence_forward_{impl}")
    bwd = getattr(cr, f"recurrence_backward_{impl}")
    on = [t.to(DEV) for t in inputs]
    states, vn = fwd(*on)
    assert rel_err(states.cpu(), s64) < 1e-5 and rel_err(vn.cpu(), v64) < 1e-5
    got = bwd(on[1], on[2], on[3], states, vn, *(g.to(DEV) for g in grads))
    for name, a, b in zip(("du", "dw", "dkd", "de"), got, d64):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert rel_err(a.cpu(), b) < 1e-5, name


def test_function_gradcheck_float64():
    inputs, _ = make(1, 2, 3, 3, 4, 5, seed=3, dtype=torch.float64)
    xs = [t.requires_grad_() for t in inputs]
    assert torch.autograd.gradcheck(lambda *a: cr.ChunkRecurrenceFn.apply(*a), xs)


def test_triton_rejects_other_dtypes():
    inputs, _ = make(1, 1, 2, 4, 4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32"):
        cr.recurrence_forward_triton(*(t.to(DEV) for t in inputs))
    u, w, kd, e = (t.to(DEV) for t in make(1, 1, 2, 8, 8, 8)[0])
    with pytest.raises(ValueError, match="bf16 dots"):  # bfloat16 operands with float32 dots
        cr.recurrence_forward_triton(u, w.bfloat16(), kd.bfloat16(), e, "ieee")
    with pytest.raises(ValueError, match="bf16 dots"):
        cr.recurrence_forward_triton(u, w, kd, e, "ieee", vn_dtype=torch.bfloat16)


BF16_DOTS = "bf16" if DEV == "cuda" else "bf16_emulated"


@pytest.mark.parametrize("shape", [(1, 2, 3, 16, 16, 32), (1, 1, 2, 16, 16, 80)])
def test_bf16_operands_give_the_same_bits(shape, monkeypatch):
    """With bf16 dots, w and kd in bfloat16 and v_new stored in it give the bits of float32
    operands, forward and backward (the dots round those operands to bfloat16 anyway)."""
    monkeypatch.setattr(cr, "BLOCK_V_MAX", 32)
    (u, w, kd, e), (gs, gvn) = ([t.to(DEV) for t in ts] for ts in make(*shape, seed=7))
    states, vn = cr.recurrence_forward_triton(u, w, kd, e, BF16_DOTS)
    grads = cr.recurrence_backward_triton(w, kd, e, states, vn, gs, gvn, BF16_DOTS)
    wb, kdb = w.bfloat16(), kd.bfloat16()
    states_b, vn_b = cr.recurrence_forward_triton(u, wb, kdb, e, BF16_DOTS, vn_dtype=torch.bfloat16)
    assert vn_b.dtype == torch.bfloat16 and torch.equal(states_b, states)
    assert torch.equal(vn_b, vn.bfloat16())  # v_new rounded to nearest
    grads_b = cr.recurrence_backward_triton(wb, kdb, e, states_b, vn_b, gs, gvn, BF16_DOTS)
    for name, a, b in zip(("du", "dw", "dkd", "de"), grads_b, grads):
        assert a.dtype == torch.float32 and torch.equal(a, b), name


def test_bf16_u_is_taken_as_given():
    """With bf16 dots, u may come in bfloat16: the forward gives the bits of that u passed
    widened to float32 (v_new = u - w S, u widened exactly); with other dots it is refused."""
    (u, w, kd, e), _ = ([t.to(DEV) for t in ts] for ts in make(1, 2, 3, 16, 16, 32, seed=8))
    ub = u.bfloat16()
    got = cr.recurrence_forward_triton(ub, w, kd, e, BF16_DOTS)
    want = cr.recurrence_forward_triton(ub.float(), w, kd, e, BF16_DOTS)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert not torch.equal(got[1], cr.recurrence_forward_triton(u, w, kd, e, BF16_DOTS)[1])  # u's rounding shows
    with pytest.raises(ValueError, match="bfloat16 u"):
        cr.recurrence_forward_triton(ub, w, kd, e, "ieee")


def test_bf16_du_is_the_float32_du_rounded_and_keeps_the_other_gradients(monkeypatch):
    """du_dtype bfloat16 (the GDN backward's, whose every use of du is a dot operand): du is the
    float32 walk's du rounded to nearest, and dw, dkd, de (the per-chunk program's dot rounds
    du the same way) keep their bits. Refused without bf16 dots."""
    monkeypatch.setattr(cr, "BLOCK_V_MAX", 32)
    (u, w, kd, e), (gs, gvn) = ([t.to(DEV) for t in ts] for ts in make(1, 2, 3, 16, 16, 64, seed=5))
    states, vn = cr.recurrence_forward_triton(u, w, kd, e, BF16_DOTS)
    grads = cr.recurrence_backward_triton(w, kd, e, states, vn, gs, gvn, BF16_DOTS)
    grads_b = cr.recurrence_backward_triton(w, kd, e, states, vn, gs, gvn, BF16_DOTS, du_dtype=torch.bfloat16)
    assert grads_b[0].dtype == torch.bfloat16
    assert torch.equal(grads_b[0].view(torch.int16), grads[0].bfloat16().view(torch.int16))
    for name, a, b in zip(("dw", "dkd", "de"), grads_b[1:], grads[1:]):
        assert a.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32)), name
    with pytest.raises(ValueError, match="bf16 dots"):
        cr.recurrence_backward_triton(w, kd, e, states, vn, gs, gvn, "ieee", du_dtype=torch.bfloat16)


def test_bf16_states_round_to_nearest(monkeypatch):
    """States stored in bfloat16 (as gdn_backward passes them with bf16 dots) are the float32 walk's states
    rounded to nearest, v_new keeps its bits (the walk carries S in float32), and the backward
    fed bfloat16 states and state gradients stays near the float32 one: du, dw, dkd within
    1e-2; de = <S, dS> within 5e-2, a sum whose terms cancel (its error is relative to the
    terms; 1.7e-2 here)."""
    monkeypatch.setattr(cr, "BLOCK_V_MAX", 32)
    (u, w, kd, e), (gs, gvn) = ([t.to(DEV) for t in ts] for ts in make(1, 2, 3, 16, 16, 32, seed=9))
    states, vn = cr.recurrence_forward_triton(u, w, kd, e, BF16_DOTS)
    states_b, vn_b = cr.recurrence_forward_triton(u, w, kd, e, BF16_DOTS, states_dtype=torch.bfloat16)
    assert states_b.dtype == torch.bfloat16 and torch.equal(states_b, states.bfloat16())
    assert torch.equal(vn_b, vn)
    grads = cr.recurrence_backward_triton(w, kd, e, states, vn, gs, gvn, BF16_DOTS)
    grads_b = cr.recurrence_backward_triton(w, kd, e, states_b, vn, gs.bfloat16(), gvn, BF16_DOTS)
    for name, a, b, tol in zip(("du", "dw", "dkd", "de"), grads_b, grads, (1e-2, 1e-2, 1e-2, 5e-2)):
        assert a.dtype == torch.float32 and rel_err(a.cpu(), b.cpu()) < tol, name
    with pytest.raises(ValueError, match="bf16 dots"):
        cr.recurrence_forward_triton(u, w, kd, e, "ieee", states_dtype=torch.bfloat16)


def test_dot_precision_follows_the_inputs_dtype(monkeypatch):
    """The training backwards' dots: bf16 operands for a bf16 model, 3xTF32 for float32 (and
    float16) on the GPU; the interpreter's stand-ins for them on CPU tensors; and the
    recurrence picks its launch config by that precision."""
    from types import SimpleNamespace

    from vllm.kernels import training_tiles

    def x(dtype, cuda):
        return SimpleNamespace(dtype=dtype, is_cuda=cuda)
    monkeypatch.setattr(training_tiles, "INTERPRET", False)
    assert training_tiles.dot_precision(x(torch.bfloat16, True)) == "bf16"
    assert training_tiles.dot_precision(x(torch.float16, True)) == "tf32x3"
    assert training_tiles.dot_precision(x(torch.float32, True)) == "tf32x3"
    assert training_tiles.dot_precision(x(torch.bfloat16, False)) == "bf16_emulated"
    assert training_tiles.dot_precision(x(torch.float32, False)) == "ieee"
    monkeypatch.setattr(training_tiles, "INTERPRET", True)
    assert training_tiles.dot_precision(x(torch.bfloat16, True)) == "bf16_emulated"
    assert set(cr.FORWARD_CONFIG) == set(cr.BACKWARD_WALK_CONFIG) == set(cr.BACKWARD_PARTS_CONFIG) == {"bf16", "tf32x3"}


@triton.jit
def _round_bf16_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, round_bf16(tl.load(x_ptr + i)))


def test_bf16_emulation_rounds_as_torch():
    """The interpreter's stand-in for bf16 operands (training_tiles.round_bf16) rounds float32
    to the nearest bfloat16, ties to even, bit for bit as torch does (ties, both signs, tiny
    and huge values included)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3584, generator=gen) * torch.logspace(-30, 30, 3584)
    ties = ((torch.arange(1, 257, dtype=torch.int32) << 16) | 0x8000).view(torch.float32)   # exactly halfway
    x = torch.cat([x, ties, -ties])
    x[-3:] = torch.tensor([0.0, -0.0, 1e-40])
    xd = x.to(DEV)
    yd = torch.empty_like(xd)
    _round_bf16_kernel[(1,)](xd, yd, N=x.numel())
    assert torch.equal(yd.cpu().view(torch.int32), x.bfloat16().float().view(torch.int32))
