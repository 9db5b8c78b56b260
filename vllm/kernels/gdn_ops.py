"""Gated DeltaNet (Qwen3-Next) ops around the chunked delta rule: the causal depthwise
conv over packed sequences with its cached window, the q/k l2-norm and the gates, the
gated RMSNorm of the output, and the one-token recurrent step (fast mode's decode).

Each op has a Triton entry (`*_triton`, CUDA) and a torch entry (`*_torch`, CPU) with one
signature. Both are batch-invariant: an output element comes from its own row's inputs
through code and a reduction order fixed by the model's dims (head dim, row length,
kernel width), never by how many rows the step holds or where a row sits. The torch
entries get there without library reductions: sums are fixed trees of elementwise adds
(`_tree_sum`) and exp-based functions run on chunks of one fixed length (`_pointwise`).
The two entries are not bit-equal to each other (different exp, different trees); each
is equal to itself across batches, which is what rollout and trainer share.

The autograd Functions run the forward kernel they are given and differentiate the
op's unrounded float32 torch formula (`_vjp`); gradients only have to be right.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllm.forward_context import StateMetadata
from vllm.kernels import torch_ops

# ---- torch helpers ---------------------------------------------------------------------------

# exp-based functions on fixed-length chunks (torch_ops.pointwise_in_chunks: every element on
# ATen's vector path)
_pointwise = torch_ops.pointwise_in_chunks


def _tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` as a binary tree of elementwise adds over the axis zero-padded to a
    power of two: the order depends on the axis length only (library reductions pick
    their order from the whole tensor's shape)."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    p = triton.next_power_of_2(max(n, 1))
    if p != n:
        x = F.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _vjp(formula: Callable, inputs, grads, needs) -> list:
    """Gradients of `formula` (an op's unrounded torch formula, returning a tuple) at
    `inputs`, recomputed under autograd on detached float32 copies (float64 when the
    upstream gradient is), in the inputs' dtypes; None where not needed."""
    acc = torch.float64 if any(g is not None and g.dtype == torch.float64 for g in grads) else torch.float32
    if not any(needs):
        return [None] * len(inputs)
    with torch.enable_grad():
        xs = [x.detach().to(acc).requires_grad_(bool(n)) for x, n in zip(inputs, needs)]
        outs = formula(*xs)
        pairs = [(o, g.to(acc)) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt = [x for x, n in zip(xs, needs) if n]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                  allow_unused=True) if pairs else [None] * len(wrt)
    it = iter(got)
    out = []
    for x, n in zip(inputs, needs):
        if not n:
            out.append(None)
            continue
        d = next(it)
        out.append(torch.zeros_like(x) if d is None else d.to(x.dtype))
    return out


def _cached_ssm(md: StateMetadata, state: dict | None) -> torch.Tensor | None:
    """The layer's cached recurrent state ("ssm") when the step has a cache, else None."""
    ssm = state.get("ssm") if state is not None else None
    return ssm if ssm is not None and md.slots is not None else None


def _ssm_rows(md: StateMetadata, ssm: torch.Tensor | None, shape: tuple[int, ...], device) -> torch.Tensor:
    """Each sequence's state before a one-token step, float32 [S, *shape]: a copy of its slot's,
    zeros at position 0 (a reused slot may hold a previous owner's state) or without a cache."""
    if ssm is not None:
        return torch.where((md.start_pos > 0)[:, None, None, None], ssm[md.slots.long()], 0.0)
    return torch.zeros((md.start_pos.shape[0], *shape), dtype=torch.float32, device=device)


# ---- 1. causal depthwise conv1d + SiLU ----------------------------------------------------------

_CONV_BLOCK_T = 8
_CONV_BLOCK_D = 128


@triton.jit
def _conv_kernel(x_ptr, w_ptr, b_ptr, st_ptr, y_ptr, cu_ptr, start_ptr, slot_ptr, D,
                 stride_xt, stride_wd, stride_wi, stride_ss, stride_sj, stride_yt,
                 W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    row0 = tl.load(cu_ptr + s)
    n = tl.load(cu_ptr + s + 1) - row0
    j = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # token index within the step's rows of s
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = j < n
    d_ok = d < D
    if HAS_STATE:
        start = tl.load(start_ptr + s)
        slot = tl.load(slot_ptr + s).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for i in tl.static_range(W):
        off = j + (i - (W - 1))  # tap's offset from the step's first row of s; < 0: before the step
        new = off >= 0
        rows = (row0 + off).to(tl.int64)
        xv = tl.load(x_ptr + rows[:, None] * stride_xt + d[None, :],
                     mask=(t_ok & new)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if HAS_STATE:
            # earlier positions come from the cached window (row W-1+off holds position start+off);
            # a sequence at position 0 never reads its slot, which may hold a previous owner's rows
            old = t_ok & (off < 0) & (start + off >= 0)
            sv = tl.load(st_ptr + slot * stride_ss + (W - 1 + off).to(tl.int64)[:, None] * stride_sj + d[None, :],
                         mask=old[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            xv = tl.where(new[:, None], xv, sv)
        w = tl.load(w_ptr + d * stride_wd + i * stride_wi, mask=d_ok, other=0.0).to(tl.float32)
        acc += w[None, :] * xv
    if HAS_BIAS:  # after the taps (Mamba-2's conv has a bias; Gated DeltaNet's has none)
        acc += tl.load(b_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    # the conv output is rounded to the model dtype, then SiLU (transformers' causal_conv1d_fn)
    a = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    y = a / (1.0 + tl.exp(-a))
    out_rows = (row0 + j).to(tl.int64)
    tl.store(y_ptr + out_rows[:, None] * stride_yt + d[None, :], y.to(y_ptr.dtype.element_ty),
             mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _conv_state_kernel(x_ptr, st_ptr, cu_ptr, start_ptr, slot_ptr, D, stride_xt, stride_ss, stride_sj,
                       W: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    row0 = tl.load(cu_ptr + s)
    n = tl.load(cu_ptr + s + 1) - row0
    start = tl.load(start_ptr + s)
    slot = tl.load(slot_ptr + s).to(tl.int64)
    r = tl.arange(0, BLOCK_J)  # window row: position start + n - (W-1) + r
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r_ok = r < W - 1
    d_ok = d < D
    off = n - (W - 1) + r
    new = off >= 0
    xv = tl.load(x_ptr + (row0 + off).to(tl.int64)[:, None] * stride_xt + d[None, :],
                 mask=(r_ok & new)[:, None] & d_ok[None, :], other=0.0)
    old = r_ok & (off < 0) & (start + off >= 0)
    base = st_ptr + slot * stride_ss
    sv = tl.load(base + (W - 1 + off).to(tl.int64)[:, None] * stride_sj + d[None, :],
                 mask=old[:, None] & d_ok[None, :], other=0.0)
    val = tl.where(new[:, None], xv.to(st_ptr.dtype.element_ty), sv)
    # the old rows this program shifts down are read by other threads of it: all reads first
    tl.debug_barrier()
    tl.store(base + r.to(tl.int64)[:, None] * stride_sj + d[None, :], val, mask=r_ok[:, None] & d_ok[None, :])


def _check_conv(x, weight, conv_state):
    W = weight.shape[1]
    if not 2 <= W <= 4:
        raise ValueError(f"conv width must be 2..4, got {W}")
    if x.stride(-1) != 1 or (conv_state is not None and conv_state.stride(-1) != 1):
        raise ValueError("x and conv_state need a contiguous last dim")
    return W


def causal_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, md: StateMetadata,
                         conv_state: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(causal depthwise conv (+ bias [D])) of packed sequences x [T, D] with weight [D, W]; tokens
    before a sequence's start position come from conv_state[slot] ([num_slots, W-1, D],
    updated in place to the window ending at its last token) or are zero. Two launches:
    the outputs read the old windows, then the windows move."""
    T, D = x.shape
    W = _check_conv(x, weight, conv_state)
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    S = md.start_pos.shape[0]
    stateful = conv_state is not None and md.slots is not None
    st = conv_state if stateful else x
    slots = md.slots if stateful else md.start_pos
    nd = triton.cdiv(D, _CONV_BLOCK_D)
    if T and S and md.max_query_len:
        grid = (S, triton.cdiv(md.max_query_len, _CONV_BLOCK_T), nd)
        _conv_kernel[grid](x, weight, weight if bias is None else bias, st, y, md.cu_seqlens, md.start_pos, slots, D,
                           x.stride(0), weight.stride(0), weight.stride(1), st.stride(0),
                           st.stride(1) if stateful else 0, y.stride(0),
                           W=W, HAS_STATE=stateful, HAS_BIAS=bias is not None, BLOCK_T=_CONV_BLOCK_T,
                           BLOCK_D=_CONV_BLOCK_D, num_warps=4, enable_fp_fusion=True)
    if stateful and S:
        _conv_state_kernel[(S, nd)](x, conv_state, md.cu_seqlens, md.start_pos, md.slots, D,
                                    x.stride(0), conv_state.stride(0), conv_state.stride(1),
                                    W=W, BLOCK_J=max(2, triton.next_power_of_2(W - 1)), BLOCK_D=_CONV_BLOCK_D,
                                    num_warps=4, enable_fp_fusion=True)
    return y


def _conv_sources(x: torch.Tensor, md: StateMetadata, window: torch.Tensor | None, W: int):
    """(source rows, tap index [T, W], window index [S, W-1]): source = x's rows, then the
    sequences' old windows ([S, W-1, D] flattened), then one zero row; tap i of token t is
    the input at its position - (W-1) + i, window row j of sequence s the input at
    (its last position + 1) - (W-1) + j. No host copies."""
    T, D = x.shape
    dev = x.device
    S = md.start_pos.shape[0]
    cu = md.cu_seqlens.long()
    start = md.start_pos.long()
    seq = torch.repeat_interleave(torch.arange(S, device=dev), cu[1:] - cu[:-1], output_size=T)
    parts = [x]
    if window is not None:
        parts.append(window.reshape(-1, D).to(x.dtype))
    n_win = S * (W - 1) if window is not None else 0
    parts.append(x.new_zeros((1, D)))
    src = torch.cat(parts)

    def index(off, s):
        # off: offset of the wanted position from sequence s's first position in this step
        first = cu[s]
        inside = first + off
        past = T + s * (W - 1) + (W - 1) + off
        zero = torch.full_like(off, T + n_win)
        old = past if window is not None else zero
        return torch.where(off >= 0, inside, torch.where(start[s] + off >= 0, old, zero))

    t = torch.arange(T, device=dev)
    tap_off = (t - cu[seq])[:, None] + torch.arange(W, device=dev) - (W - 1)
    taps = index(tap_off, seq[:, None])
    s_all = torch.arange(S, device=dev)
    win_off = (cu[1:] - cu[:-1])[:, None] + torch.arange(W - 1, device=dev) - (W - 1)
    win = index(win_off, s_all[:, None])
    return src, taps, win


def causal_conv1d_torch(x: torch.Tensor, weight: torch.Tensor, md: StateMetadata,
                        conv_state: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel's formula in torch: taps gathered, accumulated in float32 in tap
    order (elementwise: each token alone), the bias added, rounded, SiLU on fixed chunks."""
    T, D = x.shape
    W = _check_conv(x, weight, conv_state)
    stateful = conv_state is not None and md.slots is not None
    slots = md.slots.long() if stateful else None
    window = conv_state[slots] if stateful else None  # a copy: read before the update
    src, taps, win = _conv_sources(x, md, window, W)
    g = src[taps]  # [T, W, D]
    wf = weight.float()
    acc = torch.zeros((T, D), dtype=torch.float32, device=x.device)
    for i in range(W):
        acc = acc + wf[:, i] * g[:, i].float()
    if bias is not None:
        acc = acc + bias.float()
    y = _pointwise(F.silu, acc.to(x.dtype).float()).to(x.dtype)
    if stateful:
        conv_state[slots] = src[win].to(conv_state.dtype)
    return y


def _conv_reference(x, weight, md, window, bias=None):
    """silu(sum_i w[:, i] * x_at(p - (W-1) + i) (+ bias)) unrounded, differentiable in x,
    weight and bias."""
    W = weight.shape[1]
    src, taps, _ = _conv_sources(x, md, window, W)
    acc = (src[taps] * weight.t()[None]).sum(1)
    if bias is not None:
        acc = acc + bias
    return (F.silu(acc),)


class CausalConv1dFn(torch.autograd.Function):
    """y = fwd(x, weight, md, conv_state[, bias]); grads for x, weight (and bias) through the
    unrounded formula (the window read from conv_state is a constant, copied before the update)."""

    @staticmethod
    def forward(ctx, x, weight, md, conv_state, fwd, bias=None):
        window = conv_state[md.slots.long()] if conv_state is not None and md.slots is not None else None
        ctx.save_for_backward(x, weight, window, bias)
        ctx.md = md
        return fwd(x, weight, md, conv_state) if bias is None else fwd(x, weight, md, conv_state, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, window, bias = ctx.saved_tensors
        md = ctx.md
        if bias is None:
            dx, dw = _vjp(lambda xf, wf: _conv_reference(xf, wf, md, window), (x, weight), (dy,),
                          ctx.needs_input_grad[:2])
            return dx, dw, None, None, None, None
        dx, dw, db = _vjp(lambda xf, wf, bf: _conv_reference(xf, wf, md, window, bf), (x, weight, bias), (dy,),
                          (*ctx.needs_input_grad[:2], ctx.needs_input_grad[5]))
        return dx, dw, None, None, None, db


# ---- 2. q/k l2-norm and the gates -------------------------------------------------------------

@triton.jit
def _l2norm_heads(src, dst, t, H, K, stride_t, stride_h, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_K)
    m = (h[:, None] < H) & (c[None, :] < K)
    x = tl.load(src + t * stride_t + h[:, None] * stride_h + c[None, :], mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)
    tl.store(dst + t * (H * K) + h[:, None] * K + c[None, :], (x * inv[:, None]).to(dst.dtype.element_ty), mask=m)


@triton.jit
def _gating_kernel(q_ptr, k_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, qn_ptr, kn_ptr, g_ptr, beta_ptr,
                   Hk, K, Hv, sq_t, sq_h, sk_t, sk_h, sa_t, sa_h, sb_t, sb_h,
                   BLOCK_HK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_HV: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _l2norm_heads(q_ptr, qn_ptr, t, Hk, K, sq_t, sq_h, BLOCK_HK, BLOCK_K)
    _l2norm_heads(k_ptr, kn_ptr, t, Hk, K, sk_t, sk_h, BLOCK_HK, BLOCK_K)
    h = tl.arange(0, BLOCK_HV)
    m = h < Hv
    x = tl.load(a_ptr + t * sa_t + h * sa_h, mask=m, other=0.0).to(tl.float32) \
        + tl.load(dtb_ptr + h, mask=m, other=0.0).to(tl.float32)
    # softplus (beta 1, threshold 20); log1p(u) = log(1+u) * u / ((1+u) - 1) keeps small u exact
    u = tl.exp(tl.minimum(x, 20.0))
    w1 = 1.0 + u
    log1p = tl.where(w1 == 1.0, u, tl.log(w1) * (u / tl.where(w1 == 1.0, 1.0, w1 - 1.0)))
    sp = tl.where(x > 20.0, x, log1p)
    g = -tl.exp(tl.load(alog_ptr + h, mask=m, other=0.0).to(tl.float32)) * sp
    tl.store(g_ptr + t * Hv + h, g, mask=m)
    bv = tl.load(b_ptr + t * sb_t + h * sb_h, mask=m, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-bv))
    # b.sigmoid() in the model dtype, as transformers computes beta
    tl.store(beta_ptr + t * Hv + h, sig.to(b_ptr.dtype.element_ty).to(tl.float32), mask=m)


def gdn_gating_triton(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                      dt_bias: torch.Tensor):
    """(q_n, k_n, g, beta): q, k [T, Hk, K] l2-normalised per head (float32, rounded to
    their dtype, contiguous); g = -exp(A_log) * softplus(a + dt_bias) and beta =
    round(sigmoid(b)), float32 [T, Hv]. One program per token, a [Hk, K] tile per tensor."""
    T, Hk, K = q.shape
    Hv = a.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous head dim")
    qn = torch.empty((T, Hk, K), dtype=q.dtype, device=q.device)
    kn = torch.empty((T, Hk, K), dtype=k.dtype, device=k.device)
    g = torch.empty((T, Hv), dtype=torch.float32, device=q.device)
    beta = torch.empty((T, Hv), dtype=torch.float32, device=q.device)
    if T:
        bhk, bk = triton.next_power_of_2(Hk), triton.next_power_of_2(K)
        _gating_kernel[(T,)](q, k, a, b, A_log, dt_bias, qn, kn, g, beta, Hk, K, Hv,
                             q.stride(0), q.stride(1), k.stride(0), k.stride(1), a.stride(0), a.stride(1),
                             b.stride(0), b.stride(1), BLOCK_HK=bhk, BLOCK_K=bk,
                             BLOCK_HV=triton.next_power_of_2(Hv), num_warps=4 if bhk * bk <= 1024 else 8,
                             enable_fp_fusion=True)
    return qn, kn, g, beta


def _l2norm_torch(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf / torch.sqrt(_tree_sum(xf * xf, -1) + 1e-6)[..., None]).to(x.dtype)


def gdn_gating_torch(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor):
    """gdn_gating_triton in torch (sqrt and division are exactly rounded everywhere)."""
    sp = _pointwise(F.softplus, a.float() + dt_bias.float())
    g = -torch.exp(A_log.float()) * sp
    beta = _pointwise(torch.sigmoid, b.float()).to(b.dtype).float()
    return _l2norm_torch(q), _l2norm_torch(k), g, beta


def _gating_reference(q, k, a, b, A_log, dt_bias):
    def l2(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    return l2(q), l2(k), -torch.exp(A_log) * F.softplus(a + dt_bias), torch.sigmoid(b)


class GdnGatingFn(torch.autograd.Function):
    """(q_n, k_n, g, beta) = fwd(q, k, a, b, A_log, dt_bias); grads for all six inputs."""

    @staticmethod
    def forward(ctx, q, k, a, b, A_log, dt_bias, fwd):
        ctx.save_for_backward(q, k, a, b, A_log, dt_bias)
        return fwd(q, k, a, b, A_log, dt_bias)

    @staticmethod
    def backward(ctx, dq, dk, dg, dbeta):
        grads = _vjp(_gating_reference, ctx.saved_tensors, (dq, dk, dg, dbeta), ctx.needs_input_grad[:6])
        return (*grads, None)


# ---- 3. gated RMSNorm -------------------------------------------------------------------------

@triton.jit
def _rms_norm_gated_kernel(x_ptr, z_ptr, w_ptr, out_ptr, INNER, V, eps, sx_o, sx_i, sz_o, sz_i,
                           BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (n // INNER) * sx_o + (n % INNER) * sx_i
    z_row = z_ptr + (n // INNER) * sz_o + (n % INNER) * sz_i
    o_row = out_ptr + n * V
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / V + eps)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < V
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_row + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        # transformers' roundings: the normalised row, then weight * it in the model dtype
        h = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        h = (w * h).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(o_row + cols, (h * (z / (1.0 + tl.exp(-z)))).to(out_ptr.dtype.element_ty), mask=m)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """[..., V] as [A, B, V] without a copy for 2-D and 3-D views."""
    if t.dim() == 2:
        return t[:, None, :]
    if t.dim() == 3:
        return t
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def rms_norm_gated_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """round(round(w * round(x * rstd)) * silu(z)) per row of x, z [N, V] (or [T, H, V]
    views); one program per row, the row reduced in a BLOCK fixed by V."""
    V = x.shape[-1]
    if x.stride(-1) != 1 or z.stride(-1) != 1:
        raise ValueError("x and z need a contiguous last dim")
    x3, z3 = _as_3d(x), _as_3d(z)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    N = x3.shape[0] * x3.shape[1]
    if N:
        block = min(triton.next_power_of_2(V), 4096)
        _rms_norm_gated_kernel[(N,)](x3, z3, weight, out, x3.shape[1], V, eps,
                                     x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), BLOCK=block,
                                     num_warps=1 if block <= 256 else 4, enable_fp_fusion=True)
    return out


def rms_norm_gated_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_gated_triton in torch: the row sum as a fixed tree, SiLU on fixed chunks."""
    dt = x.dtype
    xf = x.float()
    rstd = 1.0 / torch.sqrt(_tree_sum(xf * xf, -1) / x.shape[-1] + eps)
    h = (xf * rstd[..., None]).to(dt).float()
    h = (weight.float() * h).to(dt).float()
    return (h * _pointwise(F.silu, z.float())).to(dt)


def _rms_norm_gated_reference(x, z, weight, eps):
    return (weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * F.silu(z),)


class RMSNormGatedFn(torch.autograd.Function):
    """out = fwd(x, z, weight, eps); grads for x, z and weight."""

    @staticmethod
    def forward(ctx, x, z, weight, eps, fwd):
        ctx.save_for_backward(x, z, weight)
        ctx.eps = eps
        return fwd(x, z, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        eps = ctx.eps
        grads = _vjp(lambda x, z, w: _rms_norm_gated_reference(x, z, w, eps), ctx.saved_tensors, (dy,),
                     ctx.needs_input_grad[:3])
        return (*grads, None, None)


# ---- 4. recurrent gated delta rule, one token per sequence --------------------------------------

@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, ssm_ptr, start_ptr, slot_ptr, scale,
                      K, V, sq_s, sq_h, sk_s, sk_h, sv_s, sv_h, sg_s, sg_h, sb_s, sb_h,
                      ss_n, ss_h, ss_k, GROUP: tl.constexpr, HAS_STATE: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kc = tl.arange(0, BLOCK_K)
    vc = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = kc < K
    v_ok = vc < V
    m = k_ok[:, None] & v_ok[None, :]
    hk = h // GROUP
    if HAS_STATE:
        start = tl.load(start_ptr + s)
        slot = tl.load(slot_ptr + s).to(tl.int64)
        st_ptrs = ssm_ptr + slot * ss_n + h * ss_h + kc[:, None] * ss_k + vc[None, :]
        # a sequence at position 0 starts from zeros, whatever its (reused) slot holds
        st = tl.load(st_ptrs, mask=m & (start > 0), other=0.0)
    else:
        st = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    q = tl.load(q_ptr + s * sq_s + hk * sq_h + kc, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + s * sk_s + hk * sk_h + kc, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + s * sv_s + h * sv_h + vc, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + s * sg_s + h * sg_h)
    beta = tl.load(beta_ptr + s * sb_s + h * sb_h)
    st = st * tl.exp(g)
    kv = tl.sum(st * k[:, None], axis=0)
    delta = beta * (v - kv)
    st = st + k[:, None] * delta[None, :]
    o = scale * tl.sum(st * q[:, None], axis=0)
    tl.store(o_ptr + (s * tl.num_programs(1) + h) * V + vc, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    if HAS_STATE:
        tl.store(st_ptrs, st, mask=m)


def gdn_recurrent_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float, md: StateMetadata, state: dict | None, *, chunk_size: int = 64) -> torch.Tensor:
    """One delta-rule step per sequence (T == S): S = S*exp(g); S += k (beta (v - S^T k))^T;
    o = scale S^T q. q, k [S, Hk, K], v [S, Hv, V], g, beta [S, Hv] float32; state["ssm"]
    [num_slots, Hv, K, V] float32 read (when start_pos > 0) and written at md.slots.
    One program per (sequence, value head, V tile) holding its [K, V tile] state."""
    S, Hk, K = q.shape
    Hv, V = v.shape[1], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    if S != md.start_pos.shape[0]:
        raise ValueError("the recurrent step takes one token per sequence")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v need a contiguous head dim")
    o = torch.empty((S, Hv, V), dtype=v.dtype, device=v.device)
    ssm = _cached_ssm(md, state)
    if ssm is not None and ssm.stride(-1) != 1:
        raise ValueError("the ssm state needs a contiguous last dim")
    if S:
        bv = min(triton.next_power_of_2(V), 16)
        st = ssm if ssm is not None else g
        slots = md.slots if ssm is not None else md.start_pos
        _recurrent_kernel[(S, Hv, triton.cdiv(V, bv))](
            q, k, v, g, beta, o, st, md.start_pos, slots, scale, K, V,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
            ssm.stride(0) if ssm is not None else 0, ssm.stride(1) if ssm is not None else 0,
            ssm.stride(2) if ssm is not None else 0,
            GROUP=Hv // Hk, HAS_STATE=ssm is not None, BLOCK_K=triton.next_power_of_2(K), BLOCK_V=bv, num_warps=4,
            enable_fp_fusion=True)
    return o


def gdn_recurrent_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        scale: float, md: StateMetadata, state: dict | None, *, chunk_size: int = 64) -> torch.Tensor:
    """gdn_recurrent_triton in torch, every sequence and head at once (the K sums as trees)."""
    S, Hk, K = q.shape
    Hv = v.shape[1]
    if S != md.start_pos.shape[0]:
        raise ValueError("the recurrent step takes one token per sequence")
    G = Hv // Hk
    qf = q.float().repeat_interleave(G, 1)[..., None]  # [S, Hv, K, 1]
    kf = k.float().repeat_interleave(G, 1)[..., None]
    ssm = _cached_ssm(md, state)
    st = _ssm_rows(md, ssm, (Hv, K, v.shape[2]), v.device)
    st = st * _pointwise(torch.exp, g.float())[..., None, None]
    kv = _tree_sum(st * kf, 2)
    delta = beta.float()[..., None] * (v.float() - kv)
    st = st + kf * delta[:, :, None, :]
    o = scale * _tree_sum(st * qf, 2)
    if ssm is not None:
        ssm[md.slots.long()] = st
    return o.to(v.dtype)
