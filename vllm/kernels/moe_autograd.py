"""MoE kernels under autograd: each forward is exactly the kernel the engine calls
(passed in, or the grouped Triton GEMM), so a training forward produces the rollout's
bits; each backward is a separate implementation that only has to be right:

* RouterFn: d logits through the top-k weights (and the full probabilities, for the
  load-balancing loss): the norm_topk_prob quotient rule, scattered back to the chosen
  experts, then the softmax adjoint.
* GroupedGemmFn: dgrad = the same grouped kernel against the transposed expert weights
  (per pair row, then summed over a token's slots in slot order), wgrad = a grouped
  kernel summing each expert's rows.
* MergeFn: d y[t, s] = w[t, s] * d out[t], d w[t, s] = <d out[t], y[t, s]>.

Each is checked against float64 references in tests/test_moe_kernels.py. The kernels
come in as arguments (this module imports none: `kernels/moe.py` imports it).
"""
from __future__ import annotations

import torch


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class RouterFn(torch.autograd.Function):
    """(weights [T, k], probs [T, E], ids [T, k]) = fwd(logits, top_k, norm_topk_prob)."""

    @staticmethod
    def forward(ctx, logits, top_k, norm_topk_prob, fwd):
        r = fwd(logits.detach(), top_k, norm_topk_prob)
        ctx.save_for_backward(r.probs, r.ids)
        ctx.norm = norm_topk_prob
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(r.ids)
        return r.weights, r.probs, r.ids

    @staticmethod
    def backward(ctx, dweights, dprobs, _dids):
        probs, ids = ctx.saved_tensors
        acc = torch.float64 if torch.float64 in (probs.dtype, ctx.logits_dtype) else torch.float32
        p = probs.to(acc)
        dp = dprobs.to(acc).clone() if dprobs is not None else torch.zeros_like(p)
        if dweights is not None:
            dw = dweights.to(acc)
            top = p.gather(1, ids)
            if ctx.norm:
                # w = top / S, S = sum(top): d top_j = (d w_j - sum_i d w_i w_i) / S
                s = top.sum(-1, keepdim=True)
                dtop = (dw - (dw * (top / s)).sum(-1, keepdim=True)) / s
            else:
                dtop = dw
            dp = dp.scatter_add(1, ids, dtop)
        dlogits = p * (dp - (dp * p).sum(-1, keepdim=True))
        return dlogits.to(ctx.logits_dtype), None, None, None


class MergeFn(torch.autograd.Function):
    """out [T, H] = fwd(y [T, k, H], w [T, k], out_dtype)."""

    @staticmethod
    def forward(ctx, y, w, out_dtype, fwd):
        ctx.save_for_backward(y, w)
        return fwd(y, w, out_dtype)

    @staticmethod
    def backward(ctx, dout):
        y, w = ctx.saved_tensors
        acc = torch.float64 if torch.float64 in (dout.dtype, y.dtype) else torch.float32
        d = dout.to(acc)[:, None, :]
        dy = (d * w.to(acc)[..., None]).to(y.dtype) if ctx.needs_input_grad[0] else None
        dw = (d * y.to(acc)).sum(-1).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dy, dw, None, None


class GroupedGemmFn(torch.autograd.Function):
    """c = gemm(a, w, plan, ...): kernels/moe.py's grouped_gemm (see there for the row maps),
    with `wgrad` its grouped_wgrad."""

    @staticmethod
    def forward(ctx, a, w, plan, a_indexed, a_div, c_indexed, num_c_rows, out_dtype, config, gemm, wgrad):
        ctx.save_for_backward(a, w)
        ctx.plan, ctx.a_indexed, ctx.a_div, ctx.c_indexed, ctx.config = plan, a_indexed, a_div, c_indexed, config
        ctx.gemm, ctx.wgrad = gemm, wgrad
        return gemm(a, w, plan, a_indexed=a_indexed, a_div=a_div, c_indexed=c_indexed,
                    num_c_rows=num_c_rows, out_dtype=out_dtype, config=config)

    @staticmethod
    def backward(ctx, dc):
        a, w = ctx.saved_tensors
        plan = ctx.plan
        # tensor-core GEMMs in the weight dtype for bf16/fp16 (float32 accumulation), as LinearFn
        gemm_dtype = w.dtype if w.dtype in (torch.bfloat16, torch.float16) else _acc_dtype(dc)
        acc = _acc_dtype(dc)
        dcg = dc.to(gemm_dtype).contiguous()
        da = dw = None
        if ctx.needs_input_grad[0]:
            # per pair row p: d a_row(p) = d c_row(p) @ w[e]
            da_pad = ctx.gemm(dcg, w.to(gemm_dtype), plan, a_indexed=ctx.c_indexed, a_div=1, c_indexed=False,
                              out_dtype=acc, transpose_w=True, zero_padding=True, config=ctx.config)
            if not ctx.a_indexed:
                da = da_pad
            else:
                g = da_pad.index_select(0, plan.pos_of_pair)  # [pairs, K]
                if ctx.a_div == 1:
                    da = g
                else:  # a row feeds a_div pairs (a token's slots): summed in slot order
                    g = g.view(-1, ctx.a_div, g.shape[-1])
                    da = g[:, 0]
                    for s in range(1, ctx.a_div):
                        da = da + g[:, s]
            da = da.to(a.dtype)
        if ctx.needs_input_grad[1]:
            dw = ctx.wgrad(dcg, a.to(gemm_dtype).contiguous(), plan, a_indexed=ctx.a_indexed, a_div=ctx.a_div,
                           c_indexed=ctx.c_indexed, out_dtype=acc).to(w.dtype)
        return da, dw, None, None, None, None, None, None, None, None, None

