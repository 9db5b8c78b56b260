"""Each training backward checked on its own: torch.autograd.gradcheck in float64,
with a float64 reference forward standing in for the rollout kernel (the
backward never depends on which forward kernel ran)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.kernels.autograd_ops import (AddRMSNormFn, LinearFn, PackedAttentionFn, RMSNormFn, RopeFn,
                                       SigmoidGateFn, SiluAndMulFn)

D64 = torch.float64


def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _zc_rms(x, w, eps):
    return (1 + w) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(q, k, cos, sin):
    """Neox rotation of the first 2 * cos.shape[-1] dims of each head (all of them: full rope)."""
    def one(x):
        h = cos.shape[-1]
        x1, x2 = x[..., :h], x[..., h:2 * h]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * h:]), dim=-1)
    return one(q), one(k)


def _dense_attention(q, k, v, cu, scale):
    outs = []
    G = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
        ks, vs = ks.repeat_interleave(G, 0), vs.repeat_interleave(G, 0)
        s = (qs @ ks.transpose(1, 2)) * scale
        L = b - a
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
    return torch.cat(outs)


def rnd(*shape):
    return torch.randn(*shape, dtype=D64, requires_grad=True)


def test_linear_backward():
    x, w, b = rnd(5, 7), rnd(4, 7), rnd(4)
    assert torch.autograd.gradcheck(lambda x, w, b: LinearFn.apply(x, w, b, F.linear), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: LinearFn.apply(x, w, None, F.linear), (x, w))


def test_rms_norm_backward():
    x, w = rnd(3, 8), rnd(8)
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFn.apply(x, w, 1e-6, _rms), (x, w))


def test_add_rms_norm_backward():
    x, r, w = rnd(3, 8), rnd(3, 8), rnd(8)
    fwd = lambda x, r, w, e: (_rms(x + r, w, e), x + r)  # noqa: E731
    assert torch.autograd.gradcheck(lambda x, r, w: AddRMSNormFn.apply(x, r, w, 1e-6, fwd), (x, r, w))


def test_rope_backward():
    q, k = rnd(4, 3, 6), rnd(4, 1, 6)
    ang = torch.randn(4, 3, dtype=D64)
    cos, sin = ang.cos(), ang.sin()
    assert torch.autograd.gradcheck(lambda q, k: RopeFn.apply(q, k, cos, sin, _rope), (q, k))


def test_zero_centred_rms_norm_backward():
    x, r, w = rnd(3, 8), rnd(3, 8), rnd(8)
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFn.apply(x, w, 1e-6, _zc_rms, True), (x, w))
    fwd = lambda x, r, w, e: (_zc_rms(x + r, w, e), x + r)  # noqa: E731
    assert torch.autograd.gradcheck(lambda x, r, w: AddRMSNormFn.apply(x, r, w, 1e-6, fwd, True), (x, r, w))


def test_partial_rope_backward():
    q, k = rnd(4, 3, 10), rnd(4, 1, 10)
    ang = torch.randn(4, 2, dtype=D64)  # 4 of 10 dims rotate
    cos, sin = ang.cos(), ang.sin()
    assert torch.autograd.gradcheck(lambda q, k: RopeFn.apply(q, k, cos, sin, _rope), (q, k))


@pytest.mark.parametrize("per_row", [False, True])
def test_sigmoid_gate_backward(per_row):
    x, g = rnd(3, 2, 6), rnd(3, 2, 1 if per_row else 6)
    assert torch.autograd.gradcheck(lambda x, g: SigmoidGateFn.apply(x, g, lambda a, b: a * torch.sigmoid(b)), (x, g))


def test_silu_and_mul_backward():
    x = rnd(3, 10)
    fwd = lambda x: F.silu(x[..., :5]) * x[..., 5:]  # noqa: E731
    assert torch.autograd.gradcheck(lambda x: SiluAndMulFn.apply(x, fwd), (x,))


@pytest.mark.parametrize("G", [1, 2])
def test_packed_attention_backward(G):
    cu = [0, 3, 3, 8]  # includes an empty sequence
    q, k, v = rnd(8, 2 * G, 4), rnd(8, 2, 4), rnd(8, 2, 4)
    fwd = lambda q, k, v: _dense_attention(q, k, v, cu, 0.5)  # noqa: E731
    assert torch.autograd.gradcheck(lambda q, k, v: PackedAttentionFn.apply(q, k, v, cu, 0.5, fwd), (q, k, v))


def test_packed_attention_with_rollout_kernel_forward():
    """The backend's real forward (the rollout's paged kernel on a private cache)
    with the separate backward: values and gradients vs float64 autograd."""
    from vllm.training.attention import PackedAttentionBackend
    torch.manual_seed(0)
    lens = [5, 19, 1]
    q = torch.randn(sum(lens), 4, 16, requires_grad=True)
    k = torch.randn(sum(lens), 2, 16, requires_grad=True)
    v = torch.randn(sum(lens), 2, 16, requires_grad=True)
    be = PackedAttentionBackend(lens, torch.device("cpu"))
    out = be.forward(0, q, k, v, 0.25)
    go = torch.randn_like(out)
    out.backward(go)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _dense_attention(qd, kd, vd, be.cu, 0.25)
    ref.backward(go.double())
    assert (out.double() - ref).abs().max().item() < 1e-5
    for a, b in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-5


# ---- the GPU backward kernels (Triton): on CPU tensors through TRITON_INTERPRET=1 ------------
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("layout", ["rows", "heads_view", "residual"])
def test_rms_norm_backward_kernel_vs_float64(layout):
    """dx, dw of the Triton backward against float64 autograd of the unrounded formula, for a
    plain [R, H] input, a strided [T, heads, D] view (the per-head q/k norm reads the fused
    qkv output in place) and the fused residual add (dres added to dx)."""
    from vllm.kernels.norm_backward import rms_norm_backward
    torch.manual_seed(0)
    if layout == "heads_view":
        qkv = torch.randn(7, 3 * 4 * 16, device=DEV)      # [T, (q|k|v) heads * D]
        x = qkv[:, :4 * 16].reshape(7, 4, 16)             # a view: strides (192, 16, 1)
        assert not x.is_contiguous()
        H = 16
    else:
        x = torch.randn(9, 40, device=DEV) * 3
        H = 40
    w = torch.randn(H, device=DEV)
    dy = torch.randn(x.shape, device=DEV)
    dres = torch.randn(x.shape, device=DEV) if layout == "residual" else None
    dx, dw = rms_norm_backward(x, w, dy, 1e-6, dres=dres)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    _rms(xd, wd, 1e-6).backward(dy.double())
    ref_dx = xd.grad + (dres.double() if dres is not None else 0)
    assert dx.shape == x.shape and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert _rel(dx, ref_dx) < 1e-5 and _rel(dw, wd.grad) < 1e-5


def test_rms_norm_backward_kernel_many_row_ranges():
    """More rows than one dw program takes: the float32 partials of several row ranges are summed."""
    from vllm.kernels.norm_backward import rms_norm_backward
    torch.manual_seed(1)
    x, w, dy = torch.randn(300, 8, device=DEV), torch.randn(8, device=DEV), torch.randn(300, 8, device=DEV)
    dx, dw = rms_norm_backward(x, w, dy, 1e-5)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    _rms(xd, wd, 1e-5).backward(dy.double())
    assert _rel(dx, xd.grad) < 1e-5 and _rel(dw, wd.grad) < 1e-5


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy exp(120)
def test_silu_and_mul_backward_kernel_vs_float64():
    from vllm.kernels.elementwise_backward import silu_and_mul_backward
    torch.manual_seed(0)
    x = torch.randn(5, 2 * 24, device=DEV) * 4
    x[0, 0], x[0, 1] = -120.0, 120.0  # exp overflow on one side: the gradient stays finite
    dy = torch.randn(5, 24, device=DEV)
    dx = silu_and_mul_backward(x, dy)
    xd = x.double().requires_grad_()
    (F.silu(xd[:, :24]) * xd[:, 24:]).backward(dy.double())
    assert torch.isfinite(dx).all() and _rel(dx, xd.grad) < 1e-5


@pytest.mark.parametrize("R", [16, 8])
def test_rope_backward_kernel_vs_float64(R):
    """Full (R = D) and partial rope (the first R dims rotated, the rest passed through)."""
    from vllm.kernels.elementwise_backward import rope_backward
    torch.manual_seed(0 if R == 16 else 3)
    T, D = 6, 16
    ang = torch.randn(T, R // 2, device=DEV) * 3
    cos, sin = ang.cos(), ang.sin()
    dq, dk = torch.randn(T, 4, D, device=DEV), torch.randn(T, 2, D, device=DEV)
    gq, gk = rope_backward(dq, dk, cos, sin)
    qd = torch.randn(T, 4, D, dtype=D64, device=DEV, requires_grad=True)
    kd = torch.randn(T, 2, D, dtype=D64, device=DEV, requires_grad=True)
    oq, ok = _rope(qd, kd, cos.double(), sin.double())
    torch.autograd.backward((oq, ok), (dq.double(), dk.double()))
    assert _rel(gq, qd.grad) < 1e-6 and _rel(gk, kd.grad) < 1e-6
    assert rope_backward(None, dk, cos, sin)[0] is None
    assert torch.equal(gq[..., R:], dq[..., R:])  # the unrotated dims pass their gradient through


@pytest.mark.parametrize("layout", ["rows", "heads_view", "residual"])
def test_zero_centred_rms_norm_backward_kernel_vs_float64(layout):
    """The same Triton backward with the weight read as 1 + w."""
    from vllm.kernels.norm_backward import rms_norm_backward
    torch.manual_seed(2)
    if layout == "heads_view":
        x = torch.randn(7, 4, 2 * 16, device=DEV)[..., :16]  # the gated q: [q | gate] per head
        H = 16
    else:
        x = torch.randn(9, 40, device=DEV) * 3
        H = 40
    w = 0.1 * torch.randn(H, device=DEV)
    dy = torch.randn(x.shape, device=DEV)
    dres = torch.randn(x.shape, device=DEV) if layout == "residual" else None
    dx, dw = rms_norm_backward(x, w, dy, 1e-6, dres=dres, zero_centred=True)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    _zc_rms(xd, wd, 1e-6).backward(dy.double())
    ref_dx = xd.grad + (dres.double() if dres is not None else 0)
    assert _rel(dx, ref_dx) < 1e-5 and _rel(dw, wd.grad) < 1e-5


@pytest.mark.parametrize("per_row", [False, True])
def test_sigmoid_gate_backward_kernel_vs_float64(per_row):
    from vllm.kernels.elementwise_backward import sigmoid_gate_backward
    torch.manual_seed(4)
    x = torch.randn(5, 3, 24, device=DEV)
    g = (torch.randn(5, 3, 1, device=DEV) if per_row else torch.randn(5, 3, 48, device=DEV)[..., 24:]) * 3
    dy = torch.randn(x.shape, device=DEV)
    dx, dg = sigmoid_gate_backward(x, g, dy)
    xd, gd = x.double().requires_grad_(), g.double().requires_grad_()
    (xd * torch.sigmoid(gd)).backward(dy.double())
    assert dx.shape == x.shape and dg.shape == g.shape
    assert _rel(dx, xd.grad) < 1e-6 and _rel(dg, gd.grad) < 1e-5


def test_trainer_kv_in_place_equals_a_paged_copy():
    """The trainer hands its K/V to the rollout's Triton kernel in place (block size 1, v a
    strided view of the fused qkv output); the kernel gives the bits it gives on a paged
    copy with block size 16 (run here through TRITON_INTERPRET=1)."""
    from vllm.kernels.attention import paged_attention_triton
    from vllm.training.attention import PackedAttentionBackend
    torch.manual_seed(0)
    lens = [5, 19, 1, 70]
    T, Hq, Hk, D = sum(lens), 4, 2, 16
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=DEV)
    q = qkv[:, :Hq * D].reshape(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D).contiguous()
    v = qkv[:, (Hq + Hk) * D:].reshape(T, Hk, D)  # strided, as the model passes it
    be = PackedAttentionBackend(lens, torch.device(DEV))
    got = paged_attention_triton(q, k.unsqueeze(1), v.unsqueeze(1), be.block_table, be.cu_seqlens, be.seq_lens_t,
                                 0.25, max_query_len=be.max_len, max_seq_len=be.max_len)
    bs = 16
    blocks = [-(-n // bs) for n in lens]
    kc = torch.zeros(1 + sum(blocks), bs, Hk, D, device=DEV)
    vc = torch.zeros_like(kc)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device=DEV)
    nxt = 1
    for i, (a, n, b) in enumerate(zip(be.cu[:-1], lens, blocks)):
        table[i, :b] = torch.arange(nxt, nxt + b, dtype=torch.int32, device=DEV)
        kc.view(-1, Hk, D)[nxt * bs:nxt * bs + n] = k[a:a + n]
        vc.view(-1, Hk, D)[nxt * bs:nxt * bs + n] = v[a:a + n]
        nxt += b
    ref = paged_attention_triton(q, kc, vc, table, be.cu_seqlens, be.seq_lens_t, 0.25, max_query_len=be.max_len,
                                 max_seq_len=be.max_len)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
