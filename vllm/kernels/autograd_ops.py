"""Training-side wrappers: the rollout's forward kernels under autograd, each
with a separately written backward.

The forward of every Function here calls exactly the kernel the engine calls
(passed in as `fwd`), so a training forward produces the rollout's bits. The
backward is a separate implementation: on the GPU, Triton kernels for RMSNorm (both
forms: `w * round(x * rstd)` and zero-centred `(x * rstd) * (1 + w)`)
(vllm/kernels/norm_backward.py), RoPE (full or partial), SiLU-and-mul and the sigmoid gate
(vllm/kernels/elementwise_backward.py), cuBLAS for linear layers, flash for
attention; elsewhere torch formulas (float64 in the gradcheck tests). Gradients only
have to be right, not batch-invariant. Each torch backward is verified by
`torch.autograd.gradcheck` in float64 (tests/test_training_kernels.py) with a float64
reference forward, each Triton backward against float64 autograd (the same file through
TRITON_INTERPRET=1, and tests/test_gpu_training.py).
"""
from __future__ import annotations

import torch


class LinearFn(torch.autograd.Function):
    """y = fwd(x, w, b); dx = dy @ w, dw = dy^T x, db = sum(dy)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fwd):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return fwd(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if weight.dtype in (torch.bfloat16, torch.float16):
            # tensor-core GEMMs in the weight dtype (float32 accumulation inside cuBLAS)
            acc = weight.dtype
        else:
            acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
        dy2 = dy.reshape(-1, dy.shape[-1]).to(acc)
        x2 = x.reshape(-1, x.shape[-1]).to(acc)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ weight.to(acc)).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dw = (dy2.t() @ x2).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(weight.dtype)
        return dx, dw, db, None


class RMSNormFn(torch.autograd.Function):
    """y = w * round(x * rstd), or with `zero_centred` y = (x * rstd) * (1 + w); backward of
    the unrounded formula: dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w (dy * (1 + w));
    dw = sum(dy * xhat)."""

    @staticmethod
    def forward(ctx, x, weight, eps, fwd, zero_centred=False):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        ctx.zero_centred = zero_centred
        return fwd(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if x.is_cuda:
            from vllm.kernels.norm_backward import rms_norm_backward
            dx, dw = rms_norm_backward(x, weight, dy, ctx.eps, need_dx=ctx.needs_input_grad[0],
                                       need_dw=ctx.needs_input_grad[1], zero_centred=ctx.zero_centred)
            return dx, dw, None, None, None
        dx, dw = _rms_norm_backward(x, weight, ctx.eps, dy, ctx.zero_centred)
        return dx, dw, None, None, None


def _rms_norm_backward(x, weight, eps: float, dy, zero_centred: bool = False):
    acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
    xf, dyf, wf = x.to(acc), dy.to(acc), weight.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    g = dyf * (1.0 + wf if zero_centred else wf)
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


class AddRMSNormFn(torch.autograd.Function):
    """(y, r') = (rms_norm(x + r), x + r) (either form of the norm): the residual stream gets
    the norm's input gradient plus whatever flows into r' from later layers."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, fwd, zero_centred=False):
        out, res = fwd(x, residual, weight, eps)
        ctx.save_for_backward(res, weight)
        ctx.eps = eps
        ctx.zero_centred = zero_centred
        return out, res

    @staticmethod
    def backward(ctx, dy, dres):
        # saved tensors are unpacked once: activation checkpointing forbids a second unpack
        res, weight = ctx.saved_tensors
        if res.is_cuda:  # one kernel: the norm's input gradient plus dres
            from vllm.kernels.norm_backward import rms_norm_backward
            d, dw = rms_norm_backward(res, weight, dy, ctx.eps, dres=dres, need_dw=ctx.needs_input_grad[2],
                                      zero_centred=ctx.zero_centred)
            return d, d, dw, None, None, None
        dnorm, dw = _rms_norm_backward(res, weight, ctx.eps, dy, ctx.zero_centred)
        d = dnorm if dres is None else dnorm + dres.to(dnorm.dtype)
        return d, d, dw, None, None, None


class RopeFn(torch.autograd.Function):
    """Rotation by angle a per (position, frequency); its adjoint rotates by -a. With a partial
    rope (cos/sin narrower than half the head), the unrotated dims pass their gradient through."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, fwd):
        ctx.save_for_backward(cos, sin)
        return fwd(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        if cos.is_cuda:
            from vllm.kernels.elementwise_backward import rope_backward
            return (*rope_backward(dq, dk, cos, sin), None, None, None)

        def adjoint(d):
            if d is None:
                return None
            acc = torch.float64 if d.dtype == torch.float64 else torch.float32
            half = cos.shape[-1]
            df = d.to(acc)
            d1, d2 = df[..., :half], df[..., half:2 * half]
            c, s = cos.to(acc)[:, None, :], sin.to(acc)[:, None, :]
            return torch.cat((d1 * c + d2 * s, d2 * c - d1 * s, df[..., 2 * half:]), dim=-1).to(d.dtype)
        return adjoint(dq), adjoint(dk), None, None, None


class SiluAndMulFn(torch.autograd.Function):
    """y = silu(g) * u with x = [g | u]."""

    @staticmethod
    def forward(ctx, x, fwd):
        ctx.save_for_backward(x)
        return fwd(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        if x.is_cuda:
            from vllm.kernels.elementwise_backward import silu_and_mul_backward
            return silu_and_mul_backward(x, dy), None
        acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
        g, u = x.to(acc).chunk(2, dim=-1)
        dyf = dy.to(acc)
        sig = torch.sigmoid(g)
        dg = dyf * u * sig * (1 + g * (1 - sig))
        du = dyf * g * sig
        return torch.cat((dg, du), dim=-1).to(x.dtype), None


class SigmoidGateFn(torch.autograd.Function):
    """y = x * sigmoid(g), g of x's shape or one per row ([.., 1])."""

    @staticmethod
    def forward(ctx, x, gate, fwd):
        ctx.save_for_backward(x, gate)
        return fwd(x, gate)

    @staticmethod
    def backward(ctx, dy):
        x, gate = ctx.saved_tensors
        if x.is_cuda:
            from vllm.kernels.elementwise_backward import sigmoid_gate_backward
            dx, dg = sigmoid_gate_backward(x, gate, dy, need_dx=ctx.needs_input_grad[0],
                                           need_dgate=ctx.needs_input_grad[1])
            return dx, dg, None
        acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
        xf, dyf = x.to(acc), dy.to(acc)
        s = torch.sigmoid(gate.to(acc))
        dg = dyf * xf * s * (1 - s)
        if gate.shape[-1] != x.shape[-1]:
            dg = dg.sum(-1, keepdim=True)
        return (dyf * s).to(x.dtype), dg.to(gate.dtype), None


class PackedAttentionFn(torch.autograd.Function):
    """Causal GQA attention over packed sequences. Forward: `fwd(q, k, v)` (the
    rollout's paged kernel on a private cache). Backward: recomputes each
    sequence's probabilities in float32 and applies the softmax-attention
    adjoint: dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dP * P)), dQ = dS K * scale,
    dK = dS^T Q * scale (summed over each KV head's query group)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, fwd, cu_seqlens_device=None):
        # cu_seqlens_device: the same boundaries already on q's device (int32), so the
        # backward does not copy them from the host (a blocking copy) once per layer
        ctx.save_for_backward(q, k, v)
        ctx.cu = [int(c) for c in cu_seqlens]
        ctx.cu_device = cu_seqlens_device
        ctx.scale = scale
        return fwd(q, k, v)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            grads = _flash_varlen_backward(q, k, v, do, ctx.cu, ctx.scale, ctx.cu_device)
            if grads is not None:
                return (*grads, None, None, None, None)
        acc = torch.float64 if do.dtype == torch.float64 else torch.float32
        G = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.zeros_like(q, dtype=acc), torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
        for a, b in zip(ctx.cu[:-1], ctx.cu[1:]):
            if b <= a:
                continue
            qs = q[a:b].to(acc).transpose(0, 1)                          # [Hq, L, D]
            ks = k[a:b].to(acc).transpose(0, 1).repeat_interleave(G, 0)  # [Hq, L, D]
            vs = v[a:b].to(acc).transpose(0, 1).repeat_interleave(G, 0)
            dos = do[a:b].to(acc).transpose(0, 1)
            L = b - a
            s = (qs @ ks.transpose(1, 2)) * ctx.scale
            mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
            dvs = p.transpose(1, 2) @ dos
            dp = dos @ vs.transpose(1, 2)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True))
            dqs = (ds @ ks) * ctx.scale
            dks = (ds.transpose(1, 2) @ qs) * ctx.scale
            Hk = k.shape[1]
            dq[a:b] = dqs.transpose(0, 1)
            dk[a:b] = dks.view(Hk, G, L, -1).sum(1).transpose(0, 1)
            dv[a:b] = dvs.view(Hk, G, L, -1).sum(1).transpose(0, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _flash_varlen_backward(q, k, v, do, cu, scale, cu_t=None):
    """GPU bf16/fp16: the adjoint through torch's flash varlen attention (its own
    fused backward kernels, tensor cores). The forward bits came from our kernel;
    the gradient of causal softmax attention is the same function, so flash's
    backward is a valid (and verified, tests/test_gpu_training.py) implementation.
    Returns None where torch has no varlen flash attention."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if cu_t is None:
        from vllm.host_copy import to_device
        cu_t = to_device(cu, torch.int32, q.device)
    max_len = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = varlen_attn(qg, kg, vg, cu_t, cu_t, max_len, max_len, scale=scale, window_size=(-1, 0))
        return torch.autograd.grad(out, (qg, kg, vg), do.to(out.dtype))
