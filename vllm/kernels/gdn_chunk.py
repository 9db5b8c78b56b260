"""Chunked gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5 linear attention).

Per value head h (key head h // (Hv // Hk)), with q, k already l2-normalised, the
recurrence over tokens t is

    S = S * exp(g_t);  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = scale * S^T q_t

with an fp32 state S [K, V]. It is computed in chunks of C rows (transformers'
`torch_chunk_gated_delta_rule` without its l2norm / scaling): per chunk with boundary
state h, gamma = cumsum(g), A = strictly-lower beta_i (k_i . k_j) exp(gamma_i - gamma_j),
T = (I + A)^-1, w = T (beta e^gamma k), u = T (beta v), v_new = u - w h,
o_i = scale (e^gamma_i q_i h + sum_{j<=i} (q_i . k_j) e^(gamma_i - gamma_j) v_new_j) and,
after a chunk whose last row is L, h' = e^gamma_L h + k^T (e^(gamma_L - gamma) v_new).

Invariant mode (`aligned=True`) promises that the bits of a token's output and of the
state written do not depend on the batch nor on how the sequence was cut into steps.
How that holds:

* Chunks lie on the sequence's absolute grid of C rows. Every chunk is computed from its
  row 0, row i of the chunk at row i, by the same code, whether it is a prefill chunk,
  the resumed middle of one, or a decode step (a chunk with one new row whose earlier
  rows are re-read from the state's buffer).
* Row i of every per-chunk quantity depends on rows <= i only: gamma is a prefix scan,
  A is strictly lower, T = (I + A)^-1 is built block row by block row from A's rows <= i
  (rows past the chunk's last are zero rows of A, which make rows e_i of T), and products
  with later rows are masked to exact zeros. The zero rows of an incomplete chunk therefore
  cannot move the bits of the rows before them.
* A partial chunk is never folded into the state: the cached state is the boundary
  state of the sequence's current chunk, and the chunk's rows so far are kept in the
  buffer at the dtype they arrived in (k, v in the model dtype, g, beta in fp32), so a
  re-read row equals the row a single prefill held. States are stored in fp32, the
  precision they are carried in.
* The one reduction whose order depends on a register layout, the gamma prefix scan,
  always runs on whole C-row tiles in the prep kernel, on every path. T is built from dots
  and exact copies only (chunk_tiles.unit_lower_block_row_in_place), its block rows of DECODE_ROWS
  rows from the [DECODE_ROWS, C] rows of k k^T. Everything else a row gets from dots that
  keep their K dims, K tiling and operand roundings, and from elementwise math: a tl.dot
  row's bits do not depend on the tile's row count (H200, fp32 accumulator), so a row
  computed in a tile of 16 rows has the bits of the same row in a C-row tile.

Fast mode (`aligned=False`) chunks from each sequence's first new token, keeps no
buffer and folds the partial last chunk into the state (the usual form: a token's bits
depend on where its step began). Same kernels otherwise.

CUDA runs three Triton kernels (and a one-program kernel listing the state kernel's sequences):
  1. prep, one program per (chunk, value head): gamma, A, T (the inverses of its diagonal
     blocks side by side, then its block rows), w, u, the chunk's key tile (the only reader
     of the buffer, except (3)'s decode path, below);
  2. state, per (sequence, value head, V tile): walks the sequence's chunks in order,
     v_new = u - w h and each chunk's boundary state for (3), folds complete chunks
     (fast mode: every chunk) into the fp32 state, writes the cached state where it changed
     (with the decode caches also its copy rounded to the model dtype, "ssm_rounded").
     Only the sequences that need it (not a decode-path chunk, below), listed on the device
     by a one-program kernel before it (no host sync: CUDA graphs replay it), the programs of
     a (V tile, head) striding over the list (STATE_PROGRAMS);
  3. output, per (chunk, value head, V tile): the new rows' outputs, and the new rows of
     an incomplete last chunk into the buffer; two specialisations launched one after the
     other, one for the decode path's chunks (below) and one for the others.
The decode path (aligned, with the decode caches of the state, DECODE_CACHE) takes a chunk
that is its sequence's only chunk in the step and stays partial after it: every decode
step but the one that completes a chunk. Nothing is folded, so the chunk's boundary state
is the cached fp32 state itself: the state kernel skips the sequence, and the output
kernel reads the cached state's model-dtype copy "ssm_rounded" (the state kernel's
`.to(dtype)` of the fp32 state, the rounding its boundary copies take: the same bits, half
the bytes). Its earlier rows' v_new are in the slot (they depend on rows before them and
on the boundary state only, so an earlier step computed them with these bits), so only
the tiles of DECODE_ROWS rows holding the step's rows are computed: w and u in the prep
kernel (their rows of T cut out of T), v_new = u - w h and the outputs in the output
kernel. Gamma stays a whole C-row tile (the layout-bound scan above); T's block rows
that earlier steps of the chunk solved are read back from the T cache, so a step solves
only the block rows holding its new rows (one, for a single token). Every other chunk
takes the whole-chunk path.
Dots take model-dtype operands (T, w, h, v_new rounded to it, as flash-linear-attention
does) with fp32 accumulation; u passes between the kernels in the model dtype (as fla's does). Under the Triton interpreter (tests on CPU) every dot sums
over K by one fixed tree, so that there too a row's bits do not depend on the tile's row
count (chunk_tiles.dot_rows). The CPU runs `gdn_chunk_torch`, the same algorithm in
float32 torch on fixed-shape tiles, T by forward substitution on the whole tile (same
invariances, not the same bits).
`gdn_reference` is the differentiable formula (float32 / float64) that the backward of
`GatedDeltaRuleFn` and the tests use.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from vllm.forward_context import StateMetadata
from vllm.kernels.chunk_recurrence import ChunkRecurrenceFn
from vllm.kernels.gdn_backward import MAX_CHUNK as FUSED_MAX_CHUNK, fused_backward_ok, gdn_backward_triton
from vllm.kernels.chunk_scan import PaddedChunks, check_grid, check_state, dot_mode, host_chunks, launch_state, \
    reference_dtype, reference_grads, require_triton, scan_chunks_torch
from vllm.kernels.chunk_tiles import HAS_TRITON, aligned16 as _aligned16, next_pow2 as _next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm.kernels.chunk_tiles import JIT_OPTIONS as _JIT, chunk_rows as _shared_chunk_rows, \
        dot_rows as _dot, mask2 as _mask2, tile_rows as _tile, \
        row_tile as _row_tile, unit_lower_block_row_in_place as _unit_lower_block_row_in_place, \
        invert_diagonal_blocks_in_place as _invert_diagonal_blocks_in_place

# --------------------------------------------------------------------------
# Tunables. Every one of them is fixed per model (head dims), never per step, so a
# rollout step, any other step and the trainer always run the same compiled kernels.
# BK changes the bits (the K-tiling of the chained k k^T / q k^T dots); the V tiles,
# the decode path's row tile and warps only change speed.
# --------------------------------------------------------------------------
BLOCK_K_MAX = 64        # K tile of the k k^T / q k^T / w dots (prep and output kernels)
PREP_BLOCK_V_MAX = 64   # V tile of u = T (beta v) in the prep kernel
STATE_BLOCK_V_MAX = 32  # V tile of the state walk: one program's (sequence, head, V tile) walk
OUT_BLOCK_V_MAX = 64    # V tile of the output kernel
DECODE_ROWS = 16        # row tile of the decode path (the smallest tensor-core tile)
# The prep kernel can store each chunk's T (as w and u took it, in the model dtype) for the
# training backward, which then skips building its own (T's block rows are most of this
# kernel's time, about 400 of 622 us at prefill 5 x 2,048 on the H200; the backward's prep,
# which builds T the same way, takes 456 us of its 3.7 ms at 1 x 10,240). The store is
# compiled into the one prep kernel every path runs (the engine's steps with it masked off), so
# rollout and trainer still share one kernel. Costs [chunks, Hv, C, C] model-dtype bytes per
# GDN layer between the forward and the backward (42 MB at 1 x 10,240, Qwen3-Next's dims).
# H200, 1 x 10,240 fwd + bwd: 4,886 us against 5,148 without it (benchmarks/NOTES.md).
SAVE_T_FOR_BACKWARD = True
PREP_NUM_WARPS = 4
# 2 programs an SM at the compiler's 241 registers, 4 at 128 (its spills stay in L1): H100, decode
# 256 x 1 545 against 571 us at 168 and 579 at 144, prefill and train forward the same
PREP_MAX_REGISTERS = 128
STATE_NUM_WARPS = 4
# the walk's loads (w, u, the key tile, gamma) run this many chunks ahead: H200, train forward
# 1 x 10,240 758 us against 849 at 2 (119 kB of shared memory: one program an SM)
STATE_NUM_STAGES = 3
# the state kernel's programs, at most: V / BV x Hv x P, the P programs of a (V tile, head) striding
# over the sequences that need the walk (an idle program costs a launch: most decode sequences
# need none). Speed only, like the tiles: every walk is the same code wherever it runs
STATE_PROGRAMS = 1024
# the state kernel's loop over its sequences costs it ~10 registers (sm_90, real dims: 174 against
# 164 without): capped so that three programs still share an SM (the spills are a few words per
# sequence, outside the chunk loop)
STATE_MAX_REGISTERS = 168
WORK_BLOCK = 256        # sequences per iteration of the work-list kernel
OUT_NUM_WARPS = 4
# the whole-chunk output's K loop runs its next K tile's loads this many stages ahead (a loop, its
# q, key-tile and state loads async copies: 164 registers, three programs an SM; unrolled, they
# were synchronous loads at 176). H100 (`gdn_forward_sweep.py`), train forward 1 x 10,240 /
# prefill 5 x 2,048: unrolled 799 / 841 us, 2 stages 768 / 803, 3 stages 763 / 800 (the same
# bits: 0 outputs and states differ on gdn.py's schedules)
OUT_NUM_STAGES = 2
# the output kernel's specialisation for the decode path: one program per (sequence, head), all of
# V (270 us at decode 256 x 1 on the H200, against 338 at V tiles of 64 and 4 warps)
OUT_DECODE_BLOCK_V_MAX = 128
OUT_DECODE_NUM_WARPS = 8


if HAS_TRITON:
    # has_dcache (the decode caches) is 0 or 1 by the state's tensors, not by the step: one
    # compiled kernel for both
    _GDN_JIT = {**_JIT, "do_not_specialize": [*_JIT["do_not_specialize"], "has_dcache"]}
    _SUM = tl.standard._sum_combine

    @triton.jit
    def _chunk_rows(n, h, seq_ptr, start_ptr, first_ptr, end_ptr, tok0_ptr, slots_ptr, has_state,
                    C: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr):
        """Chunk n, value head h with its key head, and where each row of the chunk comes from
        (see ChunkPlan)."""
        hk = h // (HV // HK)
        s, start, end, rows, from_buf, from_step, trow, brow, slot = _shared_chunk_rows(
            n, seq_ptr, start_ptr, first_ptr, end_ptr, tok0_ptr, slots_ptr, has_state, C)
        return n, h, hk, s, start, end, rows, from_buf, from_step, trow, brow, slot

    @triton.jit
    def _decode_path(c0, c1, start, end, has_state, has_decode_cache, C: tl.constexpr, ALIGNED: tl.constexpr):
        """Whether a chunk takes the decode path: the only chunk of its sequence in the step,
        and still partial after it (so nothing is folded into the state: the chunk's boundary
        state is the cached fp32 state, and the rows before the step's first one have their
        v_new in the slot). Only with the decode caches (DECODE_CACHE; aligned mode)."""
        return (has_state != 0) & (has_decode_cache != 0) & (c1 - c0 == 1) & (end - start < C) & ALIGNED

    @triton.jit
    def _seq_decode(s, ok, seqc_ptr, start_ptr, end_ptr, has_state, has_decode_cache, C: tl.constexpr,
                    ALIGNED: tl.constexpr):
        """Sequence s's chunks c0 .. c1 - 1 (where ok), whether it has any, and whether its
        chunk takes the decode path."""
        c0 = tl.load(seqc_ptr + s, mask=ok, other=0)
        c1 = tl.load(seqc_ptr + s + 1, mask=ok, other=0)
        any_chunk = c1 > c0
        decode = _decode_path(c0, c1, tl.load(start_ptr + c0, mask=any_chunk, other=0),
                              tl.load(end_ptr + c0, mask=any_chunk, other=0), has_state, has_decode_cache, C,
                              ALIGNED)
        return c0, c1, any_chunk, decode

    @triton.jit
    def _w_u_rows(Tr, ws_rows, row_ok, k_ptr, bk_ptr, v_ptr, bv_ptr, trow, brow, from_step, from_buf, hk, h,
                  kb_scale, b, w_ws, u_ws, kc_ws, kc_rows, kc_ok,
                  HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
                  VP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KEYS: tl.constexpr,
                  EMULATE: tl.constexpr, PREC: tl.constexpr):
        """Rows ws_rows of w = T (beta e^gamma k) and u = T (beta v) into the workspaces, from
        Tr, those rows of T (model dtype) over all the chunk's C rows: the decode path's DR-row
        tiles and the whole-chunk path's C-row tile run this same code (the same dots, K tiles
        and roundings; a row's bits do not depend on the tile's row count). row_ok: the rows
        stored ([R, 1]; None: all). With KEYS (whole-chunk path) also the chunk's key tile
        (rows kc_rows, where kc_ok). u is stored in the model dtype, as fla keeps it."""
        R: tl.constexpr = Tr.shape[0]
        DT = w_ws.dtype.element_ty
        for k0 in tl.static_range(0, KP, BK):
            kcols = k0 + tl.arange(0, BK)
            kt = _tile(k_ptr + hk * K, HK * K, bk_ptr + hk * K, HK * K, trow, brow, from_step, from_buf,
                       kcols, K, KP)
            ktf = kt.to(tl.float32)
            w = _dot(Tr, (ktf * kb_scale[:, None]).to(DT), tl.zeros([R, BK], dtype=tl.float32), EMULATE, PREC)
            tl.store(w_ws + ws_rows[:, None] * KP + kcols[None, :], w.to(DT), mask=row_ok)
            if KEYS:
                tl.store(kc_ws + kc_rows[:, None] * KP + kcols[None, :], kt, mask=kc_ok)
        for v0 in tl.static_range(0, VP, BV):
            vcols = v0 + tl.arange(0, BV)
            vt = _tile(v_ptr + h * V, HV * V, bv_ptr + h * V, HV * V, trow, brow, from_step, from_buf,
                       vcols, V, VP)
            u = _dot(Tr, (vt.to(tl.float32) * b[:, None]).to(DT), tl.zeros([R, BV], dtype=tl.float32),
                     EMULATE, PREC)
            tl.store(u_ws + ws_rows[:, None] * VP + vcols[None, :], u.to(DT), mask=row_ok)

    @triton.jit
    def _a_rows(ra, b_a, gam_a, gam, k_ptr, bk_ptr, tra, bra, fsa, fba, trow, brow, from_step, from_buf, hk,
                HK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr, EMULATE: tl.constexpr,
                PREC: tl.constexpr, WHOLE: tl.constexpr):
        """Rows ra of A = strict_lower(beta_i (k k^T)_ij e^(gamma_i - gamma_j)) over the chunk's C
        columns, from those rows' beta b_a, gamma gam_a and keys (token rows tra / buffer rows
        bra where fsa / fba), and the chunk's gamma and keys: k k^T over the K tiles, chained in
        increasing order. Any row count: a row's bits do not depend on it. WHOLE: the rows are
        the chunk's own (one key tile load serves both operands)."""
        C: tl.constexpr = gam.shape[0]
        cols = tl.arange(0, C)
        kk = tl.zeros([ra.shape[0], C], dtype=tl.float32)
        for k0 in tl.static_range(0, KP, BK):
            kcols = k0 + tl.arange(0, BK)
            kt = _tile(k_ptr + hk * K, HK * K, bk_ptr + hk * K, HK * K, trow, brow, from_step, from_buf,
                       kcols, K, KP)
            if WHOLE:
                kr = kt
            else:
                kr = _tile(k_ptr + hk * K, HK * K, bk_ptr + hk * K, HK * K, tra, bra, fsa, fba, kcols, K, KP)
            kk = _dot(kr, tl.trans(kt), kk, EMULATE, PREC)
        lower = cols[None, :] < ra[:, None]
        return tl.where(lower, b_a[:, None] * kk * tl.exp(tl.where(lower, gam_a[:, None] - gam[None, :], 0.0)), 0.0)

    # save_t not specialised: the trainer's forward (1) and the engine's steps (0) run one
    # compiled kernel
    @triton.jit(**{**_GDN_JIT, "do_not_specialize": [*_GDN_JIT["do_not_specialize"], "save_t"]})
    def _gdn_prep_kernel(
        k_ptr, v_ptr, g_ptr, beta_ptr,
        bk_ptr, bv_ptr, bg_ptr, bb_ptr, slots_ptr, tc_ptr, tpos_ptr,
        seq_ptr, start_ptr, first_ptr, end_ptr, tok0_ptr, seqc_ptr,
        gam_ws, kc_ws, w_ws, u_ws, t_ws, t_out_ptr,
        has_state, has_dcache, save_t,
        HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
        KP: tl.constexpr, VP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DR: tl.constexpr,
        ALIGNED: tl.constexpr, EMULATE: tl.constexpr, PREC: tl.constexpr, SAVE_T: tl.constexpr,
    ):
        """One program per (chunk, value head): gamma, T = (I + A)^-1 (by block rows of A),
        then w = T (beta e^gamma k) and u = T (beta v) into the workspaces and, off the decode
        path, the chunk's key tile for the state and output kernels. The only kernel that reads the buffer rows of a chunk that is not on the
        decode path: the output kernel rewrites them once this one is done (a step can resume
        a chunk and end in a later partial one, whose rows land on the same buffer rows).

        Every path builds T the same way from the chunk's rows so far (the buffer's and the
        step's), its block rows that earlier steps solved read back from the T cache when it
        holds them (`has_dcache`), so a row of T has the bits a single prefill gives it. On
        the decode path only the step's rows of w and u are computed, from the block rows of T
        the step solves (DR rows each): the same dots, with the K of every dot (the chunk's
        rows) unchanged."""
        # value heads on axis 0: the value heads of a key head run side by side (its key tile)
        n, h, hk, s, start, end, rows, from_buf, from_step, trow, brow, slot = _chunk_rows(
            tl.program_id(1), tl.program_id(0), seq_ptr, start_ptr, first_ptr, end_ptr, tok0_ptr, slots_ptr,
            has_state, C, HV, HK)
        DT = w_ws.dtype.element_ty
        L = end - start - 1  # last valid row of the tile
        base = n.to(tl.int64) * HV + h

        g = tl.where(from_buf, tl.load(bg_ptr + brow * HV + h, mask=from_buf, other=0.0),
                     tl.load(g_ptr + trow * HV + h, mask=from_step, other=0.0))
        b = tl.where(from_buf, tl.load(bb_ptr + brow * HV + h, mask=from_buf, other=0.0),
                     tl.load(beta_ptr + trow * HV + h, mask=from_step, other=0.0))
        gam = tl.associative_scan(g, 0, _SUM)  # prefix sums: row i sees rows <= i only
        tl.store(gam_ws + base * C + rows, gam)

        first = tl.load(first_ptr + n)
        r0 = first - start  # the chunk's first new row; rows before it come from the buffer
        tc_base = (slot * HV + h) * (C * C)
        # the T cache holds rows < r0 of this chunk's T when its stamp (the end position of the
        # step that wrote it) lies in this chunk at or past the first new row
        tpos = tl.load(tpos_ptr + slot * HV + h, mask=(has_dcache != 0) & (r0 > 0), other=-1)
        hit = (has_dcache != 0) & (r0 > 0) & (tpos >= first) & (tpos <= start + C)
        c0 = tl.load(seqc_ptr + s)
        c1 = tl.load(seqc_ptr + s + 1)
        decode = _decode_path(c0, c1, start, end, has_state, has_dcache, C, ALIGNED)
        # the last chunk of a sequence, incomplete (aligned): its rows of T go to the T cache for
        # the chunk's next step. Only when no chunk of this step reads the slot's T (the
        # sequence's first chunk is this one or starts on the grid); otherwise the stamp is
        # cleared and the next step solves the chunk whole (same bits, more work).
        keep = (has_dcache != 0) & (n == c1 - 1) & (end - start < C) & ALIGNED
        free = (c0 == n) | (tl.load(first_ptr + c0) == tl.load(start_ptr + c0))
        eg = tl.exp(gam)
        kb_scale = b * eg

        # T = (I + A)^-1, A = strict_lower(beta_i (k k^T)_ij e^(gamma_i - gamma_j)), block row
        # by block row of DR rows (chunk_tiles.unit_lower_block_row_in_place), each from its rows
        # of A and T's rows before it. On a hit the block rows before the one holding row r0 are
        # the T cache's; the others are computed here, the same way on every path. Rows past L
        # are e_i (zero rows of A).
        tok0 = tl.load(tok0_ptr + n)
        NB: tl.constexpr = C // DR
        bi0 = tl.where(hit, r0 // DR, 0)
        gam2 = tl.reshape(gam, (NB, DR))
        # T's rows in a float32 [C, C] workspace: on the decode path the T cache itself (it holds
        # the block rows before bi0 on a hit and takes the step's), else the (chunk, head)'s
        # workspace, with the T cache's rows copied in on a hit and A's rows from block row bi0
        # on, all in one [C, C] k k^T dot (a dot row's bits do not depend on the tile's row
        # count: the decode path's [DR, C] rows have these bits). Each block row reads A's
        # 16 x 16 blocks and T's earlier block rows back from it (unit_lower_block_row_in_place:
        # a K of the block rows before it, not the whole chunk)
        if decode:
            scr = tc_ptr + tc_base
        else:
            scr = t_ws + base * (C * C)
            cp = (hit & (rows < bi0 * DR))[:, None]
            tl.store(scr + rows[:, None] * C + rows[None, :],
                     tl.load(tc_ptr + tc_base + rows[:, None] * C + rows[None, :], mask=cp, other=0.0), mask=cp)
            A = _a_rows(rows, b, gam, gam, k_ptr, bk_ptr, trow, brow, from_step, from_buf,
                        trow, brow, from_step, from_buf, hk, HK, K, KP, BK, EMULATE, PREC, True)
            tl.store(scr + rows[:, None] * C + rows[None, :], A, mask=(rows >= bi0 * DR)[:, None])
            # the diagonal blocks' inverses side by side (one chain of dots, not one per block row;
            # each with the bits the decode path's one block gets alone)
            tl.debug_barrier()
            _invert_diagonal_blocks_in_place(scr, bi0, DR, C, EMULATE)
        tl.debug_barrier()
        for bi in range(bi0, L // DR + 1):
            rb, fb, fs, tb, bb = _row_tile(bi, start, first, end, tok0, slot, has_state, C, DR)
            if decode:
                b_b = tl.where(fb, tl.load(bb_ptr + bb * HV + h, mask=fb, other=0.0),
                               tl.load(beta_ptr + tb * HV + h, mask=fs, other=0.0))
                gam_b = tl.sum(tl.where(tl.arange(0, NB)[:, None] == bi, gam2, 0.0), 0)   # a copy
                Ab = _a_rows(rb, b_b, gam_b, gam, k_ptr, bk_ptr, tb, bb, fs, fb,
                             trow, brow, from_step, from_buf, hk, HK, K, KP, BK, EMULATE, PREC, False)
                tl.store(scr + rb[:, None] * C + rows[None, :], Ab)
                tl.debug_barrier()
            Tb = _unit_lower_block_row_in_place(scr, bi, decode == 0, DR, C, EMULATE)
            if decode:
                # the step's rows of w and u in this block
                _w_u_rows(Tb.to(DT), base * C + rb, ((rb >= r0) & (rb <= L))[:, None], k_ptr, bk_ptr,
                          v_ptr, bv_ptr, trow, brow, from_step, from_buf, hk, h, kb_scale, b, w_ws, u_ws,
                          kc_ws, 0, False,
                          HK, HV, K, V, KP, VP, BK, BV, False, EMULATE, PREC)
        tl.debug_barrier()  # every thread's read of the stamp precedes its write
        tl.store(tpos_ptr + slot * HV + h, tl.where(free, end, -1), mask=keep)

        if not decode:
            # the key tile is shared by the value heads of a group: the group's first stores it.
            # Rows past the block rows solved are e_i (zero rows of A)
            solved = (rows < (L // DR + 1) * DR)[:, None]
            Tf = tl.where(solved, tl.load(scr + rows[:, None] * C + rows[None, :], mask=solved, other=0.0),
                          tl.where(rows[:, None] == rows[None, :], 1.0, 0.0))
            tl.store(tc_ptr + tc_base + rows[:, None] * C + rows[None, :], Tf,
                     mask=keep & free & (rows <= L)[:, None])
            Tr = Tf.to(DT)
            if SAVE_T:  # the T that w and u are computed from, for the training backward (save_t)
                tl.store(t_out_ptr + (base * C + rows[:, None]) * C + rows[None, :], Tr,
                         mask=(save_t != 0) & (rows >= 0)[:, None])
            _w_u_rows(Tr, base * C + rows, None, k_ptr, bk_ptr, v_ptr, bv_ptr,
                      trow, brow, from_step, from_buf, hk, h, kb_scale, b, w_ws, u_ws,
                      kc_ws, (n.to(tl.int64) * HK + hk) * C + rows, (rows >= 0)[:, None] & (h % (HV // HK) == 0),
                      HK, HV, K, V, KP, VP, BK, BV, True, EMULATE, PREC)

    @triton.jit(**{**_GDN_JIT, "do_not_specialize": [*_GDN_JIT["do_not_specialize"], "S"]})
    def _gdn_work_kernel(
        start_pos_ptr, start_ptr, end_ptr, seqc_ptr, work_ptr, nwork_ptr, S,
        has_state, has_dcache,
        C: tl.constexpr, ALIGNED: tl.constexpr, WB: tl.constexpr,
    ):
        """One program: the sequences the state kernel walks, in order, into work_ptr and their
        count into nwork_ptr. Every sequence with a chunk in the step, except a decode-path
        chunk's at a position > 0 (nothing to fold and the state stays as it is: the state
        kernel's program would store nothing)."""
        total = 0
        for b0 in range(0, S, WB):
            s = b0 + tl.arange(0, WB)
            ok = s < S
            _, _, any_chunk, decode = _seq_decode(s, ok, seqc_ptr, start_ptr, end_ptr, has_state, has_dcache, C,
                                                  ALIGNED)
            sp = tl.load(start_pos_ptr + s, mask=ok, other=0)
            need = (any_chunk & ((decode == 0) | (sp == 0))).to(tl.int32)
            tl.store(work_ptr + total + tl.cumsum(need, 0) - 1, s, mask=need != 0)
            total += tl.sum(need, 0)
        tl.store(nwork_ptr, total)

    @triton.jit
    def _state_chunk(n, h, hs, rk, rv, rows, start_ptr, end_ptr, gam_ws, w_ws, kc_ws, u_ws, vn_ws, h_ws,
                     HK: tl.constexpr, HV: tl.constexpr, C: tl.constexpr, KP: tl.constexpr, VP: tl.constexpr,
                     BV: tl.constexpr, WHOLE: tl.constexpr, ALIGNED: tl.constexpr, EMULATE: tl.constexpr,
                     PREC: tl.constexpr):
        """One chunk n of the state walk (value head h, the V tile rv of the fp32 state hs): its
        boundary state and v_new = u - w h into the workspaces, then the fold of a whole chunk
        (WHOLE: known to be one; else read from its rows, and in aligned mode a partial chunk
        stays out of the state). Returns the state after the chunk and whether it folded."""
        DT = w_ws.dtype.element_ty
        base = n * HV + h
        tl.store(h_ws + (base * KP + rk[:, None]) * VP + rv[None, :], hs.to(DT))
        w = tl.load(w_ws + (base * C + rows[:, None]) * KP + rk[None, :])
        u = tl.load(u_ws + (base * C + rows[:, None]) * VP + rv[None, :])
        vf = u - _dot(w, hs.to(DT), tl.zeros([C, BV], dtype=tl.float32), EMULATE, PREC)
        tl.store(vn_ws + (base * C + rows[:, None]) * VP + rv[None, :], vf.to(DT))
        if WHOLE:
            L = C - 1
            fold = True
        else:
            L = tl.load(end_ptr + n) - tl.load(start_ptr + n) - 1
            if ALIGNED:
                fold = L == C - 1  # a partial chunk stays out of the state
            else:
                fold = L >= 0
        if fold:
            # h' = e^gamma_L h + k^T (e^(gamma_L - gamma) v_new), as fla folds: the chunk's key tile
            # is its key head's (half the bytes of per-value-head decayed keys), the decay goes on
            # v_new's fp32 rows before they round (zero rows past L)
            gl = tl.load(gam_ws + base * C + L)
            gam = tl.load(gam_ws + base * C + rows)
            dec = tl.where(rows <= L, tl.exp(tl.where(rows <= L, gl - gam, 0.0)), 0.0)
            kc = tl.load(kc_ws + ((n * HK + h // (HV // HK)) * C + rows[:, None]) * KP + rk[None, :])
            hs = _dot(tl.trans(kc), (vf * dec[:, None]).to(DT), hs * tl.exp(gl), EMULATE, PREC)
        return hs, fold

    @triton.jit(**_GDN_JIT)
    def _gdn_state_kernel(
        start_pos_ptr, slots_ptr, ssm_ptr, hr_ptr,
        start_ptr, end_ptr, seqc_ptr, work_ptr, nwork_ptr,
        gam_ws, w_ws, kc_ws, u_ws, vn_ws, h_ws,
        has_state, has_dcache,
        HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
        KP: tl.constexpr, VP: tl.constexpr, BV: tl.constexpr,
        ALIGNED: tl.constexpr, EMULATE: tl.constexpr, PREC: tl.constexpr,
    ):
        """Per (sequence, value head, V tile): walk the sequence's chunks in order carrying
        the fp32 state tile; per chunk store its boundary state and
        v_new = u - w h for the output kernel, then fold a complete chunk (fast mode: any
        chunk) into the state. Writes the cached state at the end, and with the decode caches
        its copy rounded to the model dtype, which the decode path reads. A chunk on the decode
        path needs none of it (the output kernel reads the cached state itself); only a
        sequence at position 0 gets its zero state written. The sequences come from the work
        list (_gdn_work_kernel), the programs of a (V tile, head) striding over it."""
        vt = tl.program_id(0)  # V tiles of a (sequence, head) side by side: they share w in L2
        h = tl.program_id(1)
        DT = w_ws.dtype.element_ty
        rk = tl.arange(0, KP)
        rv = vt * BV + tl.arange(0, BV)
        rows = tl.arange(0, C)
        st_ok = _mask2(rk < K, rv, V, VP)
        for i in range(tl.program_id(2), tl.load(nwork_ptr), tl.num_programs(2)):
            s = tl.load(work_ptr + i)
            c0, c1, any_chunk, decode = _seq_decode(s, True, seqc_ptr, start_ptr, end_ptr, has_state, has_dcache,
                                                    C, ALIGNED)
            c_end = tl.where(decode, c0, c1)
            sp = tl.load(start_pos_ptr + s)
            slot = tl.load(slots_ptr + s, mask=has_state != 0, other=0).to(tl.int64)
            st_ptrs = ssm_ptr + (slot * HV + h) * (K * V) + rk[:, None] * V + rv[None, :]
            # a sequence at position 0 never reads its slot (slots are reused, not zeroed)
            read = (has_state != 0) & (sp > 0) & (c_end > c0)
            hs = tl.load(st_ptrs, mask=st_ok & read, other=0.0)
            # every chunk but a sequence's last is whole (C rows on the grid, or fast mode's C rows
            # from the first new token) and folds: that loop has no branch, so its loads (w, u, the
            # key tile, gamma) are software-pipelined across chunks; the last chunk folds where
            # it is whole (fast mode: always). The same arithmetic either way.
            for n in range(c0.to(tl.int64), c_end.to(tl.int64) - 1):
                hs, _ = _state_chunk(n, h, hs, rk, rv, rows, start_ptr, end_ptr, gam_ws, w_ws, kc_ws, u_ws,
                                     vn_ws, h_ws, HK, HV, C, KP, VP, BV, True, ALIGNED, EMULATE, PREC)
            folded = c_end - c0 > 1
            if c_end > c0:
                hs, last_folded = _state_chunk(c_end.to(tl.int64) - 1, h, hs, rk, rv, rows, start_ptr, end_ptr,
                                               gam_ws, w_ws, kc_ws, u_ws, vn_ws, h_ws,
                                               HK, HV, C, KP, VP, BV, False, ALIGNED, EMULATE, PREC)
                folded = folded | last_folded
            # written back where it changed: a chunk folded in, or a sequence at position 0 (its
            # slot holds another sequence's state); a decode step inside a chunk leaves it as is
            changed = st_ok & (has_state != 0) & any_chunk & (folded | (sp == 0))
            tl.store(st_ptrs, hs, mask=changed)
            tl.store(hr_ptr + (slot * HV + h) * (K * V) + rk[:, None] * V + rv[None, :], hs.to(DT),
                     mask=changed & (has_dcache != 0))

    @triton.jit(**_GDN_JIT)
    def _gdn_output_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
        bk_ptr, bv_ptr, bg_ptr, bb_ptr, bvn_ptr, slots_ptr, hr_ptr,
        seq_ptr, start_ptr, first_ptr, end_ptr, tok0_ptr, seqc_ptr,
        gam_ws, kc_ws, w_ws, u_ws, vn_ws, h_ws, scale,
        has_state, has_dcache,
        HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
        KP: tl.constexpr, VP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DR: tl.constexpr,
        DECODE: tl.constexpr, ALIGNED: tl.constexpr, EMULATE: tl.constexpr, PREC: tl.constexpr,
        OUT_STAGES: tl.constexpr,
    ):
        """One program per (chunk, value head, V tile), for the chunks on the decode path
        (DECODE) or for the others (not DECODE; the other chunks' programs return): two
        specialisations, launched one after the other, so that the decode path's small tiles
        get the registers and the occupancy they need rather than the whole-chunk path's.
        The outputs of the chunk's new rows,
        o = scale (e^gamma (q h) + (masked decayed q k^T) v_new); in aligned mode also the
        new rows of an incomplete last chunk into the buffer (no kernel reads it after the
        prep kernel, except the decode path of this one: rows before the step's, which no
        program writes).

        On the decode path the program computes the step's rows of v_new = u - w h itself,
        from the cached state's copy in the model dtype ("ssm_rounded", half the bytes of the
        fp32 state, rounded by the state kernel as it rounds its boundary states), in
        tiles of DR rows: each tile's rows join the slot's v_new rows, which the tile's
        outputs then read back with the rows of the chunk's earlier steps."""
        vt = tl.program_id(0)  # the V tiles of a (chunk, head) side by side: they share its tiles in L2
        n, h, hk, s, start, end, rows, from_buf, from_step, trow, brow, slot = _chunk_rows(
            tl.program_id(2), tl.program_id(1), seq_ptr, start_ptr, first_ptr, end_ptr, tok0_ptr, slots_ptr,
            has_state, C, HV, HK)
        DT = vn_ws.dtype.element_ty
        base = n.to(tl.int64) * HV + h
        rv = vt * BV + tl.arange(0, BV)
        L = end - start - 1
        c0 = tl.load(seqc_ptr + s)
        c1 = tl.load(seqc_ptr + s + 1)
        decode = _decode_path(c0, c1, start, end, has_state, has_dcache, C, ALIGNED)
        if decode == DECODE:
            write_buf = False
            if ALIGNED:
                # the step's rows of an incomplete last chunk join the buffer (rows no program of
                # this launch reads: the decode path reads the rows before the step's)
                write_buf = (has_state != 0) & (n == c1 - 1) & (end - start < C)
                wv = from_step & write_buf
                kw = wv & (vt == 0) & (h % (HV // HK) == 0)
                for k0 in tl.static_range(0, KP, BK):
                    cols = k0 + tl.arange(0, BK)
                    kmask = _mask2(kw, cols, K, KP)
                    ks = tl.load(k_ptr + hk * K + trow[:, None] * (HK * K) + cols[None, :], mask=kmask, other=0.0)
                    tl.store(bk_ptr + hk * K + brow[:, None] * (HK * K) + cols[None, :], ks, mask=kmask)
                vs = tl.load(v_ptr + trow[:, None] * (HV * V) + h * V + rv[None, :],
                             mask=_mask2(wv, rv, V, VP), other=0.0)
                tl.store(bv_ptr + h * V + brow[:, None] * (HV * V) + rv[None, :], vs,
                         mask=_mask2(wv, rv, V, VP))
                wg = wv & (vt == 0)
                gs = tl.load(g_ptr + trow * HV + h, mask=wg, other=0.0)
                bs = tl.load(beta_ptr + trow * HV + h, mask=wg, other=0.0)
                tl.store(bg_ptr + brow * HV + h, gs, mask=wg)
                tl.store(bb_ptr + brow * HV + h, bs, mask=wg)
            # the slot's v_new rows of its partial chunk ("buf_vn" [slots, C, Hv, V])
            vn_buf = bvn_ptr + h * V + brow[:, None] * (HV * V) + rv[None, :]
            ii = rows[:, None]
            jj = rows[None, :]
            gam = tl.load(gam_ws + base * C + rows)
            if DECODE:
                first = tl.load(first_ptr + n)
                r0 = first - start
                trow0 = (tl.load(tok0_ptr + n) - first + start).to(tl.int64)
                # the chunk's boundary state: the cached one, unchanged by this step (zero at
                # position 0, not read), in the copy the state kernel rounded to the model dtype
                # (the .to(DT) of its own copy for the whole-chunk path: the same bits)
                st = hr_ptr + (slot * HV + h) * (K * V)
                rk = tl.arange(0, KP)
                known = first > 0
                for t in range(r0 // DR, L // DR + 1):
                    rt = t * DR + tl.arange(0, DR)
                    new = (rt >= r0) & (rt <= L)
                    trow_t = trow0 + rt
                    ws_t = base * C + rt
                    w = tl.load(w_ws + ws_t[:, None] * KP + rk[None, :], mask=new[:, None], other=0.0)
                    u = tl.load(u_ws + ws_t[:, None] * VP + rv[None, :], mask=new[:, None], other=0.0)
                    hs = tl.load(st + rk[:, None] * V + rv[None, :], mask=_mask2(rk < K, rv, V, VP) & known,
                                 other=0.0).to(DT)
                    vn_t = (u - _dot(w, hs, tl.zeros([DR, BV], dtype=tl.float32), EMULATE, PREC)).to(DT)
                    tl.store(bvn_ptr + h * V + (slot * C + rt)[:, None] * (HV * V) + rv[None, :], vn_t,
                             mask=_mask2(new, rv, V, VP))
                    qk = tl.zeros([DR, C], dtype=tl.float32)
                    qh = tl.zeros([DR, BV], dtype=tl.float32)
                    for k0 in tl.static_range(0, KP, BK):
                        cols = k0 + tl.arange(0, BK)
                        qt = tl.load(q_ptr + hk * K + trow_t[:, None] * (HK * K) + cols[None, :],
                                     mask=_mask2(new, cols, K, KP), other=0.0)
                        kt = _tile(k_ptr + hk * K, HK * K, bk_ptr + hk * K, HK * K, trow, brow, from_step, from_buf,
                                   cols, K, KP)
                        hb = tl.load(st + cols[:, None] * V + rv[None, :], mask=_mask2(cols < K, rv, V, VP) & known,
                                     other=0.0).to(DT)
                        qk = _dot(qt, tl.trans(kt), qk, EMULATE, PREC)
                        qh = _dot(qt, hb, qh, EMULATE, PREC)
                    tl.debug_barrier()  # this tile's rows of v_new, stored above by other threads, are read below
                    vn = tl.load(vn_buf, mask=_mask2(rows <= tl.minimum(L, t * DR + DR - 1), rv, V, VP), other=0.0,
                                 cache_modifier=".cg")
                    gt = tl.load(gam_ws + ws_t)
                    incl = jj <= rt[:, None]
                    P = tl.where(incl, qk * tl.exp(tl.where(incl, gt[:, None] - gam[None, :], 0.0)), 0.0)
                    o = _dot(P.to(DT), vn, qh * tl.exp(gt)[:, None], EMULATE, PREC) * scale
                    o = tl.where(o == 0.0, 0.0, o)  # only the sign of an exact zero could tell schedules apart
                    tl.store(o_ptr + trow_t[:, None] * (HV * V) + h * V + rv[None, :], o.to(o_ptr.dtype.element_ty),
                             mask=_mask2(new, rv, V, VP))
            else:
                kc_rows = (n.to(tl.int64) * HK + hk) * C + rows
                qk = tl.zeros([C, C], dtype=tl.float32)
                qh = tl.zeros([C, BV], dtype=tl.float32)
                # a loop, not unrolled: the next K tile's loads are async copies issued while this
                # one is multiplied (OUT_NUM_STAGES)
                for k0 in tl.range(0, KP, BK, num_stages=OUT_STAGES):
                    cols = k0 + tl.arange(0, BK)
                    # q only for the step's rows: rows before first_new have no output
                    qt = tl.load(q_ptr + hk * K + trow[:, None] * (HK * K) + cols[None, :],
                                 mask=_mask2(from_step, cols, K, KP), other=0.0)
                    kt = tl.load(kc_ws + kc_rows[:, None] * KP + cols[None, :])
                    hb = tl.load(h_ws + (base * KP + cols[:, None]) * VP + rv[None, :])
                    qk = _dot(qt, tl.trans(kt), qk, EMULATE, PREC)
                    qh = _dot(qt, hb, qh, EMULATE, PREC)
                incl = jj <= ii
                P = tl.where(incl, qk * tl.exp(tl.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
                vn = tl.load(vn_ws + (base * C + rows[:, None]) * VP + rv[None, :])
                o = _dot(P.to(DT), vn, qh * tl.exp(gam)[:, None], EMULATE, PREC) * scale
                o = tl.where(o == 0.0, 0.0, o)  # only the sign of an exact zero could tell schedules apart
                tl.store(o_ptr + trow[:, None] * (HV * V) + h * V + rv[None, :], o.to(o_ptr.dtype.element_ty),
                         mask=_mask2(from_step, rv, V, VP))
                if ALIGNED:
                    # the new rows of v_new join the slot's, for the decode path of the chunk's next step
                    tl.store(vn_buf, vn, mask=_mask2(from_step & write_buf & (has_dcache != 0), rv, V, VP))


# ---- checks shared by both devices ------------------------------------------------------------

# the state's rows of a partial chunk (aligned mode), as the Triton entry passes them
BUFFERS = ("buf_k", "buf_v", "buf_g", "buf_beta")
# optional, together (aligned mode, Triton): what makes a decode step cheap. "t_cache" float32
# [slots, Hv, C, C]: the partial chunk's rows of T = (I + A)^-1 (row-major), with "t_pos" int32
# [slots, Hv], the end position of the step that wrote them (a step solves only the block rows
# holding its new rows; the block rows before them are read back); "buf_vn" [slots, C, Hv, V]
# (model dtype): the partial chunk's rows of v_new (a decode step computes its own rows only);
# "ssm_rounded" [slots, Hv, K, V] (model dtype): the cached state rounded to the model dtype,
# written with it by the state kernel, the boundary state the decode path reads (half the
# bytes of the fp32 state, the step's largest read: the output kernel's 338 against 545 us per
# layer at the same tiles, H200, 256 sequences). Without them every step solves its chunk's T
# whole and recomputes all its rows through the state kernel (the same bits).
DECODE_CACHE = ("t_cache", "t_pos", "buf_vn", "ssm_rounded")


def _check(q, k, v, g, beta, md: StateMetadata, state, chunk_size: int, aligned: bool):
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError("expected q, k [T, Hk, K] and v [T, Hv, V]")
    T, Hk, K = q.shape
    Hv, V = v.shape[1], v.shape[2]
    if Hv % Hk:
        raise ValueError("the value heads must be a multiple of the key heads")
    check_grid(chunk_size, "K and V", K, V)
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError("g and beta must be [T, Hv]")
    if g.dtype != torch.float32 or beta.dtype != torch.float32:
        raise ValueError("g and beta must be float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError("q, k and v must share the model dtype")
    C = chunk_size
    buffers = {"buf_k": ((C, Hk, K), q.dtype), "buf_v": ((C, Hv, V), q.dtype),
               "buf_g": ((C, Hv), torch.float32), "buf_beta": ((C, Hv), torch.float32)}
    if state is not None and aligned and any(name in state for name in DECODE_CACHE):
        buffers.update({"t_cache": ((Hv, C, C), torch.float32), "t_pos": ((Hv,), torch.int32),
                        "buf_vn": ((C, Hv, V), q.dtype), "ssm_rounded": ((Hv, K, V), q.dtype)})
    check_state(md, state, aligned, (Hv, K, V), "Hv, K, V", buffers)


# ---- CUDA (Triton) -------------------------------------------------------------------------------

def state_work_list(md: StateMetadata, plan, has_state: int, has_decode_cache: int, chunk_size: int,
                    aligned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences the state kernel walks (device int32 [S], the first `count` entries used,
    in sequence order) and count (int32 [1]), built on the device (no host sync): every
    sequence with a chunk in the step but those whose chunk takes the decode path at a
    position > 0."""
    S = md.start_pos.shape[0]
    work = torch.empty(S, dtype=torch.int32, device=md.start_pos.device)
    count = torch.empty(1, dtype=torch.int32, device=md.start_pos.device)
    _gdn_work_kernel[(1,)](md.start_pos, plan.start, plan.end, plan.seq_chunks, work, count, S, has_state,
                           has_decode_cache, C=chunk_size, ALIGNED=bool(aligned), WB=WORK_BLOCK, num_warps=4,
                           enable_fp_fusion=False)
    return work, count


def gdn_chunk_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, md: StateMetadata, state: dict[str, torch.Tensor] | None, *,
                     chunk_size: int = 64, aligned: bool, t_out: torch.Tensor | None = None) -> torch.Tensor:
    """The chunked gated delta rule on the step's packed tokens (module docstring).

    q, k [T, Hk, K], v [T, Hv, V] in the model dtype; g, beta [T, Hv] float32. state:
    None (no cache: every sequence starts at position 0, nothing is written) or the
    layer's cache tensors by name, indexed by md.slots: "ssm" [slots, Hv, K, V] float32
    and, aligned, the partial-chunk buffer "buf_k" [slots, C, Hk, K], "buf_v"
    [slots, C, Hv, V] (model dtype), "buf_g", "buf_beta" [slots, C, Hv] float32, updated
    in place. Returns o [T, Hv, V] in the model dtype. Never syncs with the host beyond
    what md.chunk_plan does (nothing for decode steps). t_out (with SAVE_T_FOR_BACKWARD, no
    cache): [chunks, Hv, C, C] in the model dtype, filled with each chunk's T as w and u took
    it (the chunks of md.chunk_plan(chunk_size, aligned), in order) for the training backward."""
    require_triton(q)
    _check(q, k, v, g, beta, md, state, chunk_size, aligned)
    if t_out is not None:
        num = md.chunk_plan(chunk_size, aligned).num_chunks
        if not SAVE_T_FOR_BACKWARD or state is not None:
            raise ValueError("t_out needs gdn_chunk.SAVE_T_FOR_BACKWARD and no cache (the trainer's forward)")
        if tuple(t_out.shape) != (num, v.shape[1], chunk_size, chunk_size) or t_out.dtype != q.dtype \
                or not t_out.is_contiguous():
            raise ValueError(f"t_out must be a contiguous [{num}, {v.shape[1]}, {chunk_size}, {chunk_size}] "
                             f"{q.dtype} tensor, got {tuple(t_out.shape)} {t_out.dtype}")
    T, Hk, K = q.shape
    Hv, V = v.shape[1], v.shape[2]
    C = chunk_size
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    plan = md.chunk_plan(C, aligned)
    N = plan.num_chunks
    S = md.start_pos.shape[0]
    if N == 0 or T == 0:
        return o
    q, k, v, g, beta = (_aligned16(t) for t in (q, k, v, g, beta))
    dev = q.device
    KP, VP = _next_pow2(K), _next_pow2(V)
    BK = min(KP, BLOCK_K_MAX)
    emulate, prec = dot_mode(q)
    ws_dtype = q.dtype
    gam_ws = torch.empty((N, Hv, C), dtype=torch.float32, device=dev)
    kc_ws = torch.empty((N, Hk, C, KP), dtype=ws_dtype, device=dev)
    w_ws = torch.empty((N, Hv, C, KP), dtype=ws_dtype, device=dev)
    u_ws = torch.empty((N, Hv, C, VP), dtype=ws_dtype, device=dev)
    vn_ws = torch.empty((N, Hv, C, VP), dtype=ws_dtype, device=dev)
    h_ws = torch.empty((N, Hv, KP, VP), dtype=ws_dtype, device=dev)

    has_state, ssm, slots, (bk, bv, bg, bb) = launch_state(md, state, aligned, BUFFERS, (k, v, g, beta), dev)
    if has_state and aligned and DECODE_CACHE[0] in state:
        has_dc = 1
        tc, tpos, bvn, hr = (state[name] for name in DECODE_CACHE)
        if any(t.data_ptr() % 16 for t in (tc, tpos, bvn, hr)):
            raise ValueError("state tensors must be 16-byte aligned")
    else:  # never dereferenced
        has_dc, tc, tpos, bvn, hr = 0, gam_ws, slots, v, h_ws
    t_ws = torch.empty((N, Hv, C, C), dtype=torch.float32, device=dev)   # T's rows off the decode path
    launch = dict(enable_fp_fusion=False)
    _gdn_prep_kernel[(Hv, N)](
        k, v, g, beta, bk, bv, bg, bb, slots, tc, tpos,
        plan.seq, plan.start, plan.first_new, plan.end, plan.token0, plan.seq_chunks,
        gam_ws, kc_ws, w_ws, u_ws, t_ws, gam_ws if t_out is None else t_out, has_state, has_dc,
        int(t_out is not None),
        HK=Hk, HV=Hv, K=K, V=V, C=C, KP=KP, VP=VP, BK=BK, BV=min(VP, PREP_BLOCK_V_MAX), DR=DECODE_ROWS,
        ALIGNED=bool(aligned), EMULATE=emulate, PREC=prec, SAVE_T=SAVE_T_FOR_BACKWARD,
        num_warps=PREP_NUM_WARPS, num_stages=1, maxnreg=PREP_MAX_REGISTERS, **launch)
    work, nwork = state_work_list(md, plan, has_state, has_dc, C, aligned)
    bv_state = min(VP, STATE_BLOCK_V_MAX)
    seq_programs = min(S, max(1, STATE_PROGRAMS // (VP // bv_state * Hv)))
    _gdn_state_kernel[(VP // bv_state, Hv, seq_programs)](
        md.start_pos, slots, ssm, hr, plan.start, plan.end, plan.seq_chunks, work, nwork,
        gam_ws, w_ws, kc_ws, u_ws, vn_ws, h_ws, has_state, has_dc,
        HK=Hk, HV=Hv, K=K, V=V, C=C, KP=KP, VP=VP, BV=bv_state,
        ALIGNED=bool(aligned), EMULATE=emulate, PREC=prec,
        num_warps=STATE_NUM_WARPS, num_stages=STATE_NUM_STAGES, maxnreg=STATE_MAX_REGISTERS, **launch)
    # the decode path's chunks (only with the decode caches), then the others
    for decode in ((True, False) if has_dc else (False,)):
        bv_out = min(VP, OUT_DECODE_BLOCK_V_MAX if decode else OUT_BLOCK_V_MAX)
        _gdn_output_kernel[(VP // bv_out, Hv, N)](
            q, k, v, g, beta, o, bk, bv, bg, bb, bvn, slots, hr,
            plan.seq, plan.start, plan.first_new, plan.end, plan.token0, plan.seq_chunks,
            gam_ws, kc_ws, w_ws, u_ws, vn_ws, h_ws, float(scale), has_state, has_dc,
            HK=Hk, HV=Hv, K=K, V=V, C=C, KP=KP, VP=VP, BK=BK, BV=bv_out, DR=DECODE_ROWS, DECODE=decode,
            ALIGNED=bool(aligned), EMULATE=emulate, PREC=prec, OUT_STAGES=1 if decode else OUT_NUM_STAGES,
            num_warps=OUT_DECODE_NUM_WARPS if decode else OUT_NUM_WARPS, num_stages=1, **launch)
    return o


# ---- CPU (torch) ---------------------------------------------------------------------------------

def _chunk_torch(qt, kt, vt, gt, bt, h, L: int, scale: float, G: int):
    """One chunk as a full C-row tile, all value heads at once (every shape fixed by the
    model's dims and C). qt, kt [C, Hk, K], vt [C, Hv, V] (model dtype), gt, bt [C, Hv],
    h [Hv, K, V] fp32, L = last valid row. Returns (o [C, Hv, V] fp32, state after the
    chunk's rows <= L)."""
    C = kt.shape[0]
    kf = kt.float().repeat_interleave(G, dim=1).transpose(0, 1)  # [Hv, C, K]
    qf = qt.float().repeat_interleave(G, dim=1).transpose(0, 1)
    vf = vt.float().transpose(0, 1)                                # [Hv, C, V]
    gam = gt.cumsum(0).t()                                         # [Hv, C]
    b = bt.t()
    idx = torch.arange(C, device=kt.device)
    lower = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    diff = gam[:, :, None] - gam[:, None, :]
    A = torch.where(lower, b[:, :, None] * (kf @ kf.transpose(1, 2)) * torch.where(lower, diff, 0.0).exp(), 0.0)
    # T = (I + A)^-1 by forward substitution (row i reads rows < i; rows past L stay e_i)
    eye = torch.eye(C, device=kt.device)
    T = eye.expand(A.shape).clone()
    for i in range(1, L + 1):
        T[:, i, :] = (-A[:, i, :, None] * T).sum(1) + eye[i]
    eg = gam.exp()
    w = T @ (kf * (b * eg)[:, :, None])
    u = T @ (vf * b[:, :, None])
    vn = u - w @ h
    P = torch.where(incl, (qf @ kf.transpose(1, 2)) * torch.where(incl, diff, 0.0).exp(), 0.0)
    o = ((qf @ h) * eg[:, :, None] + P @ vn) * scale
    o = torch.where(o == 0, 0.0, o)
    gl = gam[:, L]
    ok = idx <= L
    dec = torch.where(ok, torch.where(ok, gl[:, None] - gam, 0.0).exp(), 0.0)
    h_new = h * gl.exp()[:, None, None] + (kf * dec[:, :, None]).transpose(1, 2) @ vn
    return o.transpose(0, 1), h_new


def gdn_chunk_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: float, md: StateMetadata, state: dict[str, torch.Tensor] | None, *,
                    chunk_size: int = 64, aligned: bool) -> torch.Tensor:
    """The CPU entry: same contract as gdn_chunk_triton, computed in float32 torch one
    chunk at a time, each chunk a full C-row tile of fixed-shape ops (chunk_scan.scan_chunks_torch)."""
    _check(q, k, v, g, beta, md, state, chunk_size, aligned)
    T, Hk, K = q.shape
    Hv, V = v.shape[1], v.shape[2]
    G = Hv // Hk
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    chunks = host_chunks(md, chunk_size, aligned, state, T)
    if chunks is None:
        return o
    with torch.no_grad():
        inputs = ((q, None), (k, "buf_k"), (v, "buf_v"), (g, "buf_g"), (beta, "buf_beta"))
        scan_chunks_torch(chunks, o, inputs, state, (Hv, K, V), chunk_size, aligned,
                          lambda tiles, h, L: _chunk_torch(*tiles, h, L, scale, G))
    return o


# ---- differentiable reference and the training Function ---------------------------------------

def gdn_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  cu_seqlens, scale: float, chunk_size: int = 64) -> torch.Tensor:
    """The chunked gated delta rule in plain differentiable torch, over packed sequences
    that all start at position 0 with a zero state. Computes in the inputs' dtype
    (float32 / float64; lower precisions in float32), returns o [T, Hv, V] in q's dtype.
    Sequences are padded to whole chunks and batched (zero rows change no earlier row)."""
    out_dtype = q.dtype
    acc = reference_dtype(q.dtype)
    T, Hk, K = q.shape
    Hv, V = v.shape[1], v.shape[2]
    G = Hv // Hk
    C = chunk_size
    seqs = PaddedChunks(cu_seqlens, C)
    if T == 0 or not seqs.lens:
        return v.new_zeros((T, Hv, V), dtype=out_dtype)
    qb = seqs.by_chunk(q.repeat_interleave(G, dim=1), acc)
    kb = seqs.by_chunk(k.repeat_interleave(G, dim=1), acc)
    vb, gb, bb = (seqs.by_chunk(t, acc) for t in (v, g, beta))
    gam = gb.cumsum(-1)
    idx = torch.arange(C, device=q.device)
    lower = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    diff = gam[..., :, None] - gam[..., None, :]
    A = torch.where(lower, bb[..., :, None] * (kb @ kb.transpose(-1, -2)) * torch.where(lower, diff, 0.0).exp(), 0.0)
    IA = A + torch.eye(C, dtype=acc, device=q.device)
    w = torch.linalg.solve_triangular(IA, kb * (bb * gam.exp())[..., None], upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(IA, vb * bb[..., None], upper=False, unitriangular=True)
    Pm = torch.where(incl, (qb @ kb.transpose(-1, -2)) * torch.where(incl, diff, 0.0).exp(), 0.0)
    qd = qb * gam.exp()[..., None]
    gl = gam[..., -1:]
    kd = kb * (gl - gam).exp()[..., None]
    # the recurrence over chunks carries only what it must (v_new needs the state), with its own
    # backward (no autograd graph per chunk); the outputs of every chunk are then two batched
    # products
    states, vn = ChunkRecurrenceFn.apply(u, w, kd, gl[..., 0].exp())
    o = qd @ states + Pm @ vn                                                    # [B, Hv, nC, C, V]
    return seqs.from_chunks(o * scale).to(out_dtype)


class GatedDeltaRuleFn(torch.autograd.Function):
    """o = fwd(q, k, v, g, beta, scale, md, None): the engine's kernel (so a training
    forward has the rollout's bits); the backward is gdn_reference's: the fused kernels on a
    GPU, else autograd of the reference recomputed in float32 (float64 for float64 inputs).
    Every sequence starts at 0. chunk_size: the forward's (fwd has it bound), which the
    backward takes too; with SAVE_T_FOR_BACKWARD and the fused backward ahead, the forward
    keeps each chunk's T for it."""

    @staticmethod
    def forward(ctx, fwd: Callable, q, k, v, g, beta, scale: float, md: StateMetadata, chunk_size: int = 64):
        ctx.scale, ctx.cu, ctx.chunk_size = scale, md.cu_seqlens, chunk_size
        t_saved = t_chunks = None
        if SAVE_T_FOR_BACKWARD and _stores_t(fwd) and _fused_backward_applies(q, v, chunk_size):
            plan = md.chunk_plan(chunk_size, True)
            t_saved = torch.empty((plan.num_chunks, v.shape[1], chunk_size, chunk_size), dtype=q.dtype,
                                  device=q.device)
            t_chunks = plan.seq_chunks.to(torch.int32)
            o = fwd(q, k, v, g, beta, scale, md, None, t_out=t_saved)
        else:
            o = fwd(q, k, v, g, beta, scale, md, None)
        ctx.save_for_backward(q, k, v, g, beta, t_saved, t_chunks)
        return o

    @staticmethod
    def backward(ctx, do):
        needs, (*xs, t_saved, t_chunks) = ctx.needs_input_grad[1:6], ctx.saved_tensors
        if any(needs) and do.is_cuda and do.dtype != torch.float64 and _fused_backward_applies(xs[0], xs[2],
                                                                                                ctx.chunk_size):
            # the fused kernels (gdn_backward.py): the same gradients, 1.3x faster on the H200
            grads = gdn_backward_triton(*xs, do, ctx.cu, ctx.scale, ctx.chunk_size, t_saved, t_chunks)
            grads = [d if n else None for d, n in zip(grads, needs)]
        else:
            grads = reference_grads(lambda *a: gdn_reference(*a, ctx.cu, ctx.scale, chunk_size=ctx.chunk_size),
                                    xs, needs, do)
        return (None, *grads, None, None, None)


def _stores_t(fwd: Callable) -> bool:
    """Whether the forward is the Triton kernel (or a partial of it), the one that fills t_out."""
    while isinstance(fwd, functools.partial):
        fwd = fwd.func
    return fwd is gdn_chunk_triton


def _fused_backward_applies(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> bool:
    """The backward runs gdn_backward_triton (CUDA, not float64, head dims and chunk it takes)."""
    return (q.is_cuda and q.dtype != torch.float64 and fused_backward_ok(q, v)
            and chunk_size <= FUSED_MAX_CHUNK)
