"""Mamba-2's training backward as fused per-chunk Triton kernels: the gradients of
`mamba2_reference` (mamba2_chunk.py) without its autograd graph of batched torch ops (whose
[chunk, head, C, C] temporaries dominate its time).

Per chunk of C rows (every sequence from position 0 with a zero state; all math float32),
per head h of group g, with d = clamp(softplus(dt + dt_bias), dt_min) (zero on rows past
a sequence's end), gamma = cumsum(d A_h), decay_ij = exp(gamma_i - gamma_j) (j <= i), the
forward is

    y_diag = ((C B^T) * decay * d_j) x,      local = (x * e^(gamma_L - gamma) d)^T B,
    S_(c+1) = e^gamma_L S_c + local_c (S_0 = 0),     y_off = (C S_c^T) * e^gamma,
    y = y_diag + y_off + D_h x

and the backward runs five launches:
  1. prep (per chunk x head): gamma, e = e^gamma_L, local_c, and the gradient reaching S_c
     from y_off, (dy e^gamma)^T C;
  2. the recurrence (per sequence x head): S_c forward, then its gradient from the last
     chunk back (d local_c = dS_(c+1));
  3. dCB (per chunk x group): the gradient of the group's C B^T, summed over its heads;
  4. dB, dC (per chunk x group x columns of N): dCB's part plus every head's states' side,
     summed over the heads in registers and written once to the group's rows;
  5. dx (per chunk x head): everything else, through y_diag, D x, y_off, local and e: dx, d d
     (then through gamma = cumsum(d A)), the chunk's parts of dA and dD.
B and C belong to a group of R heads, so a per-head gradient of them would be R float32
copies of [T, N] written and summed after; (3) and (4) sum inside instead, in head order
(deterministic). The kernels read x, B, C, dy and d where the caller keeps them ([T, heads,
...] at its row stride, its dtype; a chunk's rows past its sequence's end load as zeros) and
write dx, d d, dB and dC there; what passes from kernel to kernel is float32 by chunk. The
rest is elementwise in torch: d through the clamp and softplus to dt and dt_bias,
A = -exp(A_log).

Dots (training_tiles.mm) take bf16 operands with float32 accumulation on the GPU for
bfloat16 inputs, 3xTF32 for float32 ones, "ieee" under the interpreter. A backward, checked
against float64 autograd of `mamba2_reference` (tests/test_mamba2_backward.py), not a parity
path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.kernels.chunk_scan import PaddedChunks, require_triton
from vllm.kernels.chunk_tiles import HAS_TRITON, aligned16, next_pow2, rows_aligned16
from vllm.kernels import training_tiles
from vllm.kernels.training_tiles import matrix_desc as _desc, rows_aligned

# (warps, pipeline stages) per kernel and dot precision; H200, Nemotron-H dims, 1 x 8,192, bf16,
# the whole backward as one kernel's config moves (`benchmarks/kernels/backward_sweep.py
# mamba2`, two runs; they vary by about 100 us): dCB at 4 warps 2,724 / 3,025 us against
# 2,877 / 3,156 at 8; the dB / dC kernel at 4 warps / 2 stages 2,891 / 2,965 against 2,924 /
# 3,070 at 8 / 3, at 1 stage 3,040-3,439; the dx kernel at 16 warps 5,520. 3xTF32's dB / dC
# kernel takes 2 stages (3 need 232,480 B of shared memory).
LAUNCH = {"bf16": {"prep": (8, 3), "recurrence": (8, 3), "dcb": (4, 1), "dbc": (4, 2), "dx": (8, 3)},
          "tf32x3": {"prep": (8, 3), "recurrence": (8, 3), "dcb": (8, 3), "dbc": (8, 2), "dx": (8, 3)}}
# the largest chunk whose kernels fit sm_90's shared memory (227 KB a block)
MAX_CHUNK = 128
# C B^T in the dx kernel takes B and C in column slices of SLICE_N (shared memory with 3xTF32
# operands at N = 128)
SLICE_N = 64
# the dx kernel's row blocks of the chunk's [C, C] matrices (H200, as above: the backward
# 2,456 us in blocks of 32 rows, 3,097 in 64, 2,722 whole; fewer registers spill)
ROW_BLOCK = 32
# the dB / dC kernel's columns of N per program: its two float32 [C, GROUP_BLOCK_N]
# accumulators stay in registers across the group's heads
GROUP_BLOCK_N = 64

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm.kernels.training_tiles import chunk_of as _chunk_of, load_rows as _rows_in, load_tile as _tile, mm as _mm
    from vllm.kernels.training_tiles import load_block as _block_in, load_operand as _opnd, store_block as _block_out
    from vllm.kernels.training_tiles import store_rows as _rows_out, store_tile as _put

    @triton.jit
    def _prep_kernel(x_ptr, b_ptr, c_ptr, dy_ptr, d_ptr, cu_ptr, a_ptr, gam_ptr, e_ptr, local_desc, ds_desc,
                     C, NCH, HEADS, G, R, SX, SB, SC, SDY, P: tl.constexpr, N: tl.constexpr, BC: tl.constexpr,
                     BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
        """One program per (chunk, head): gamma, e^gamma_L, the chunk's local state and the
        gradient its boundary state gets from y_off."""
        ch = tl.program_id(0)
        t0, n, h = _chunk_of(ch, cu_ptr, NCH, HEADS, C)
        A = tl.load(a_ptr + h)
        rows = tl.arange(0, BC)
        rm = rows < C
        d = tl.load(d_ptr + (t0 + rows).to(tl.int64) * HEADS + h, mask=rows < n, other=0.0)
        gam = tl.cumsum(d * A, 0)
        tl.store(gam_ptr + ch.to(tl.int64) * C + rows, gam, mask=rm)
        gl = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
        tl.store(e_ptr + ch, tl.exp(gl))
        x = _rows_in(x_ptr, t0, n, h * P, SX, P, BC, BP)
        Bm = _rows_in(b_ptr, t0, n, (h // R) * N, SB, N, BC, BN)
        w = tl.exp(gl - gam) * d
        _put(local_desc, ch, _mm(tl.trans(x * w[:, None]), Bm, PREC), BP, BN)
        dyo = _rows_in(dy_ptr, t0, n, h * P, SDY, P, BC, BP) * tl.exp(gam)[:, None]
        _put(ds_desc, ch, _mm(tl.trans(dyo), _rows_in(c_ptr, t0, n, (h // R) * N, SC, N, BC, BN), PREC), BP, BN)

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
    def _decay(gi, gam):
        """exp(gamma_i - gamma_j) for rows i (gi: gamma at some of the chunk's rows) and every row j,
        exact for j <= i and at most 1 everywhere: gamma = cumsum(d A) does not
        increase (d >= 0, A < 0; a tree-ordered cumsum may rise by an ulp, which the clip turns
        into a relative 1e-7), so min(., 0) clips the entries above the diagonal (and rows past
        C, whose gamma loads as 0), which callers mask out; no tile of masks is held across a
        loop. A NaN stays NaN."""
        return tl.exp(tl.minimum(gi[:, None] - gam[None, :], 0.0, propagate_nan=tl.PropagateNan.ALL))

    @triton.jit
    def _dcb_kernel(x_ptr, dy_ptr, d_ptr, cu_ptr, gam_ptr, dcb_desc, C, NCH, HEADS, G, R, SX, SB, SC, SDY,
                    P: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr):
        """One program per (chunk, group): the gradient of the group's C B^T through every
        head's y_diag, summed over the group's heads in head order,
        dCB = sum_h (dy_h x_h^T) * decay_h * d_h,j (j <= i)."""
        ch = tl.program_id(0)
        t0, n, g = _chunk_of(ch, cu_ptr, NCH, G, C)
        c = ch % NCH
        s = ch // NCH // G
        rows = tl.arange(0, BC)
        acc = tl.zeros((BC, BC), dtype=tl.float32)
        for r in range(R):
            h = g * R + r
            hc = (s * HEADS + h) * NCH + c
            d = tl.load(d_ptr + (t0 + rows).to(tl.int64) * HEADS + h, mask=rows < n, other=0.0)
            gam = tl.load(gam_ptr + hc.to(tl.int64) * C + rows, mask=rows < C, other=0.0)
            x = _rows_in(x_ptr, t0, n, h * P, SX, P, BC, BP)
            dy = _rows_in(dy_ptr, t0, n, h * P, SDY, P, BC, BP)
            dM = _mm(dy, tl.trans(x), PREC)
            acc += dM * _decay(gam, gam) * d[None, :]
        # above the diagonal and on rows past C (zero tiles) the sum is finite and not wanted
        _put(dcb_desc, ch, tl.where((rows[None, :] <= rows[:, None]) & (rows[:, None] < C), acc, 0.0), BC, BC)

    @triton.jit
    def _dbc_kernel(x_ptr, b_ptr, c_ptr, dy_ptr, d_ptr, cu_ptr, gam_ptr, dcb_desc, s_desc, dl_desc, db_ptr, dc_ptr,
                    C, NCH, HEADS, G, R, SX, SB, SC, SDY, P: tl.constexpr, N: tl.constexpr, BC: tl.constexpr,
                    BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
        """One program per (chunk, group, BN columns of N): the group's dB and dC, each head's
        parts summed in head order in registers and written once to the tokens' rows:
        dC = dCB B + sum_h (dy_h e^gamma_h) S_h,   dB = dCB^T C + sum_h (x_h w_h) dS_h,
        with w = e^(gamma_L - gamma) d and dS_h the gradient of the chunk's end state."""
        ch = tl.program_id(0)
        n0 = tl.program_id(1) * BN
        t0, n, g = _chunk_of(ch, cu_ptr, NCH, G, C)
        c = ch % NCH
        s = ch // NCH // G
        rows = tl.arange(0, BC)
        dcb = _tile(dcb_desc, ch, BC, BC)
        dC = _mm(dcb, _block_in(b_ptr, t0, n, g * N, SB, n0, N, BC, BN), PREC)
        dB = _mm(tl.trans(dcb), _block_in(c_ptr, t0, n, g * N, SC, n0, N, BC, BN), PREC)
        for r in range(R):
            h = g * R + r
            hc = (s * HEADS + h) * NCH + c
            d = tl.load(d_ptr + (t0 + rows).to(tl.int64) * HEADS + h, mask=rows < n, other=0.0)
            gam = tl.load(gam_ptr + hc.to(tl.int64) * C + rows, mask=rows < C, other=0.0)
            gl = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
            dyo = _rows_in(dy_ptr, t0, n, h * P, SDY, P, BC, BP) * tl.exp(gam)[:, None]
            dC += _mm(dyo, tl.reshape(s_desc.load([hc, 0, n0]), (BP, BN)), PREC)
            xw = _rows_in(x_ptr, t0, n, h * P, SX, P, BC, BP) * (tl.exp(gl - gam) * d)[:, None]
            dB += _mm(xw, tl.reshape(dl_desc.load([hc, 0, n0]), (BP, BN)), PREC)
        _block_out(db_ptr, dB, t0, n, g * N, G * N, n0, N, BC, BN)
        _block_out(dc_ptr, dC, t0, n, g * N, G * N, n0, N, BC, BN)

    @triton.jit
    def _dx_kernel(x_ptr, b_ptr, c_ptr, dy_ptr, d_ptr, cu_ptr, a_ptr, dskip_ptr, gam_ptr, s_desc, dl_desc,
                   dx_ptr, dd_ptr, da_ptr, dskip_out_ptr, C, NCH, HEADS, G, R, SX, SB, SC, SDY, P: tl.constexpr,
                   N: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, NS: tl.constexpr,
                   BR: tl.constexpr, PREC: tl.constexpr):
        """One program per (chunk, head): everything but dB and dC. Through y_diag = M x with
        M = (C B^T) * decay * d_j, D x, y_off = (C S^T) e^gamma, local = (x w)^T B and
        e = e^gamma_L: dx, d d (through gamma = cumsum(d A) too), the chunk's parts of dA and
        dD. The chunk's [C, C] matrices are taken BR rows i at a time (two [C, C] float32
        tiles whole would not fit the registers beside the rest); C B^T takes B and C in NS
        column slices of BN (shared memory at 3xTF32)."""
        ch = tl.program_id(0)
        t0, n, h = _chunk_of(ch, cu_ptr, NCH, HEADS, C)
        A = tl.load(a_ptr + h)
        rows = tl.arange(0, BC)
        rm = rows < C
        d = tl.load(d_ptr + (t0 + rows).to(tl.int64) * HEADS + h, mask=rows < n, other=0.0)
        gam = tl.load(gam_ptr + ch.to(tl.int64) * C + rows, mask=rm, other=0.0)
        gl = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
        ew = tl.exp(gl - gam)
        w = ew * d
        x = _opnd(x_ptr, t0, n, h * P, SX, P, BC, BP, PREC)
        dy = _opnd(dy_ptr, t0, n, h * P, SDY, P, BC, BP, PREC)
        tl.store(dskip_out_ptr + ch, tl.sum(tl.sum(dy.to(tl.float32) * x.to(tl.float32), 1), 0))
        gcol = (h // R) * N
        # the states' side: local = (x w)^T B, y_off = (C S^T) e^gamma
        dl = _tile(dl_desc, ch, BP, BN * NS)
        dxw = _mm(_opnd(b_ptr, t0, n, gcol, SB, N, BC, BN * NS, PREC), tl.trans(dl), PREC)
        dx = dxw * w[:, None] + tl.load(dskip_ptr + h) * dy
        dw = tl.sum(dxw * x, 1)
        S = _tile(s_desc, ch, BP, BN * NS)
        de = tl.sum(tl.sum(S * dl, 1), 0)                  # e = e^gamma_L: <S_c, dS_(c+1)>
        dgam = tl.sum(dy * tl.exp(gam)[:, None] * _mm(_opnd(c_ptr, t0, n, gcol, SC, N, BC, BN * NS, PREC),
                                                      tl.trans(S), PREC), 1) - dw * w
        dgam += tl.where(rows == C - 1, tl.sum(dw * w, 0) + de * tl.exp(gl), 0.0)
        dd = dw * ew
        # the chunk's own rows: y_diag = M x, M = (C B^T) * decay * d_j, by row blocks ri
        for blk in tl.static_range(BC // BR):
            ri = blk * BR + tl.arange(0, BR)
            gi = tl.load(gam_ptr + ch.to(tl.int64) * C + ri, mask=ri < C, other=0.0)
            dyi = _opnd(dy_ptr, t0 + blk * BR, n - blk * BR, h * P, SDY, P, BR, BP, PREC)
            cb = tl.zeros((BR, BC), dtype=tl.float32)
            for sl in tl.static_range(NS):
                Ci = _opnd(c_ptr, t0 + blk * BR, n - blk * BR, gcol + sl * BN, SC, N - sl * BN, BR, BN, PREC)
                Bs = _opnd(b_ptr, t0, n, gcol + sl * BN, SB, N - sl * BN, BC, BN, PREC)
                cb += _mm(Ci, tl.trans(Bs), PREC)
            # exp(gamma_i - gamma_j) for j <= i; rows past C (zero tiles) stay out (their gamma loads as 0)
            cbd = tl.where((rows[None, :] <= ri[:, None]) & (ri[:, None] < C),
                           cb * _decay(gi, gam), 0.0)
            dx += _mm(tl.trans(cbd * d[None, :]), dyi, PREC)
            dMc = _mm(dyi, tl.trans(x), PREC) * cbd
            Q = dMc * d[None, :]
            dd += tl.sum(dMc, 0)
            # d gamma_i: Q's row sums (rows ri) minus its column sums (every row j)
            dgam += tl.sum(tl.where(ri[:, None] == rows[None, :], tl.sum(Q, 1)[:, None], 0.0), 0) - tl.sum(Q, 0)
        _rows_out(dx_ptr, dx, t0, n, h * P, HEADS * P, P, BC, BP)
        rc = tl.cumsum(dgam, 0, reverse=True)
        tl.store(dd_ptr + (t0 + rows).to(tl.int64) * HEADS + h, dd + rc * A, mask=rows < n)
        tl.store(da_ptr + ch, tl.sum(rc * d, 0))


def _launch(prec: str, kernel: str) -> dict:
    warps, stages = LAUNCH.get(prec, LAUNCH["tf32x3"])[kernel]
    return dict(num_warps=warps, num_stages=stages)


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
    seqs.require_covers(T)
    if T == 0 or not seqs.lens:
        return tuple(torch.zeros_like(t) for t in (x, dt, dt_bias, A_log, B, C, D))
    if not fused_backward_ok(x, B):
        raise ValueError(f"the fused Mamba-2 backward needs P and N multiples of 4, got {P}, {N}")
    if Cs > MAX_CHUNK:
        raise ValueError(f"the fused Mamba-2 backward takes chunks of at most {MAX_CHUNK} rows, got {Cs}")
    nC, S = seqs.num_chunks, len(seqs.lens)
    pre = dt.float() + dt_bias.float()
    sp = F.softplus(pre)
    dtv = aligned16(torch.clamp(sp, min=dt_min))
    A = -torch.exp(A_log.float())
    # x, B, C, dy and d stay in the caller's [T, heads, ...] layout at its row stride (views of
    # the projection: the kernels read a chunk's rows in place, zeros past its sequence's end);
    # what passes between the kernels is float32 by chunk, [S, H, nC, ...]
    x, B, C, dy = (rows_aligned16(t) for t in (x, B, C, dy))
    cu = torch.tensor(seqs.cu, dtype=torch.int32, device=x.device)
    BC, BP, BN = max(16, next_pow2(Cs)), max(16, next_pow2(P)), max(16, next_pow2(N))
    n = S * H * nC
    f32 = dict(dtype=torch.float32, device=x.device)
    gam = torch.empty((S, H, nC, Cs), **f32)
    e = torch.empty((S, H, nC), **f32)
    local = torch.empty((S, H, nC, P, N), **f32)
    ds = torch.empty_like(local)
    prec = training_tiles.dot_precision(x)
    dims = dict(P=P, N=N, BC=BC, BP=BP, BN=BN, PREC=prec)
    heads = (nC, H, G, R, x.stride(0), B.stride(0), C.stride(0), dy.stride(0))
    pn = (BP, BN)
    a = aligned16(A)
    _prep_kernel[(n,)](x, B, C, dy, dtv, cu, a, gam, e, _desc(local, pn), _desc(ds, pn), Cs, *heads, **dims,
                       **_launch(prec, "prep"), enable_fp_fusion=True)
    states, dl = torch.empty_like(local), torch.empty_like(local)
    _recurrence_kernel[(S * H,)](_desc(local, pn), e, _desc(ds, pn), _desc(states, pn), _desc(dl, pn), nC,
                                 BP=BP, BN=BN, **_launch(prec, "recurrence"), enable_fp_fusion=True)
    # dB, dC: the group's sum over its heads inside the kernels (dCB, then the states' side),
    # written once per group; everything else per (chunk, head)
    ng = S * G * nC
    # BC columns: a descriptor's rows must be 16-byte multiples, whatever the chunk size
    dcb = torch.empty((S, G, nC, Cs, BC), **f32)
    _dcb_kernel[(ng,)](x, dy, dtv, cu, gam, _desc(dcb, (BC, BC)), Cs, *heads, P=P, BC=BC, BP=BP,
                       PREC=prec, **_launch(prec, "dcb"), enable_fp_fusion=True)
    dB, dC = B.new_empty(B.shape), C.new_empty(C.shape)
    bn = min(BN, GROUP_BLOCK_N)
    _dbc_kernel[(ng, -(-N // bn))](x, B, C, dy, dtv, cu, gam, _desc(dcb, (BC, BC)), _desc(states, (BP, bn)),
                                   _desc(dl, (BP, bn)), dB, dC, Cs, *heads, **{**dims, "BN": bn},
                                   **_launch(prec, "dbc"), enable_fp_fusion=True)
    dx = x.new_empty(x.shape)
    dd = torch.empty((T, H), **f32)
    dA_part, dD_part = torch.empty_like(e), torch.empty_like(e)
    ns = max(1, BN // SLICE_N)
    _dx_kernel[(n,)](x, B, C, dy, dtv, cu, a, aligned16(D.float()), gam, _desc(states, pn), _desc(dl, pn), dx, dd,
                     dA_part, dD_part, Cs, *heads, **{**dims, "BN": BN // ns}, NS=ns,
                     BR=min(BC, max(16, ROW_BLOCK)), **_launch(prec, "dx"), enable_fp_fusion=True)
    # d = clamp(softplus(dt + dt_bias), dt_min): the gradient passes where softplus >= dt_min
    dpre = dd * (sp >= dt_min) * torch.sigmoid(pre)
    dA = dA_part.sum((0, 2))
    return (dx, dpre.to(dt.dtype), dpre.sum(0).to(dt_bias.dtype), (dA * A).to(A_log.dtype), dB, dC,
            dD_part.sum((0, 2)).to(D.dtype))
