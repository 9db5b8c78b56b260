"""Mamba-2's training backward as fused per-chunk Triton kernels: the gradients of
`mamba2_reference` (mamba2_chunk.py) without its autograd graph of batched torch ops (whose
[chunk, head, C, C] temporaries dominate its time).

Per chunk of C rows (padded sequences, every one from position 0 with a zero state; all math
float32), per head h of group g, with d = clamp(softplus(dt + dt_bias), dt_min) (zero on
padding rows), gamma = cumsum(d A_h), decay_ij = exp(gamma_i - gamma_j) (j <= i), the
forward is

    y_diag = ((C B^T) * decay * d_j) x,      local = (x * e^(gamma_L - gamma) d)^T B,
    S_(c+1) = e^gamma_L S_c + local_c (S_0 = 0),     y_off = (C S_c^T) * e^gamma,
    y = y_diag + y_off + D_h x

and the backward runs four launches:
  1. prep (per chunk x head): gamma, e = e^gamma_L, local_c, and the gradient reaching S_c
     from y_off, (dy e^gamma)^T C;
  2. the recurrence (per sequence x head): S_c forward, then its gradient from the last
     chunk back (d local_c = dS_(c+1));
  3. final, in two launches per (chunk x head) that each fit shared memory: the chunk's
     own rows (y_diag, D x: parts of dx, dB, dC, d d, d gamma, the chunk's part of dD), then
     the states' side (y_off, local, e: the rest, then d d through gamma = cumsum(d A) and
     the chunk's part of dA).
The rest is elementwise in torch: the group's dB, dC as sums over its heads, d through the
clamp and softplus to dt and dt_bias, A = -exp(A_log).

Dots (training_tiles.mm) take bf16 operands with float32 accumulation on the GPU for
bfloat16 inputs, 3xTF32 for float32 ones, "ieee" under the interpreter. A backward, checked
against float64 autograd of `mamba2_reference` (tests/test_mamba2_backward.py), not a parity
path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.kernels.chunk_scan import PaddedChunks, require_triton
from vllm.kernels.chunk_tiles import HAS_TRITON, aligned16, next_pow2
from vllm.kernels import training_tiles
from vllm.kernels.training_tiles import matrix_desc as _desc, rows_aligned

NUM_WARPS = 8
# the largest chunk whose kernels fit sm_90's shared memory (227 KB a block; the final
# kernels take C = 128 (Nemotron-H): 196 KB of it)
MAX_CHUNK = 128

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm.kernels.training_tiles import load_tile as _tile, mm as _mm, store_tile as _put

    @triton.jit
    def _group_chunk(ch, NCH, HEADS, R):
        """The chunk of the head's group that chunk `ch` (of [seqs, heads, chunks]) reads."""
        c = ch % NCH
        sh = ch // NCH
        return ((sh // HEADS) * (HEADS // R) + (sh % HEADS) // R) * NCH + c

    @triton.jit
    def _prep_kernel(x_desc, b_desc, c_desc, dy_desc, d_ptr, a_ptr, gam_ptr, e_ptr, local_desc, ds_desc,
                     C, NCH, HEADS, R, BC: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
        """One program per (chunk, head): gamma, e^gamma_L, the chunk's local state and the
        gradient its boundary state gets from y_off."""
        ch = tl.program_id(0)
        gch = _group_chunk(ch, NCH, HEADS, R)
        A = tl.load(a_ptr + (ch // NCH) % HEADS)
        rows = tl.arange(0, BC)
        rm = rows < C
        d = tl.load(d_ptr + ch.to(tl.int64) * C + rows, mask=rm, other=0.0)
        gam = tl.cumsum(d * A, 0)
        tl.store(gam_ptr + ch.to(tl.int64) * C + rows, gam, mask=rm)
        gl = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
        tl.store(e_ptr + ch, tl.exp(gl))
        x = _tile(x_desc, ch, BC, BP)
        Bm = _tile(b_desc, gch, BC, BN)
        w = tl.exp(gl - gam) * d
        _put(local_desc, ch, _mm(tl.trans(x * w[:, None]), Bm, PREC), BP, BN)
        dyo = _tile(dy_desc, ch, BC, BP) * tl.exp(gam)[:, None]
        _put(ds_desc, ch, _mm(tl.trans(dyo), _tile(c_desc, gch, BC, BN), PREC), BP, BN)

    @triton.jit
    def _recurrence_kernel(local_desc, e_ptr, ds_desc, s_desc, dl_desc, NCH, BP: tl.constexpr, BN: tl.constexpr):
        """One program per (sequence, head): S_0 = 0, S_(c+1) = e_c S_c + local_c (every S_c
        stored), then from the last chunk back dS = ds_c + e_c dS with d local_c = dS_(c+1)
        (nothing reads the last chunk's end state). The backward loop never reads a stored S_c
        back: a TMA store is not ordered before a later TMA load of the same address in one
        program, so de_c = <S_c, dS_(c+1)> is left to the final kernel, a later launch."""
        base = tl.program_id(0) * NCH
        S = tl.zeros((BP, BN), dtype=tl.float32)
        for c in range(NCH):
            _put(s_desc, base + c, S, BP, BN)
            S = S * tl.load(e_ptr + base + c) + _tile(local_desc, base + c, BP, BN)
        dS = tl.zeros((BP, BN), dtype=tl.float32)
        for i in range(NCH):
            c = base + NCH - 1 - i
            _put(dl_desc, c, dS, BP, BN)
            dS = _tile(ds_desc, c, BP, BN) + tl.load(e_ptr + c) * dS

    @triton.jit
    def _final_diag_kernel(x_desc, b_desc, c_desc, dy_desc, d_ptr, dskip_ptr, gam_ptr,
                           dx_desc, db_desc, dc_desc, dd_ptr, dgam_ptr, dskip_out_ptr, C, NCH, HEADS, R,
                           BC: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, NS: tl.constexpr,
                           PREC: tl.constexpr):
        """One program per (chunk, head), the chunk's own rows: through y_diag and D x, the
        parts of dx, dB, dC, d d and d gamma, and the chunk's part of dD. B, C, dB and dC move
        in NS column slices of BN (their descriptors' boxes): a C x C by C x N product of
        3xTF32 operands whole would not fit shared memory."""
        ch = tl.program_id(0)
        gch = _group_chunk(ch, NCH, HEADS, R)
        head = (ch // NCH) % HEADS
        rows = tl.arange(0, BC)
        rm = rows < C
        # rows past C (zero tiles) stay out: their exp(gamma_i - gamma_j) read gamma_i = 0 and overflow
        incl = (rows[None, :] <= rows[:, None]) & (rows[:, None] < C)
        d = tl.load(d_ptr + ch.to(tl.int64) * C + rows, mask=rm, other=0.0)
        gam = tl.load(gam_ptr + ch.to(tl.int64) * C + rows, mask=rm, other=0.0)
        x = _tile(x_desc, ch, BC, BP)
        dy = _tile(dy_desc, ch, BC, BP)
        # y_diag = M x, M = (C B^T) * decay * d_j
        decay = tl.where(incl, tl.exp(tl.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
        cb = tl.zeros((BC, BC), dtype=tl.float32)
        for s in tl.static_range(NS):
            Cs = tl.reshape(c_desc.load([gch, 0, s * BN]), (BC, BN))
            Bs = tl.reshape(b_desc.load([gch, 0, s * BN]), (BC, BN))
            cb += _mm(Cs, tl.trans(Bs), PREC)
        cbd = cb * decay
        dM = tl.where(incl, _mm(dy, tl.trans(x), PREC), 0.0)
        _put(dx_desc, ch, _mm(tl.trans(cbd * d[None, :]), dy, PREC)
             + tl.load(dskip_ptr + head) * dy, BC, BP)
        dcb = dM * decay * d[None, :]
        for s in tl.static_range(NS):
            Bs = tl.reshape(b_desc.load([gch, 0, s * BN]), (BC, BN))
            dc_desc.store([ch, 0, s * BN], tl.reshape(_mm(dcb, Bs, PREC), (1, BC, BN)))
            Cs = tl.reshape(c_desc.load([gch, 0, s * BN]), (BC, BN))
            db_desc.store([ch, 0, s * BN], tl.reshape(_mm(tl.trans(dcb), Cs, PREC), (1, BC, BN)))
        dMc = dM * cbd
        Q = dMc * d[None, :]
        tl.store(dd_ptr + ch.to(tl.int64) * C + rows, tl.sum(dMc, 0), mask=rm)
        tl.store(dgam_ptr + ch.to(tl.int64) * C + rows, tl.sum(Q, 1) - tl.sum(Q, 0), mask=rm)
        tl.store(dskip_out_ptr + ch, tl.sum(tl.sum(dy * x, 1), 0))

    @triton.jit
    def _final_local_kernel(x_desc, b_desc, c_desc, dy_desc, d_ptr, a_ptr, gam_ptr, s_desc, dl_desc,
                            dx_desc, db_desc, dc_desc, dd_ptr, dgam_ptr, da_ptr, C, NCH, HEADS, R,
                            BC: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
        """One program per (chunk, head), the states' side: through y_off = (C S^T) e^gamma,
        local = (x w)^T B and e = e^gamma_L, the rest of dx, dB, dC, d d and d gamma (added to
        the chunk-rows side's), then gamma = cumsum(d A): d d and the chunk's part of dA."""
        ch = tl.program_id(0)
        gch = _group_chunk(ch, NCH, HEADS, R)
        A = tl.load(a_ptr + (ch // NCH) % HEADS)
        rows = tl.arange(0, BC)
        rm = rows < C
        d = tl.load(d_ptr + ch.to(tl.int64) * C + rows, mask=rm, other=0.0)
        gam = tl.load(gam_ptr + ch.to(tl.int64) * C + rows, mask=rm, other=0.0)
        x = _tile(x_desc, ch, BC, BP)
        Bm = _tile(b_desc, gch, BC, BN)
        # y_off = (C S^T) e^gamma
        S = _tile(s_desc, ch, BP, BN)
        dyo = _tile(dy_desc, ch, BC, BP) * tl.exp(gam)[:, None]
        _put(dc_desc, ch, _tile(dc_desc, ch, BC, BN) + _mm(dyo, S, PREC), BC, BN)
        dgam = tl.load(dgam_ptr + ch.to(tl.int64) * C + rows, mask=rm, other=0.0) \
            + tl.sum(dyo * _mm(_tile(c_desc, gch, BC, BN), tl.trans(S), PREC), 1)
        dl = _tile(dl_desc, ch, BP, BN)
        gl = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
        ew = tl.exp(gl - gam)
        w = ew * d
        dxw = _mm(Bm, tl.trans(dl), PREC)
        _put(db_desc, ch, _tile(db_desc, ch, BC, BN) + _mm(x * w[:, None], dl, PREC), BC, BN)
        _put(dx_desc, ch, _tile(dx_desc, ch, BC, BP) + dxw * w[:, None], BC, BP)
        dw = tl.sum(dxw * x, 1)
        dd = tl.load(dd_ptr + ch.to(tl.int64) * C + rows, mask=rm, other=0.0) + dw * ew
        dgam -= dw * w
        de = tl.sum(tl.sum(S * dl, 1), 0)                  # e = e^gamma_L: <S_c, dS_(c+1)>
        dgam += tl.where(rows == C - 1, tl.sum(dw * w, 0) + de * tl.exp(gl), 0.0)
        rc = tl.cumsum(dgam, 0, reverse=True)
        tl.store(dd_ptr + ch.to(tl.int64) * C + rows, dd + rc * A, mask=rm)
        tl.store(da_ptr + ch, tl.sum(rc * d, 0))


def fused_backward_ok(x: torch.Tensor, B: torch.Tensor) -> bool:
    """Where the fused kernels apply: Triton, and P, N multiples of 4 (16-byte rows)."""
    return HAS_TRITON and rows_aligned(x.shape[-1], B.shape[-1])


def mamba2_backward_triton(x, dt, dt_bias, A_log, B, C, D, dy, dt_min: float, cu_seqlens, chunk_size: int = 128):
    """(dx, ddt, ddt_bias, dA_log, dB, dC, dD) of y = mamba2_reference(x, dt, dt_bias, A_log,
    B, C, D, dt_min, cu_seqlens, chunk_size) against dy, in the inputs' dtypes, computed in
    float32."""
    require_triton(x)
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = H // G
    Cs = chunk_size
    seqs = PaddedChunks(cu_seqlens, Cs)
    if T == 0 or not seqs.lens:
        return tuple(torch.zeros_like(t) for t in (x, dt, dt_bias, A_log, B, C, D))
    if not fused_backward_ok(x, B):
        raise ValueError(f"the fused Mamba-2 backward needs P and N multiples of 4, got {P}, {N}")
    if Cs > MAX_CHUNK:
        raise ValueError(f"the fused Mamba-2 backward takes chunks of at most {MAX_CHUNK} rows, got {Cs}")
    nC, S = seqs.num_chunks, len(seqs.lens)
    pre = dt.float() + dt_bias.float()
    sp = F.softplus(pre)
    dtv = torch.clamp(sp, min=dt_min)
    A = -torch.exp(A_log.float())

    def batch(t):  # [T, heads, ...] -> [S, heads, nC, C, ...] float32, contiguous
        return aligned16(seqs.by_chunk(t, torch.float32))

    unbatch = seqs.from_chunks

    xb, bb, cb, dyb, db_ = batch(x), batch(B), batch(C), batch(dy), batch(dtv)
    BC, BP, BN = max(16, next_pow2(Cs)), max(16, next_pow2(P)), max(16, next_pow2(N))
    n = S * H * nC
    f32 = dict(dtype=torch.float32, device=x.device)
    gam = torch.empty_like(db_)
    e = torch.empty((S, H, nC), **f32)
    local = torch.empty((S, H, nC, P, N), **f32)
    ds = torch.empty_like(local)
    opts = dict(BC=BC, BP=BP, BN=BN, PREC=training_tiles.dot_precision(x), num_warps=NUM_WARPS)
    cp, cn, pn = (BC, BP), (BC, BN), (BP, BN)
    a = aligned16(A)
    _prep_kernel[(n,)](_desc(xb, cp), _desc(bb, cn), _desc(cb, cn), _desc(dyb, cp), db_, a, gam, e,
                       _desc(local, pn), _desc(ds, pn), Cs, nC, H, R, **opts)
    states, dl = torch.empty_like(local), torch.empty_like(local)
    _recurrence_kernel[(S * H,)](_desc(local, pn), e, _desc(ds, pn), _desc(states, pn), _desc(dl, pn), nC,
                                 BP=BP, BN=BN, num_warps=NUM_WARPS)
    dx, dB, dC = torch.empty_like(xb), torch.empty((S, H, nC, Cs, N), **f32), torch.empty((S, H, nC, Cs, N), **f32)
    dd, dgam = torch.empty_like(db_), torch.empty_like(db_)
    dA_part, dD_part = torch.empty_like(e), torch.empty_like(e)
    # the chunk-rows side takes B, C, dB, dC in column slices from N = 128 (shared memory)
    ns = 2 if BN >= 128 else 1
    cs = (BC, BN // ns)
    _final_diag_kernel[(n,)](_desc(xb, cp), _desc(bb, cs), _desc(cb, cs), _desc(dyb, cp), db_, aligned16(D.float()),
                             gam, _desc(dx, cp), _desc(dB, cs), _desc(dC, cs), dd, dgam, dD_part, Cs, nC, H, R,
                             **{**opts, "BN": BN // ns}, NS=ns)
    _final_local_kernel[(n,)](_desc(xb, cp), _desc(bb, cn), _desc(cb, cn), _desc(dyb, cp), db_, a, gam,
                              _desc(states, pn), _desc(dl, pn), _desc(dx, cp), _desc(dB, cn), _desc(dC, cn), dd,
                              dgam, dA_part, Cs, nC, H, R, **opts)
    # the group's B and C: the sum over its heads (in head order)
    dB = unbatch(dB.view(S, G, R, nC, Cs, N).sum(2))
    dC = unbatch(dC.view(S, G, R, nC, Cs, N).sum(2))
    # d = clamp(softplus(dt + dt_bias), dt_min): the gradient passes where softplus >= dt_min
    dpre = unbatch(dd) * (sp >= dt_min) * torch.sigmoid(pre)
    dA = dA_part.sum((0, 2))
    return (unbatch(dx).to(x.dtype), dpre.to(dt.dtype), dpre.sum(0).to(dt_bias.dtype), (dA * A).to(A_log.dtype),
            dB.to(B.dtype), dC.to(C.dtype), dD_part.sum((0, 2)).to(D.dtype))
