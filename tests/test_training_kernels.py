"""Each training backward checked on its own: torch.autograd.gradcheck in float64,
with a float64 reference forward standing in for the rollout kernel (the
backward never depends on which forward kernel ran)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.kernels.autograd_ops import (AddRMSNormFn, LinearFn, PackedAttentionFn, RMSNormFn, RopeFn,
                                       SiluAndMulFn)

D64 = torch.float64


def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(q, k, cos, sin):
    def one(x):
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
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
    be = PackedAttentionBackend(lens, torch.device("cpu"), block_size=4)
    out = be.forward(0, q, k, v, 0.25)
    go = torch.randn_like(out)
    out.backward(go)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _dense_attention(qd, kd, vd, be.cu, 0.25)
    ref.backward(go.double())
    assert (out.double() - ref).abs().max().item() < 1e-5
    for a, b in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-5
