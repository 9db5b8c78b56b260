"""Gated DeltaNet's training backward as fused per-chunk Triton kernels around the chunk
recurrence (chunk_recurrence.py): the gradients of `gdn_reference` (gdn_chunk.py) without
its autograd graph of batched torch ops.

Per chunk of C rows (every sequence from position 0 with a zero state; all math float32),
with gamma = cumsum(g), D_ij = exp(gamma_i - gamma_j), the forward is

    A = strict_lower(beta_i (k k^T)_ij D_ij),  T = (I + A)^-1,
    w = T (k * beta e^gamma),  u = T (v * beta),  kd = k * e^(gamma_L - gamma),  e = e^gamma_L,
    (S_c, v_new) = the recurrence over chunks of (u, w, kd, e),
    o = scale (q e^gamma S_c + incl_lower(q k^T * D) v_new)

and the backward runs five launches with bf16 dots, six with 3xTF32 (and one more, the
group sums, where Hv > Hk):
  1. prep (per chunk x value head): gamma, T (by block rows, as the forward, or the
     forward's saved T), w, u, kd, e;
  2. the recurrence forward (S_c, v_new);
  3. (3xTF32 only) output grads (per chunk x value head): dS_c = (q e^gamma)^T do, dv_new =
     P^T do; with bf16 dots the walk takes them itself (OUTPUT_GRADS_IN_WALK);
  4. the recurrence backward's walk (per sequence x value head x V tile: du = dv_new and the
     gradient dS reaching each chunk's end state);
  5. final, in two launches per (chunk x value head) that each fit shared memory: the
     state's, the output's and the decays' side (dw = -du S^T, dkd = v_new dS^T, de =
     <S, dS>, dq, part of dk and d gamma: each state-shaped tile read once), then the w / u
     side (dv, dbeta, the rest of dk, dg as the reverse cumsum of d gamma, through w = T X
     and dA = -T^T dT T^T).
The kernels read q, k, v, g, beta and do where the caller keeps them ([T, heads, ...], its
dtype; a chunk's rows past its sequence's end load as zeros, a key head serves the G value
heads of its group in place) and write dv, dg, dbeta there; what passes from kernel to kernel
is by chunk ([B, Hv, nC, C, ...]), float32 or, with bf16 dots, mostly bfloat16 (below). Key-head gradients are the sums over the value
heads of the group, taken after (one pass, `_group_sum_kernel`).

Dots (training_tiles.mm) take bf16 operands with float32 accumulation on the GPU for
bfloat16 inputs, 3xTF32 for float32 ones, "ieee" under the interpreter. This is a backward,
checked against float64 autograd of `gdn_reference` (tests/test_gdn_backward.py), not a
parity path.
"""
from __future__ import annotations

import torch

from vllm.kernels import chunk_recurrence
from vllm.kernels.chunk_recurrence import recurrence_backward_walk_triton, recurrence_forward_triton
from vllm.kernels.chunk_scan import PaddedChunks, require_triton
from vllm.kernels.chunk_tiles import HAS_TRITON, aligned16, next_pow2
from vllm.kernels import training_tiles
from vllm.kernels.training_tiles import matrix_desc as _desc, rows_aligned

# warps of the per-chunk kernels by dot precision: bf16 operands need fewer registers than
# 3xTF32's. H200, Qwen3-Next dims, 1 x 10,240, bf16 (`benchmarks/kernels/backward_sweep.py
# gdn`; runs vary by about 100 us): all four at 8 warps 5,202 us, at 4 4,499 / 4,742; then one
# kernel at a time: prep at 2 warps 4,550, the final w/u kernel at 8 4,482, the final output
# kernel at 2 12,425 and the w/u one 11,143.
# The prep with the forward's T saved ("prep_t_saved": no T to build, two dots) is its own entry.
# Register caps do not help (H100, T saved, 3,168 us uncapped; each kernel capped alone at 96 /
# 128 / 168 registers: prep 3,718 / 3,479 / 3,279, output gradients 3,601 / 3,510 / 3,325,
# final output 9,257 / 3,731 / 3,457, final w/u 4,055 / 3,926 / 3,349).
WARPS = {"bf16": {"prep": 2, "prep_t_saved": 2, "out_grad": 4, "final_out": 8, "final_wu": 8},
         "tf32x3": {"prep": 8, "prep_t_saved": 8, "out_grad": 8, "final_out": 8, "final_wu": 8}}
