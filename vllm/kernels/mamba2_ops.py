"""Mamba-2 (Nemotron-H) ops around the chunked scan (vllm/kernels/mamba2_chunk.py): the time
step `dt`, the grouped gated RMSNorm of the output, and the one-token selective state update
(fast mode's decode). The causal conv is Gated DeltaNet's (`gdn_ops.causal_conv1d_*`, with
its bias).

Each op has a Triton entry (`*_triton`, CUDA) and a torch entry (`*_torch`, CPU) with one
signature, both batch-invariant the way gdn_ops' are: an element comes from its own row's
inputs through an order fixed by the model's dims; the torch entries sum with fixed trees
(`_tree_sum`) and evaluate exp-based functions on fixed-length chunks (`_pointwise`), which
keeps every element on ATen's vector path. The autograd Function runs the forward kernel it
is given and differentiates the op's unrounded float32 formula.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllm.forward_context import StateMetadata
from vllm.kernels.gdn_ops import _cached_ssm, _pointwise, _ssm_rows, _tree_sum, _vjp

# ---- the time step ------------------------------------------------------------------------------


@triton.jit
def softplus_clamped(x, dt_min):
    """max(softplus(x), dt_min) in float32 (softplus with beta 1 and threshold 20, as torch;
    log1p(u) = log(1+u) * u / ((1+u) - 1) keeps small u exact)."""
    u = tl.exp(tl.minimum(x, 20.0))
    w1 = 1.0 + u
    log1p = tl.where(w1 == 1.0, u, tl.log(w1) * (u / tl.where(w1 == 1.0, 1.0, w1 - 1.0)))
    return tl.maximum(tl.where(x > 20.0, x, log1p), dt_min)


def dt_torch(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float) -> torch.Tensor:
    """max(softplus(dt + dt_bias), dt_min) in float32 [T, H] (transformers' Mamba-2 chunk path
    clamps dt to time_step_limit, here [dt_min, inf)); softplus on fixed chunks."""
    return torch.clamp(_pointwise(F.softplus, dt.float() + dt_bias.float()), min=dt_min)


def neg_exp_torch(A_log: torch.Tensor) -> torch.Tensor:
    """A = -exp(A_log) in float32."""
    return -_pointwise(torch.exp, A_log.float())


# ---- grouped gated RMSNorm (the gate before the norm) --------------------------------------------

@triton.jit
def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, GROUPS, V, eps, sx_t, sz_t, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)  # row (token, group)
    t = n // GROUPS
    g = n % GROUPS
    x_row = x_ptr + t * sx_t + g * V
    z_row = z_ptr + t * sz_t + g * V
    w_row = w_ptr + g * V
    o_row = out_ptr + n * V
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < V
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_row + cols, mask=m, other=0.0).to(tl.float32)
        h = x * (z / (1.0 + tl.exp(-z)))
        acc += h * h
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / V + eps)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < V
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_row + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_row + cols, mask=m, other=0.0).to(tl.float32)
        h = x * (z / (1.0 + tl.exp(-z)))
        # transformers' roundings: the normalised row, then weight * it in the model dtype
        o = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(o_row + cols, (w * o).to(out_ptr.dtype.element_ty), mask=m)


def _check_norm(x, z, weight, groups):
    T, D = x.shape
    if z.shape != x.shape or weight.shape != (D,) or D % groups:
        raise ValueError("expected x, z [T, D], weight [D] and D a multiple of the groups")
    if x.stride(-1) != 1 or z.stride(-1) != 1:
        raise ValueError("x and z need a contiguous last dim")


def gated_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, groups: int) -> torch.Tensor:
    """round(w * round(h * rstd)) with h = x * silu(z) in float32 and rstd over each of the
    `groups` equal slices of a row: x, z [T, D] (z may be a strided view), weight [D]. One
    program per (token, group), the slice reduced in a BLOCK fixed by its length."""
    _check_norm(x, z, weight, groups)
    T, D = x.shape
    V = D // groups
    out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T:
        block = min(triton.next_power_of_2(V), 4096)
        _gated_norm_kernel[(T * groups,)](x, z, weight, out, groups, V, eps, x.stride(0), z.stride(0), BLOCK=block,
                                         num_warps=1 if block <= 256 else 4, enable_fp_fusion=True)
    return out


def gated_norm_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, groups: int) -> torch.Tensor:
    """gated_norm_triton in torch: the slice sums as fixed trees, SiLU on fixed chunks."""
    _check_norm(x, z, weight, groups)
    T, D = x.shape
    dt = x.dtype
    h = (x.float() * _pointwise(F.silu, z.float())).view(T, groups, D // groups)
    rstd = 1.0 / torch.sqrt(_tree_sum(h * h, -1) / (D // groups) + eps)
    o = (h * rstd[..., None]).to(dt).float()
    return (weight.float().view(groups, D // groups) * o).to(dt).view(T, D)


def _gated_norm_reference(x, z, weight, eps, groups):
    T, D = x.shape
    h = (x * F.silu(z)).view(T, groups, D // groups)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.reshape(T, D),)


class GatedNormFn(torch.autograd.Function):
    """out = fwd(x, z, weight, eps, groups); grads for x, z and weight."""

    @staticmethod
    def forward(ctx, x, z, weight, eps, groups, fwd):
        ctx.save_for_backward(x, z, weight)
        ctx.eps, ctx.groups = eps, groups
        return fwd(x, z, weight, eps, groups)

    @staticmethod
    def backward(ctx, dy):
        eps, groups = ctx.eps, ctx.groups
        grads = _vjp(lambda x, z, w: _gated_norm_reference(x, z, w, eps, groups), ctx.saved_tensors, (dy,),
                     ctx.needs_input_grad[:3])
        return (*grads, None, None, None)


# ---- selective state update: one token per sequence (fast mode's decode) ------------------------

@triton.jit
def _ssu_kernel(x_ptr, dt_ptr, dtb_ptr, alog_ptr, b_ptr, c_ptr, d_ptr, y_ptr, ssm_ptr, start_ptr, slot_ptr, dt_min,
                sx_s, sdt_s, sb_s, sc_s, H, P, N,
                GROUP: tl.constexpr, HAS_STATE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // GROUP
    rp = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    rn = tl.arange(0, BLOCK_N)
    p_ok = rp < P
    n_ok = rn < N
    m = p_ok[:, None] & n_ok[None, :]
    if HAS_STATE:
        start = tl.load(start_ptr + s)
        slot = tl.load(slot_ptr + s).to(tl.int64)
        st_ptrs = ssm_ptr + ((slot * H + h) * P + rp[:, None]) * N + rn[None, :]
        # a sequence at position 0 starts from zeros, whatever its (reused) slot holds
        st = tl.load(st_ptrs, mask=m & (start > 0), other=0.0)
    else:
        st = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    x = tl.load(x_ptr + s * sx_s + h * P + rp, mask=p_ok, other=0.0).to(tl.float32)
    raw = tl.load(dt_ptr + s * sdt_s + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    dt = softplus_clamped(raw, dt_min)
    a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    b = tl.load(b_ptr + s * sb_s + g * N + rn, mask=n_ok, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + s * sc_s + g * N + rn, mask=n_ok, other=0.0).to(tl.float32)
    st = st * tl.exp(dt * a) + (b * dt)[None, :] * x[:, None]
    y = tl.sum(st * c[None, :], axis=1) + tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + (s * tl.num_programs(1) + h) * P + rp, y.to(y_ptr.dtype.element_ty), mask=p_ok)
    if HAS_STATE:
        tl.store(st_ptrs, st, mask=m)


def selective_state_update_triton(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                                  B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, dt_min: float, md: StateMetadata,
                                  state: dict | None, *, chunk_size: int = 128) -> torch.Tensor:
    """One Mamba-2 step per sequence (T == S): S = S exp(dt A) + (B dt) x^T, y = S C + D x.
    x [S, H, P], dt [S, H] (before softplus), B, C [S, G, N] (rows may be strided views);
    state["ssm"] [num_slots, H, P, N] float32 read (when start_pos > 0) and written at md.slots.
    One program per (sequence, head, P tile) holding its [P tile, N] state."""
    S, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if S != md.start_pos.shape[0]:
        raise ValueError("the selective state update takes one token per sequence")
    for t in (x, dt, B, C):
        if t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) != t.shape[2]):
            raise ValueError("x, dt, B and C need contiguous rows")
    y = torch.empty((S, H, P), dtype=x.dtype, device=x.device)
    ssm = _cached_ssm(md, state)
    if S:
        bp = min(triton.next_power_of_2(P), 16)
        _ssu_kernel[(S, H, triton.cdiv(P, bp))](
            x, dt, dt_bias, A_log, B, C, D, y, ssm if ssm is not None else x, md.start_pos,
            md.slots if ssm is not None else md.start_pos, float(dt_min),
            x.stride(0), dt.stride(0), B.stride(0), C.stride(0), H, P, N,
            GROUP=H // G, HAS_STATE=ssm is not None, BLOCK_P=bp, BLOCK_N=triton.next_power_of_2(N), num_warps=4,
            enable_fp_fusion=True)
    return y


def selective_state_update_torch(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                                 B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, dt_min: float, md: StateMetadata,
                                 state: dict | None, *, chunk_size: int = 128) -> torch.Tensor:
    """selective_state_update_triton in torch, every sequence and head at once (N sums as trees)."""
    S, H, P = x.shape
    G = B.shape[1]
    if S != md.start_pos.shape[0]:
        raise ValueError("the selective state update takes one token per sequence")
    d = dt_torch(dt, dt_bias, dt_min)                              # [S, H]
    decay = _pointwise(torch.exp, d * neg_exp_torch(A_log)[None])   # [S, H]
    xf = x.float()
    bf = B.float().repeat_interleave(H // G, 1)                    # [S, H, N]
    cf = C.float().repeat_interleave(H // G, 1)
    ssm = _cached_ssm(md, state)
    st = _ssm_rows(md, ssm, (H, P, B.shape[2]), x.device)
    st = st * decay[..., None, None] + (bf * d[..., None])[:, :, None, :] * xf[..., None]
    y = _tree_sum(st * cf[:, :, None, :], -1) + D.float()[None, :, None] * xf
    if ssm is not None:
        ssm[md.slots.long()] = st
    return y.to(x.dtype)