# The recurrence's backward walk (V tile, warps, stages), and whether it takes the gradients
# reaching the recurrence's outputs itself (OUTPUT_GRADS_IN_WALK), as fla's state walk does:
# per V tile from q, k, do and gamma, g_S = q^T (e^gamma scale do) and g_vn = P^T (scale do)
# (P recomputed per V tile), so the output-gradient kernel does not run and the [chunks, K,
# V] and [chunks, C, V] gradients per value head (335 + 168 MB at 1 x 10,240) are neither
# written nor read, and g_S is never rounded to bfloat16. H100, 1 x 10,240, bf16, T saved:
# backward 2,700 -> 2,601-2,619 us (walk 510 -> 629 us, the output-gradient kernel's 200
# gone), float64 distances 3.78e-3 / 3.80e-3 / 3.35e-3 / 3.03e-3 / 2.92e-3 (q k v g beta) ->
# 3.78e-3 / 3.78e-3 / 3.33e-3 / 3.01e-3 / 2.90e-3. Only g_S in the walk (g_vn from the
# output-gradient kernel, in bfloat16) gave 2,619-2,639. With 3xTF32 dots (float32 models) the
# walk spills (1,680 B of stack at 8 warps): 12,497 us against 10,406 with the
# output-gradient kernel, which keeps that form there.
# H100, the walk's own time (`backward_sweep.py gdn_walk`): 32/4/2 639 us, 32/4/3 631, 32/8/2
# 772, 64/4/2 712, 64/8/2 855, 16/4/2 637, 16/4/3 634 (its loads are async copies at 2 stages
# already; its time is the serial chain of dots per chunk)
WALK_CONFIG = {"bf16": (32, 4, 2), "tf32x3": (32, 8, 2)}
OUTPUT_GRADS_IN_WALK = {"bf16": True, "tf32x3": False}
# the column block of the final w / u kernel's loops over K and V
FINAL_WU_BLOCK = {"bf16": 64, "tf32x3": 64}
# the V block of the final output kernel's loop over the state, v_new and do
FINAL_OUT_V_BLOCK = {"bf16": 32, "tf32x3": 32}
# the prep's column block for w, u and kd (capped at the K and V tiles): the same bits at any
# width, fewer registers at a narrower one
PREP_COLUMNS = {"bf16": {"prep": 128, "prep_t_saved": 128}, "tf32x3": {"prep": 128, "prep_t_saved": 128}}
# With bf16 dots, what passes between the kernels goes in bfloat16, as fla's backward passes
# it: w, kd, T, v_new, du and dw (every use a dot operand, which the dots round to bfloat16
# anyway: the same gradients from half the bytes); u, as the forward's prep passes it to its
# state kernel (v_new = u - w S then rounds as the forward's does); and the state-shaped tensors (the per-chunk states, their
# gradients from the outputs, the gradients reaching each chunk's end: 3 x 335 MB of float32 at
# 1 x 10,240, Qwen3-Next's dims). Those are not the same bits: de = <S, dS> and the walk's
# dS + g_S take them elementwise, so the gradients move within bf16 rounding (float64 distance
# 4.0e-3 either way). H200, 1 x 10,240 fwd + bwd: 4,844 us against 5,148 with float32 between
# the kernels; the operands alone in bfloat16 were slower (5,258). With the walk taking the
# outputs' gradients itself (OUTPUT_GRADS_IN_WALK) the states' g_S stays float32.
# The per-value-head gradients of q and k (summed over a key head's group after) and the output
# side's part of dk (the w / u kernel adds its own) pass in the between-kernels dtype (bfloat16
# with bf16 dots, as fla passes them). H100, 1 x 10,240, T saved, against float32: group sums 139
# -> 82 us, final output kernel 590 -> 559, final w / u 644 -> 624 (`backward_sweep.py
# gdn_walk` as it was); dq and dk move by 4.8e-3 / 4.7e-3 of their largest element (one more
# bfloat16 rounding of each head's part), the other gradients not at all. Float64 distance
# (||a - b|| / ||b||, interpreter, 2 / 4 heads of 128, 320 tokens, bf16): dq 3.79e-3 -> 4.17e-3,
# dk 3.82e-3 -> 4.54e-3 (4.22e-3 with the output side's dk part alone kept in float32).
# Measured not to help: the w / u kernel per (chunk, key head), summing its group's dk in
# registers (no per-head dk, group sums for dq only): 255 registers with 232 B of spills at 8
# warps, 809 us against 625 (group sums 82 -> 40): 140 us slower in all.
# the largest chunk whose kernels fit sm_90's shared memory (227 KB a block; the final
# kernels take C = 64 (Qwen3-Next): 196 KB of it)
MAX_CHUNK = 64

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm.kernels.chunk_tiles import unit_lower_block_row as _unit_lower_block_row
    from vllm.kernels.training_tiles import chunk_of as _chunk_of, load_rows as _rows_in, load_tile as _tile, mm as _mm
    from vllm.kernels.training_tiles import load_operand as _rows_operand, operand as _operand
    from vllm.kernels.training_tiles import load_block as _block_in, store_block as _block_out, store_rows as _rows_out, store_tile as _put, to_dtype_rn as _to_dtype_rn

    @triton.jit
    def _load_rows(ptr, t0, n, head, HS, X: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr):
        """Tokens t0 .. t0 + n - 1 of one head of a [T, HS, X] tensor as a float32 [BC, BX] tile."""
        return _rows_in(ptr, t0, n, head * X, HS * X, X, BC, BX)

    @triton.jit
    def _load_block(ptr, t0, n, head, HS, x0, X: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr):
        """_load_rows' columns x0 .. x0 + BX - 1 (zeros past X)."""
        return _block_in(ptr, t0, n, head * X, HS * X, x0, X, BC, BX)

    @triton.jit
    def _store_block(ptr, x, t0, n, head, HS, x0, X: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr):
        _block_out(ptr, x, t0, n, head * X, HS * X, x0, X, BC, BX)

    @triton.jit
    def _store_rows(ptr, x, t0, n, head, HS, X: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr):
        _rows_out(ptr, x, t0, n, head * X, HS * X, X, BC, BX)

    @triton.jit
    def _saved_t(ts_ptr, tch_ptr, ch, h, NC, HV, C, ii, jj):
        """Chunk c of sequence s's T from the forward's (chunk tch[s] + c of ts, ch = (s NC + c)
        HV + h) as float32; a chunk past its sequence's end (no rows: A = 0) has T = I."""
        s = ch // NC // HV
        c = ch % NC
        c0 = tl.load(tch_ptr + s)
        has = c < tl.load(tch_ptr + s + 1) - c0
        fwd_ch = ((c0 + c) * HV + h).to(tl.int64)
        T = tl.load(ts_ptr + (fwd_ch * C + ii) * C + jj, mask=has & (ii < C) & (jj < C), other=0.0).to(tl.float32)
        return tl.where(has & (ii < C), T, tl.where(ii == jj, 1.0, 0.0))

    @triton.jit
    def _prep_kernel(k_ptr, v_ptr, g_ptr, b_ptr, cu_ptr, w_desc, u_desc, kd_desc, e_ptr, t_ptr, gam_ptr,
                     ts_ptr, tch_ptr, C, NC, HV, HK, G, K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, BX: tl.constexpr, PREC: tl.constexpr,
                     EMULATE: tl.constexpr, T_SAVED: tl.constexpr):
        """One program per (chunk, value head): gamma, T = (I + A)^-1 (by block rows, as the
        forward: chunk_tiles.unit_lower_block_row; or, T_SAVED, the forward's own T, chunk
        tch[s] + c of ts for chunk c of sequence s), w, u, kd and e. A T built here goes out
        whole for the final kernel (a saved one it reads where the forward left it). w, u and
        kd go BX columns at a time: their dots contract over the chunk's rows, not the
        columns, so a column block is the same bits as the whole tile, in fewer registers."""
        ch = tl.program_id(0)
        t0, n, h = _chunk_of(ch, cu_ptr, NC, HV, C)
        rows = tl.arange(0, BC)
        rm = rows < C
        g = tl.load(g_ptr + (t0 + rows).to(tl.int64) * HV + h, mask=rows < n, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + (t0 + rows).to(tl.int64) * HV + h, mask=rows < n, other=0.0).to(tl.float32)
        gam = tl.cumsum(g, 0)
        tl.store(gam_ptr + ch.to(tl.int64) * C + rows, gam, mask=rm)
        ii = rows[:, None]
        jj = rows[None, :]
        if T_SAVED:
            T = _saved_t(ts_ptr, tch_ptr, ch, h, NC, HV, C, ii, jj)
        else:
            k = _load_rows(k_ptr, t0, n, h // G, HK, K, BC, BK)
            lower = (jj < ii) & (ii < C)
            kk = _mm(k, tl.trans(k), PREC)
            A = tl.where(lower, b[:, None] * kk * tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.0)), 0.0)
            # T block row by block row, as the forward builds it; rows past C (zero rows of A) are e_i
            NB: tl.constexpr = BC // 16
            tiles = tl.arange(0, NB)[:, None, None]
            T3 = tl.reshape(tl.where(ii == jj, 1.0, 0.0), (NB, 16, BC))
            for bi in tl.static_range(NB):
                Ab = tl.sum(tl.where(tiles == bi, tl.reshape(A, (NB, 16, BC)), 0.0), 0)
                Tb = _unit_lower_block_row(Ab, tl.reshape(tl.where(tiles < bi, T3, 0.0), (BC, BC)), bi, 16,
                                           EMULATE)
                T3 = tl.where(tiles == bi, Tb[None, :, :], T3)
            T = tl.reshape(T3, (BC, BC))
            tl.store(t_ptr + ch.to(tl.int64) * C * C + ii * C + jj, _to_dtype_rn(T, t_ptr.dtype.element_ty),
                     mask=(ii < C) & (jj < C))
        gl = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
        be = b * tl.exp(gam)
        dec = tl.exp(gl - gam)
        for x0 in tl.static_range(0, K, BX):  # blocks from 0 while x0 < K (none wholly past it)
            kx = _load_block(k_ptr, t0, n, h // G, HK, x0, K, BC, BX)
            w_desc.store([ch, 0, x0], tl.reshape(_to_dtype_rn(_mm(T, kx * be[:, None], PREC), w_desc.dtype),
                                                 (1, BC, BX)))
            kd_desc.store([ch, 0, x0], tl.reshape(_to_dtype_rn(kx * dec[:, None], kd_desc.dtype), (1, BC, BX)))
        for x0 in tl.static_range(0, V, BX):
            vx = _load_block(v_ptr, t0, n, h, HV, x0, V, BC, BX)
            u_desc.store([ch, 0, x0], tl.reshape(_to_dtype_rn(_mm(T, vx * b[:, None], PREC), u_desc.dtype),
                                                 (1, BC, BX)))
        tl.store(e_ptr + ch, tl.exp(gl))

    @triton.jit
    def _out_grad_kernel(q_ptr, k_ptr, do_ptr, cu_ptr, gam_ptr, ds_desc, dvn_desc, scale, C, NC, HV, HK, G,
                         K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         PREC: tl.constexpr):
        """One program per (chunk, value head), where the walk does not take them itself: the
        gradients reaching the recurrence's outputs, dS_c = (q e^gamma)^T (scale do) and
        dv_new = P^T (scale do)."""
        ch = tl.program_id(0)
        t0, n, h = _chunk_of(ch, cu_ptr, NC, HV, C)
        rows = tl.arange(0, BC)
        gam = tl.load(gam_ptr + ch.to(tl.int64) * C + rows, mask=rows < C, other=0.0)
        q = _load_rows(q_ptr, t0, n, h // G, HK, K, BC, BK)
        k = _load_rows(k_ptr, t0, n, h // G, HK, K, BC, BK)
        do = _load_rows(do_ptr, t0, n, h, HV, V, BC, BV) * scale
        # rows past C (zero tiles) stay out: their exp(gamma_i - gamma_j) read gamma_i = 0 and overflow
        incl = (rows[None, :] <= rows[:, None]) & (rows[:, None] < C)
        P = tl.where(incl, _mm(q, tl.trans(k), PREC)
                     * tl.exp(tl.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
        _put(dvn_desc, ch, _mm(tl.trans(P), do, PREC), BC, BV)
        qd = q * tl.exp(gam)[:, None]
        _put(ds_desc, ch, _mm(tl.trans(qd), do, PREC), BK, BV)

    @triton.jit
    def _walk_kernel(q_ptr, k_ptr, do_ptr, cu_ptr, gam_ptr, w_desc, kd_desc, e_ptr, du_desc, ds_desc, scale, C, NC,
                     HV, HK, G, K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, PREC: tl.constexpr):
        """Program (sequence x value head, V tile), the recurrence's backward walk with the
        gradients reaching the outputs taken in it: dS = 0; per chunk from the last: store dS
        (the gradient reaching the chunk's end state); from q, k, do and gamma, g_vn = P^T
        (scale do) and g_S = q^T (e^gamma scale do), the gradients reaching v_new and S_c from
        o = scale (q e^gamma S_c + P v_new); dv_new = g_vn + kd dS (= du); then dS of the
        chunk before, g_S + dS e - w^T dv_new (chunk_recurrence's walk, which reads g_vn and
        g_S as an output-gradient kernel wrote them)."""
        bh = tl.program_id(0)
        v0 = tl.program_id(1) * BV
        rows = tl.arange(0, BC)
        incl = (rows[None, :] <= rows[:, None]) & (rows[:, None] < C)
        dS = tl.zeros((BK, BV), dtype=tl.float32)
        for i in range(NC):
            ch = bh * NC + (NC - 1 - i)
            ds_desc.store([ch, 0, v0], tl.reshape(_to_dtype_rn(dS, ds_desc.dtype), (1, BK, BV)))
            t0, n, h = _chunk_of(ch, cu_ptr, NC, HV, C)
            gam = tl.load(gam_ptr + ch.to(tl.int64) * C + rows, mask=rows < C, other=0.0)
            q = _rows_operand(q_ptr, t0, n, (h // G) * K, HK * K, K, BC, BK, PREC)
            k = _rows_operand(k_ptr, t0, n, (h // G) * K, HK * K, K, BC, BK, PREC)
            do = _load_block(do_ptr, t0, n, h, HV, v0, V, BC, BV) * scale
            # rows past C (zero tiles) stay out: their exp(gamma_i - gamma_j) read gamma_i = 0
            P = tl.where(incl, _mm(q, tl.trans(k), PREC)
                         * tl.exp(tl.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
            kd = tl.reshape(kd_desc.load([ch, 0, 0]), (BC, BK))
            dvn = _mm(tl.trans(P), do, PREC) + _mm(kd, dS, PREC)
            du_desc.store([ch, 0, v0], tl.reshape(_to_dtype_rn(dvn, du_desc.dtype), (1, BC, BV)))
            w = tl.reshape(w_desc.load([ch, 0, 0]), (BC, BK))
            e = tl.load(e_ptr + ch)
            dS = _mm(tl.trans(q), do * tl.exp(gam)[:, None], PREC) + dS * e - _mm(tl.trans(w), dvn, PREC)

    @triton.jit
    def _final_out_kernel(q_ptr, k_ptr, do_ptr, cu_ptr, gam_ptr, s_desc, ds_desc, vn_desc, du_desc, dw_desc, dq_ptr,
                          dk_desc, dgam_ptr, dgl_ptr, scale, C, NC, HV, HK, G, K: tl.constexpr, V: tl.constexpr,
                          BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVT: tl.constexpr,
                          PREC: tl.constexpr):
        """One program per (chunk, value head), the output's, the state's and the decays' side.
        Over V, BVT columns at a time, from the chunk's state S, the gradient reaching its end
        dS (the recurrence walk's), v_new, dv_new (= du) and do: dw = -du S^T (out whole), dkd
        = v_new dS^T, de = <S, dS>, (do S^T) and do v_new^T; then dq (whole, per value head),
        the parts of dk and d gamma through o = q e^gamma S + P v_new and kd, and d gamma_L.
        Each state-shaped tile is read once for all of them."""
        ch = tl.program_id(0)
        t0, n, h = _chunk_of(ch, cu_ptr, NC, HV, C)
        rows = tl.arange(0, BC)
        rm = rows < C
        # rows past C (zero tiles) stay out: their exp(gamma_i - gamma_j) read gamma_i = 0 and overflow
        incl = (rows[None, :] <= rows[:, None]) & (rows[:, None] < C)
        dqd = tl.zeros((BC, BK), dtype=tl.float32)
        dkd = tl.zeros((BC, BK), dtype=tl.float32)
        dw = tl.zeros((BC, BK), dtype=tl.float32)
        dP = tl.zeros((BC, BC), dtype=tl.float32)
        de = tl.zeros((BK,), dtype=tl.float32)
        for v0 in range(0, V, BVT):  # blocks while v0 < V: none wholly past V (do has no mask there)
            S = tl.reshape(s_desc.load([ch, 0, v0]), (BK, BVT))
            dS = tl.reshape(ds_desc.load([ch, 0, v0]), (BK, BVT))
            vn = tl.reshape(vn_desc.load([ch, 0, v0]), (BC, BVT))
            do = _load_block(do_ptr, t0, n, h, HV, v0, V, BC, BVT) * scale
            dqd += _mm(do, tl.trans(S), PREC)
            dP += _mm(do, tl.trans(vn), PREC)
            dkd += _mm(vn, tl.trans(dS), PREC)
            dw -= _mm(tl.reshape(du_desc.load([ch, 0, v0]), (BC, BVT)), tl.trans(S), PREC)
            # float32 products (widening bfloat16 states and gradients is exact)
            de += tl.sum(S.to(tl.float32) * dS.to(tl.float32), 1)
        _put(dw_desc, ch, dw, BC, BK)
        gam = tl.load(gam_ptr + ch.to(tl.int64) * C + rows, mask=rm, other=0.0)
        q = _load_rows(q_ptr, t0, n, h // G, HK, K, BC, BK)
        eg = tl.exp(gam)
        dq = dqd * eg[:, None]
        dgam = tl.sum(dqd * q, 1) * eg
        k = _load_rows(k_ptr, t0, n, h // G, HK, K, BC, BK)
        D = tl.where(incl, tl.exp(tl.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
        P = _mm(q, tl.trans(k), PREC) * D
        dP = tl.where(incl, dP, 0.0)
        dqk = dP * D
        dq += _mm(dqk, k, PREC)
        _store_rows(dq_ptr, _to_dtype_rn(dq, dq_ptr.dtype.element_ty), t0, n, h, HV, K, BC, BK)
        dk = _mm(tl.trans(dqk), q, PREC)
        MP = dP * P
        dgam += tl.sum(MP, 1) - tl.sum(MP, 0)
        # kd = k e^(gamma_L - gamma), e = e^gamma_L
        gl = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
        dec = tl.exp(gl - gam)
        dk += dkd * dec[:, None]
        t = tl.sum(dkd * k, 1) * dec
        dgam -= t
        tl.store(dgl_ptr + ch, tl.sum(t, 0) + tl.sum(de, 0) * tl.exp(gl))
        _put(dk_desc, ch, dk, BC, BK)
        tl.store(dgam_ptr + ch.to(tl.int64) * C + rows, dgam, mask=rm)

    @triton.jit
    def _final_wu_kernel(k_ptr, v_ptr, b_ptr, cu_ptr, gam_ptr, t_ptr, ts_ptr, tch_ptr, du_desc, dw_desc, dgam_ptr,
                         dgl_ptr, dkp_desc, dk_ptr, dv_ptr, dg_ptr, db_ptr, C, NC, HV, HK, G, K: tl.constexpr,
                         V: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr, PREC: tl.constexpr,
                         T_SAVED: tl.constexpr):
        """One program per (chunk, value head), the w / u side: through w = T X_w, u = T X_u
        and T = (I + A)^-1, dv and dbeta (whole), the rest of dk (added to the output side's,
        dkp) and of d gamma, then dg as its reverse cumsum. K and V go BX columns at a time
        (live: T, dT or dA, and one block of each operand): the u side, then the w side's dT
        alone, then dA, then the w side's dk, dX_w = T^T dw and k k^T (dw and k read twice, the
        second time from L2)."""
        ch = tl.program_id(0)
        t0, n, h = _chunk_of(ch, cu_ptr, NC, HV, C)
        rows = tl.arange(0, BC)
        rm = rows < C
        ii = rows[:, None]
        jj = rows[None, :]
        lower = (jj < ii) & (ii < C)
        b = tl.load(b_ptr + (t0 + rows).to(tl.int64) * HV + h, mask=rows < n, other=0.0).to(tl.float32)
        gam = tl.load(gam_ptr + ch.to(tl.int64) * C + rows, mask=rm, other=0.0)
        if T_SAVED:
            T = _saved_t(ts_ptr, tch_ptr, ch, h, NC, HV, C, ii, jj)
        else:
            T = tl.load(t_ptr + ch.to(tl.int64) * C * C + ii * C + jj, mask=(ii < C) & (jj < C), other=0.0)
        T = _operand(T, PREC)  # a dot operand only
        eg = tl.exp(gam)
        be = b * eg
        # w = T X_w, X_w = k beta e^gamma; u = T X_u, X_u = v beta: dT = du X_u^T + dw X_w^T
        dT = tl.zeros((BC, BC), dtype=tl.float32)
        db = tl.zeros((BC,), dtype=tl.float32)
        for x0 in range(0, V, BX):
            du = tl.reshape(du_desc.load([ch, 0, x0]), (BC, BX))
            v = _load_block(v_ptr, t0, n, h, HV, x0, V, BC, BX)
            dT += _mm(du, tl.trans(v * b[:, None]), PREC)
            dXu = _mm(tl.trans(T), du, PREC)
            _store_block(dv_ptr, dXu * b[:, None], t0, n, h, HV, x0, V, BC, BX)
            db += tl.sum(dXu * v, 1)
        for x0 in range(0, K, BX):
            k = _load_block(k_ptr, t0, n, h // G, HK, x0, K, BC, BX)
            dT += _mm(tl.reshape(dw_desc.load([ch, 0, x0]), (BC, BX)), tl.trans(k * be[:, None]), PREC)
        # T = (I + A)^-1: dA = -T^T dT T^T on the strict lower triangle; A = beta_i (k k^T)_ij D_ij,
        # so dk k^T-wise takes dkk = dA beta_i D_ij, and dbeta, d gamma the sums of dA D (k k^T)
        # (k k^T by K blocks: E below)
        Dl = tl.where(lower, tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.0)), 0.0)
        dAD = tl.where(lower, -_mm(_mm(tl.trans(T), dT, PREC), tl.trans(T), PREC), 0.0) * Dl
        dkk = _operand(dAD * b[:, None], PREC)  # a dot operand only
        kdot = tl.zeros((BC,), dtype=tl.float32)
        e_rows = tl.zeros((BC,), dtype=tl.float32)
        e_cols = tl.zeros((BC,), dtype=tl.float32)
        for x0 in range(0, K, BX):
            k = _load_block(k_ptr, t0, n, h // G, HK, x0, K, BC, BX)
            dXw = _mm(tl.trans(T), tl.reshape(dw_desc.load([ch, 0, x0]), (BC, BX)), PREC)
            kdot += tl.sum(dXw * k, 1)
            E = dAD * _mm(k, tl.trans(k), PREC)
            e_rows += tl.sum(E, 1)
            e_cols += tl.sum(E * b[:, None], 0)
            dk = tl.reshape(dkp_desc.load([ch, 0, x0]), (BC, BX)).to(tl.float32) + dXw * be[:, None]
            dk += _mm(dkk, k, PREC) + _mm(tl.trans(dkk), k, PREC)
            _store_block(dk_ptr, _to_dtype_rn(dk, dk_ptr.dtype.element_ty), t0, n, h, HV, x0, K, BC, BX)
        db += e_rows
        dgam = tl.load(dgam_ptr + ch.to(tl.int64) * C + rows, mask=rm, other=0.0) + e_rows * b - e_cols
        db += kdot * eg
        dgam += kdot * be
        # gamma_L is row C - 1's; gamma = cumsum(g): dg_i = sum_{j >= i} d gamma_j
        dgam += tl.where(rows == C - 1, tl.load(dgl_ptr + ch), 0.0)
        tok = (t0 + rows).to(tl.int64) * HV + h
        tl.store(dg_ptr + tok, tl.cumsum(dgam, 0, reverse=True).to(dg_ptr.dtype.element_ty), mask=rows < n)
        tl.store(db_ptr + tok, db.to(db_ptr.dtype.element_ty), mask=rows < n)


    @triton.jit
    def _group_sum_kernel(x_ptr, out_ptr, n, G: tl.constexpr, K: tl.constexpr, BR: tl.constexpr,
                          BK: tl.constexpr):
        """out [n, K] = the sum over g of x [n, G, K] (float32, g = 0, 1, ... left to right),
        rounded once to out's dtype: a key head's gradient from its group's value heads, in
        one pass (a torch sum and then a cast read and write the float32 sums once more)."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.arange(0, BK)
        m = (r < n)[:, None] & (c < K)[None, :]
        src = x_ptr + r.to(tl.int64)[:, None] * (G * K) + c[None, :]
        acc = tl.load(src, mask=m, other=0.0).to(tl.float32)
        for j in tl.static_range(1, G):
            acc += tl.load(src + j * K, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * K + c[None, :], _to_dtype_rn(acc, out_ptr.dtype.element_ty),
                 mask=m)


def _tuned(table: dict, prec: str):
    """A launch setting of `table` (keyed "bf16" / "tf32x3") for dot precision `prec`; the
    interpreter's precisions take their GPU counterparts', so the tests run the GPU's forms
    ("bf16_emulated" as "bf16", "ieee" as "tf32x3")."""
    return table["bf16" if prec in ("bf16", "bf16_emulated") else "tf32x3"]


def _du_dtype(between: torch.dtype) -> torch.dtype:
    """What the walk writes du (= dv_new) in: the between-kernels dtype (its every use is a dot
    operand, rounded to bfloat16 anyway with bf16 dots)."""
    return between


def _group_sum(x: torch.Tensor, G: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, Hk * G, K] float32 (value heads) -> [T, Hk, K] in dtype, each key head the sum of
    its G value heads."""
    T, Hv, K = x.shape
    out = torch.empty((T, Hv // G, K), dtype=dtype, device=x.device)
    n = T * (Hv // G)
    if n:
        BR = 32
        _group_sum_kernel[(triton.cdiv(n, BR),)](x, out, n, G=G, K=K, BR=BR, BK=next_pow2(K), num_warps=4,
            enable_fp_fusion=True)
    return out


def fused_backward_ok(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Where the fused kernels apply: Triton, and K, V multiples of 4 (16-byte rows)."""
    return HAS_TRITON and rows_aligned(q.shape[-1], v.shape[-1])


def bf16_between_kernels(precision: str, K: int, V: int) -> bool:
    """Whether the backward passes its intermediates in bfloat16: with bf16 dots, at K and V
    whose bfloat16 rows are 16-byte aligned (multiples of 8)."""
    return precision in chunk_recurrence.BF16_PRECISIONS and K % 8 == 0 and V % 8 == 0


def gdn_backward_triton(q, k, v, g, beta, do, cu_seqlens, scale: float, chunk_size: int = 64,
                        t_saved: torch.Tensor | None = None, t_chunks: torch.Tensor | None = None):
    """(dq, dk, dv, dg, dbeta) of o = gdn_reference(q, k, v, g, beta, cu_seqlens, scale,
    chunk_size) against do, in the inputs' dtypes, computed in float32. t_saved, t_chunks: the
    forward's T per chunk (gdn_chunk_triton's t_out, [chunks, Hv, C, C]) and its chunks' first
    index per sequence ([sequences + 1] int32, the forward's chunk plan's seq_chunks), taken
    instead of building T again."""
    require_triton(q)
    T, Hk, K = q.shape
    Hv, V = v.shape[1], v.shape[2]
    G = Hv // Hk
    C = chunk_size
    seqs = PaddedChunks(cu_seqlens, C)
    seqs.require_covers(T)
    if T == 0 or not seqs.lens:
        return tuple(torch.zeros_like(x) for x in (q, k, v, g, beta))
    if not fused_backward_ok(q, v):
        raise ValueError(f"the fused GDN backward needs K and V multiples of 4, got {K}, {V}")
    if C > MAX_CHUNK:
        raise ValueError(f"the fused GDN backward takes chunks of at most {MAX_CHUNK} rows, got {C}")
    nC, B = seqs.num_chunks, len(seqs.lens)
    if (t_saved is None) != (t_chunks is None):
        raise ValueError("t_saved and t_chunks go together")
    if t_saved is not None:
        if t_saved.dim() != 4 or tuple(t_saved.shape[1:]) != (v.shape[1], C, C) or not t_saved.is_contiguous():
            raise ValueError(f"t_saved must be a contiguous [chunks, {v.shape[1]}, {C}, {C}] tensor, "
                             f"got {tuple(t_saved.shape)}")
        if t_chunks.dtype != torch.int32 or tuple(t_chunks.shape) != (B + 1,):
            raise ValueError(f"t_chunks must be [{B + 1}] int32 (a sequence's first chunk in t_saved), "
                             f"got {tuple(t_chunks.shape)} {t_chunks.dtype}")
    # the inputs and the gradients stay in the caller's [T, heads, ...] layout and dtypes (the
    # kernels read a chunk's rows in place, zeros past its sequence's end); what passes
    # between the kernels is by chunk, [B, Hv, nC, C, ...], float32 or with bf16 dots bfloat16
    # (above)
    q, k, v, g, beta, do = (aligned16(x) for x in (q, k, v, g, beta, do))
    cu = torch.tensor(seqs.cu, dtype=torch.int32, device=q.device)
    # tiles of at least 32 columns: at C = 64, 16-column tiles (K = 16) fault with an illegal
    # memory access on the H200 (Triton 3.6); the padding columns are the descriptors' zeros
    BC, BK, BV = max(16, next_pow2(C)), max(32, next_pow2(K)), max(32, next_pow2(V))
    n = B * Hv * nC
    prec = training_tiles.dot_precision(q)
    f32 = dict(dtype=torch.float32, device=q.device)
    # what passes between the kernels (16-byte rows of bfloat16 need K, V multiples of 8)
    between = torch.bfloat16 if bf16_between_kernels(prec, K, V) else torch.float32
    ops = dict(f32, dtype=between)
    w, kd = torch.empty((B, Hv, nC, C, K), **ops), torch.empty((B, Hv, nC, C, K), **ops)
    u = torch.empty((B, Hv, nC, C, V), **ops)
    e = torch.empty((B, Hv, nC), **f32)
    gam = torch.empty((B, Hv, nC, C), **f32)
    saved = t_saved is not None
    tmat = gam if saved else torch.empty((n, C, C), **ops)   # a saved T is read where it is
    dims = dict(K=K, V=V, BC=BC, BK=BK, BV=BV, PREC=prec)
    warps = _tuned(WARPS, prec)
    heads = (nC, Hv, Hk, G)
    ck, cv = (BC, BK), (BC, BV)
    ts, tch = (t_saved, t_chunks) if saved else (gam, cu)
    prep = "prep_t_saved" if saved else "prep"
    BX = min(_tuned(PREP_COLUMNS, prec)[prep], BK, BV)
    _prep_kernel[(n,)](k, v, g, beta, cu, _desc(w, (BC, BX)), _desc(u, (BC, BX)), _desc(kd, (BC, BX)), e, tmat,
                       gam, ts, tch, C, *heads, EMULATE=training_tiles.INTERPRET or not q.is_cuda, T_SAVED=saved,
                       BX=BX, **dims, enable_fp_fusion=True, num_warps=warps[prep])
    states, vn = recurrence_forward_triton(u, w, kd, e, prec, vn_dtype=between, states_dtype=between)
    # du: every use is a dot operand (the final kernels' dw, dT and dX_u)
    if _tuned(OUTPUT_GRADS_IN_WALK, prec):
        du, d_end = torch.empty_like(vn, dtype=_du_dtype(between)), torch.empty_like(states)
        block_v, walk_warps, walk_stages = _tuned(WALK_CONFIG, prec)
        BVW = min(max(32, block_v), BV)
        _walk_kernel[(B * Hv, triton.cdiv(V, BVW))](
            q, k, do, cu, gam, _desc(w, (BC, BK)), _desc(kd, (BC, BK)), e, _desc(du, (BC, BVW)),
            _desc(d_end, (BK, BVW)), scale, C, *heads, K=K, V=V, BC=BC, BK=BK, BV=BVW, PREC=prec,
            enable_fp_fusion=True, num_warps=walk_warps, num_stages=walk_stages)
    else:
        d_states, d_vn = torch.empty_like(states), torch.empty_like(vn, dtype=torch.float32)
        _out_grad_kernel[(n,)](q, k, do, cu, gam, _desc(d_states, (BK, BV)), _desc(d_vn, cv), scale, C, *heads,
                               **dims, enable_fp_fusion=True, num_warps=warps["out_grad"])
        du, d_end = recurrence_backward_walk_triton(w, kd, e, states, d_states, d_vn, prec,
                                                    du_dtype=_du_dtype(between))
    du, d_end = aligned16(du), aligned16(d_end)
    # dq, dk per value head: float32 where the group's G heads are summed after, else the
    # caller's dtype straight from the kernel
    dq = torch.empty((T, Hv, K), dtype=between if G > 1 else q.dtype, device=q.device)
    dk = torch.empty((T, Hv, K), dtype=between if G > 1 else k.dtype, device=q.device)
    dk_out_side = torch.empty_like(w, dtype=between)
    dw = torch.empty_like(w)  # a dot operand only (the w / u kernel's dT and dX_w): between-kernels dtype
    dv, dg, db = torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta)
    dgam, dgl = torch.empty_like(gam), torch.empty_like(e)
    BVT = min(_tuned(FINAL_OUT_V_BLOCK, prec), BV)
    _final_out_kernel[(n,)](q, k, do, cu, gam, _desc(states, (BK, BVT)), _desc(d_end, (BK, BVT)),
                            _desc(vn, (BC, BVT)), _desc(du, (BC, BVT)), _desc(dw, ck), dq, _desc(dk_out_side, ck),
                            dgam, dgl, scale, C, *heads, BVT=BVT, **dims, enable_fp_fusion=True,
                            num_warps=warps["final_out"])
    BX = min(_tuned(FINAL_WU_BLOCK, prec), BK, BV)
    _final_wu_kernel[(n,)](k, v, beta, cu, gam, tmat, ts, tch, _desc(du, (BC, BX)), _desc(dw, (BC, BX)), dgam, dgl,
                           _desc(dk_out_side, (BC, BX)), dk, dv, dg, db, C, *heads, K=K, V=V, BC=BC, BX=BX, PREC=prec,
                           T_SAVED=saved, enable_fp_fusion=True, num_warps=warps["final_wu"])
    if G > 1:  # key heads: the sum over the value heads of the group
        dq, dk = _group_sum(dq, G, q.dtype), _group_sum(dk, G, k.dtype)
    return dq, dk, dv, dg, db
