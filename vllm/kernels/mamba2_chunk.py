"""Chunked Mamba-2 scan (SSD: the state space dual form; Nemotron-H's mixer).

Per head h (group g = h // (H / G) of B and C), with dt_t = max(softplus(dt_raw_t +
dt_bias), dt_min) and A = -exp(A_log), the recurrence over tokens t is

    S = exp(dt_t A) S + dt_t x_t B_t^T;   y_t = S C_t + D x_t

with an fp32 state S [P, N]. It is computed in chunks of C rows (transformers'
`mamba2_chunk_scan`, mamba_ssm's `mamba_chunk_scan_combined`): per chunk with boundary state
h, gamma = cumsum(dt A), CB = C B^T (per group), M = lower-inclusive CB exp(gamma_i -
gamma_j) dt_j, y = M x + exp(gamma) (C h^T) + D x and, after a chunk whose last row is L,
h' = exp(gamma_L) h + x^T (B exp(gamma_L - gamma) dt).

Invariant mode (`aligned=True`) promises that the bits of a token's output and of the
state written do not depend on the batch nor on how the sequence was cut into steps:

* Chunks lie on the sequence's absolute grid of C rows, row i of a chunk at row i of its
  C-row tile, by the same code with the same tile shapes whether it is a prefill chunk, the
  resumed middle of one, or a decode step (a chunk with one new row whose earlier rows are
  re-read from the state's buffer). What mixes rows is computed over the whole tile: gamma's
  prefix scan, the fold, and the K dims of the dots (all of N for C B^T and C h; for M x the
  chunk's columns in blocks of OUT_K_BLOCK up to at least the block holding the row: any
  later block a tile takes adds exact zeros to the row).
* Row i of every per-chunk quantity depends on rows <= i only: gamma is a prefix scan, M is
  lower-inclusive, and products with later rows are masked to exact zeros; the state update
  sums a complete chunk's rows only. The zero rows of an incomplete chunk cannot move the
  bits of the rows before them.
* The rows that have outputs are computed in row tiles of ROW_TILE rows (OUT_CACHED_ROW_TILE
  for steps inside one incomplete chunk, decode steps among them): a step computes CB and
  outputs for the tiles that hold its rows only (a decode step: one tile of the chunk's eight
  at C = 128), each with the K dims above, so a row's arithmetic is the same in every tile,
  whichever other rows the step computes.
* A partial chunk is never folded into the state: the cached state is the boundary state of
  the sequence's current chunk, and the chunk's rows so far are kept in the buffer at the
  dtype they arrived in (x, B in the model dtype; dt in fp32 after softplus), so a re-read
  row equals the row a single prefill held. C of earlier rows is never needed (only the new
  rows have outputs), so it is not kept.

Fast mode (`aligned=False`) chunks from each sequence's first new token, keeps no buffer and
folds the partial last chunk into the state (the native form: a token's bits depend on where
its step began). Same kernels otherwise; decode steps take the selective state update
(vllm/kernels/mamba2_ops.py) there.

CUDA runs four Triton kernels, every chunk through the same tile code:
  1. prep, per (chunk, group): the rows of CB = C B^T in the row tiles holding the step's
     rows, and per head of the group dt and gamma (whole chunk) into workspaces; its first
     program also lists the sequences the state kernel has work for (below);
  2. state, per (head, P tile, N tile) and a few programs per triple striding over that list: walks a
     sequence's chunks in order, stores each chunk's boundary state for (3) in the model
     dtype, folds complete chunks (fast mode: every chunk) into the fp32 state, writes the
     cached state where it changed (invariant mode: with its copy rounded to the model dtype,
     "ssm_rounded", for (3)). A sequence whose step stays inside one incomplete chunk
     (every decode step but the one completing a chunk) has nothing to do: its state does
     not change and is that chunk's boundary. It is left off the list, so a decode step
     launches a fixed, small grid whose programs find (almost) nothing to walk;
  3. output, per (head, chunk, P tile): the new rows' outputs, one row tile at a time over
     the tiles holding them; for a step that stays inside one incomplete chunk the boundary
     state is the cached state's rounded copy (the state kernel's `.to(DT)` of the fp32 state
     it stored: the same bits as the boundary copy it would have stored, and half the bytes
     of the fp32 state, the decode step's largest read). Two specialisations, one for those
     chunks and one for the others, launched one after the other;
  4. (invariant mode, with a cache) buffer, per (sequence, row slice, column block): the new
     rows of an incomplete last chunk into the state's buffer, a whole row (all heads) at a
     time, so a decode step copies just its one row per sequence. A separate launch: a step
     that resumes a chunk and ends in a later partial one reads and writes the same buffer
     rows.
Dots take model-dtype operands (M, the boundary state, B scaled by its decays rounded to it,
as mamba_ssm does) with fp32 accumulation. The CPU runs `mamba2_chunk_torch`, the same
algorithm in float32 torch on fixed-shape tiles (same invariances, not the same bits).
`mamba2_reference` is the differentiable formula (float32 / float64) that the backward of
`Mamba2ChunkScanFn` and the tests use.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from vllm.forward_context import StateMetadata
from vllm.kernels.chunk_scan import ROUNDED_STATE, PaddedChunks, check_grid, check_state, dot_mode, host_chunks, \
    launch_state, reference_dtype, reference_grads, require_triton, scan_chunks_torch
from vllm.kernels.chunk_tiles import HAS_TRITON, next_pow2 as _next_pow2, rows_aligned16 as _rows_aligned16
from vllm.kernels.mamba2_backward import MAX_CHUNK as FUSED_MAX_CHUNK, fused_backward_ok, mamba2_backward_triton
from vllm.kernels.mamba2_ops import dt_torch, neg_exp_torch, softplus_clamped

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm.kernels.chunk_tiles import JIT_OPTIONS as _JIT, chunk_rows as _chunk_rows, dot_rows as _dot, \
        mask2 as _mask2, row_tile as _row_tile, tile_rows as _tile

# --------------------------------------------------------------------------
# Tunables. Every one is fixed per model (head dims), never per step, so a rollout step, any
# other step and the trainer always run the same compiled kernels. PREP_NUM_WARPS changes the
# bits (the register layout of gamma's cumsum, a tree whose shape follows the layout). The K
# blockings (BLOCK_N_MAX, OUT_BLOCK_N_MAX: N of the C B^T and C h dots; OUT_K_BLOCK: the chunk's
# columns of M x) keep the invariance and may change the bits: under the interpreter, whose
# emulated dot sums each dot's K by its own tree, they do; with bf16 operands on the H200 they
# do not (dots chained over K blocks in increasing order give the one whole-K dot's bits:
# benchmarks/kernels/mamba2_output_sweep.py, every blocking the same bits); 3xTF32 (fp32 models)
# is unmeasured. Row i's M x takes blocks 0 .. i // OUT_K_BLOCK and, where its tile's last row
# lies in a later block, that block too, whose columns add exact zeros to row i: the same sum in
# every tile (the sign of a zero aside, which the store clears). The P tiles, the row tiles and
# the state and output kernels' warps and stages only change speed: they are the M and N dims of
# dots whose K dims and order they leave alone, and `acc = tl.dot(a, b, acc)` with an fp32
# accumulator gives every output element the same bits for any M / N tile and warp count
# (measured on the H200; docs/numerics.md, the linear row). STATE_PROGRAMS, WORK_LIST_BLOCK and
# the BUFFER_ ones decide which program walks a sequence or copies a row, never how: speed only.
# --------------------------------------------------------------------------
BLOCK_N_MAX = 64        # N tile of the C B^T dots
OUT_BLOCK_N_MAX = 128   # N tile of the output kernel's C h dots (all of N: its state operand is loaded once)
STATE_BLOCK_P_MAX = 64  # P tile of the state walk
STATE_BLOCK_N_MAX = 64  # N tile of the state walk: 2x the walks of whole N, less shared memory each
STATE_PROGRAMS = 1024   # state programs to aim for: (head, P tile, N tile) x programs per triple (<= sequences)
OUT_BLOCK_P_MAX = 64    # P tile of the output kernel
ROW_TILE = 32           # rows of a chunk per CB / output tile: only tiles holding new rows are computed
PREP_NUM_WARPS = 4      # 72 against 107 us at 8 (decode 256 x 1, H200)
STATE_NUM_WARPS = 4     # with N tile 64 (H200, prefill 4 x 2,048): 727 us; whole N at 8 warps 780, N 64 at 8 868
STATE_NUM_STAGES = 2    # the walk prefetches the next chunk's x and B tiles
OUT_NUM_WARPS = 4
OUT_K_BLOCK = 32        # columns of M per M x dot; a tile's dots stop at the block holding its last row
OUT_NUM_STAGES = 1
OUT_CACHED_BLOCK_P_MAX = 64  # the output kernel's specialisation for chunks on the cached state (decode)
OUT_CACHED_NUM_WARPS = 4     # 546 against 639 us at 8 (decode 256 x 1, H200)
OUT_CACHED_NUM_STAGES = 1
OUT_CACHED_ROW_TILE = 16     # its row tile (a divisor of ROW_TILE: prep's CB tiles cover its tiles)
WORK_LIST_BLOCK = 1024  # sequences per block of the state kernel's work list (built by prep)
BUFFER_BLOCK_MAX = 1024  # x elements a buffer program copies per row (a power-of-two divisor of H P)
BUFFER_ROW_PROGRAMS = 16  # buffer programs per sequence along the rows (at most the step's longest)
BUFFER_NUM_WARPS = 4


if HAS_TRITON:
    @triton.jit
    def _reads_cache(c0, c1, start, end, C: tl.constexpr, ALIGNED: tl.constexpr):
        """Whether a sequence's step is one chunk that stays incomplete (aligned mode; every
        decode step but the one that completes a chunk): nothing folds, so the cached state
        stays as it is through the step and is that chunk's boundary state. The state kernel
        then skips the sequence and the output kernel reads the cached state itself."""
        if ALIGNED:
            res = (c1 - c0 == 1) & (end - start < C)
        else:  # fast mode folds every chunk
            res = c1 < c0
        return res

    @triton.jit
    def _walks_state(c0, c1, start, end, sp, C: tl.constexpr, ALIGNED: tl.constexpr):
        """Whether the state kernel does anything for a sequence (scalars or vectors; start, end
        of its first chunk c0, sp its start position): it has chunks in the step and either
        reaches the state through them (not _reads_cache: boundary states to store, chunks to
        fold) or starts at position 0 (the zero state goes over its slot's stale one). Any
        other sequence would only load and mask: the state kernel's stores are exactly these."""
        return (c1 > c0) & ((_reads_cache(c0, c1, start, end, C, ALIGNED) == 0) | (sp == 0))

    @triton.jit
    def _state_work_list(seqc_ptr, start_ptr, end_ptr, start_pos_ptr, work_ptr, num_seqs,
                         C: tl.constexpr, ALIGNED: tl.constexpr, BS: tl.constexpr):
        """work[0] = how many sequences _walks_state, work[1 ..] = those sequences in increasing
        order (compacted by a prefix sum of the flags, BS sequences at a time)."""
        cnt = 0
        for s0 in range(0, num_seqs, BS):
            s = s0 + tl.arange(0, BS)
            ok = s < num_seqs
            c0 = tl.load(seqc_ptr + s, mask=ok, other=0)
            c1 = tl.load(seqc_ptr + s + 1, mask=ok, other=0)
            has = c1 > c0
            walk = _walks_state(c0, c1, tl.load(start_ptr + c0, mask=has, other=0),
                                tl.load(end_ptr + c0, mask=has, other=0),
                                tl.load(start_pos_ptr + s, mask=ok, other=0), C, ALIGNED)
            f = walk.to(tl.int32)
            tl.store(work_ptr + cnt + tl.cumsum(f, 0), s, mask=walk)  # inclusive: entries from 1
            cnt += tl.sum(f, 0)
        tl.store(work_ptr, cnt)

    # num_seqs varies per step: not specialised on, so every step runs one compiled prep kernel
    _JIT_PREP = {**_JIT, "do_not_specialize": [*_JIT["do_not_specialize"], "num_seqs"]}

    @triton.jit(**_JIT_PREP)
    def _ssd_prep_kernel(
        b_ptr, c_ptr, dt_ptr, dtb_ptr, alog_ptr, bb_ptr, bdt_ptr, slots_ptr,
        seq_ptr, start_ptr, first_ptr, end_ptr, tok0_ptr, seqc_ptr, start_pos_ptr, work_ptr,
        cb_ws, dt_ws, gam_ws, dt_min, sb, sc, sdt, has_state, num_seqs,
        H: tl.constexpr, G: tl.constexpr, N: tl.constexpr, C: tl.constexpr, NP: tl.constexpr, BN: tl.constexpr,
        BM: tl.constexpr, ALIGNED: tl.constexpr, SBLK: tl.constexpr, EMULATE: tl.constexpr, PREC: tl.constexpr,
    ):
        """One program per (chunk, group): the rows of CB = C B^T in the row tiles that hold
        the step's rows (the only rows with outputs; the output kernel reads those tiles), each
        tile over N tiles chained in increasing order, then per head of the group dt (softplus
        of the step's raw dt, or the buffer's) and gamma = cumsum(dt A) over the whole chunk.
        Program (0, 0) first writes the state kernel's work list (_state_work_list): built on
        the device, so a decode step still needs no host work (CUDA graphs)."""
        n = tl.program_id(0)
        g = tl.program_id(1)
        if (n == 0) & (g == 0):
            _state_work_list(seqc_ptr, start_ptr, end_ptr, start_pos_ptr, work_ptr, num_seqs, C, ALIGNED, SBLK)
        s, start, end, rows, from_buf, from_step, trow, brow, slot = _chunk_rows(
            n, seq_ptr, start_ptr, first_ptr, end_ptr, tok0_ptr, slots_ptr, has_state, C)
        first = tl.load(first_ptr + n)
        tok0 = tl.load(tok0_ptr + n)
        nb = n.to(tl.int64) * G + g
        for t in range((first - start) // BM, (end - 1 - start) // BM + 1):
            r, _, r_step, r_trow, _ = _row_tile(t, start, first, end, tok0, slot, has_state, C, BM)
            cb = tl.zeros([BM, C], dtype=tl.float32)
            for n0 in tl.static_range(0, NP, BN):
                cols = n0 + tl.arange(0, BN)
                ct = tl.load(c_ptr + g * N + r_trow[:, None] * sc + cols[None, :], mask=_mask2(r_step, cols, N, NP),
                             other=0.0)
                bt = _tile(b_ptr + g * N, sb, bb_ptr + g * N, G * N, trow, brow, from_step, from_buf, cols, N, NP)
                cb = _dot(ct, tl.trans(bt), cb, EMULATE, PREC)
            tl.store(cb_ws + (nb * C + r[:, None]) * C + rows[None, :], cb)
        for hh in range(H // G):
            h = g * (H // G) + hh
            raw = tl.load(dt_ptr + trow * sdt + h, mask=from_step, other=0.0).to(tl.float32) \
                + tl.load(dtb_ptr + h).to(tl.float32)
            d = tl.where(from_step, softplus_clamped(raw, dt_min), 0.0)
            d = tl.where(from_buf, tl.load(bdt_ptr + brow * H + h, mask=from_buf, other=0.0), d)
            a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
            gam = tl.cumsum(d * a, 0)  # prefix sums: row i sees rows <= i only
            ws = (n.to(tl.int64) * H + h) * C + rows
            tl.store(dt_ws + ws, d)
            tl.store(gam_ws + ws, gam)

    @triton.jit(**_JIT)
    def _ssd_state_kernel(
        x_ptr, b_ptr, bx_ptr, bb_ptr, ssm_ptr, hr_ptr, slots_ptr, start_pos_ptr,
        start_ptr, first_ptr, end_ptr, tok0_ptr, seqc_ptr, work_ptr,
        dt_ws, gam_ws, h_ws, sx, sb, has_state,
        H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, C: tl.constexpr,
        PP: tl.constexpr, NP: tl.constexpr, BP: tl.constexpr, BNS: tl.constexpr,
        ALIGNED: tl.constexpr, EMULATE: tl.constexpr, PREC: tl.constexpr,
    ):
        """Programs (head, k, (P tile, N tile)) (the heads of a group side by side: they read
        the same B rows); program k walks the k-th, (k + K)-th, ... sequence of the work list
        (prep's _state_work_list; K programs per (head, P tile, N tile)), each on its own: walk
        the sequence's chunks in order carrying the fp32 state tile [BP, BNS] (P and N are the
        M and N dims of the fold's dot, whose K dim is the chunk's rows: any tiling gives the
        same bits); per chunk store its boundary
        state (model dtype, [N, P] for the output kernel), then fold a complete chunk (fast
        mode: any chunk): h = exp(gamma_L) h + x^T (B exp(gamma_L - gamma) dt). Writes the
        cached state. A sequence whose step stays inside one incomplete chunk (_reads_cache)
        and past position 0 has nothing here (its state does not change and the output kernel
        reads it from the cache): it is not on the list and costs no program."""
        h = tl.program_id(0)
        pt = tl.program_id(2) // (NP // BNS)
        g = h // (H // G)
        DT = h_ws.dtype.element_ty
        rp = pt * BP + tl.arange(0, BP)
        rn = (tl.program_id(2) % (NP // BNS)) * BNS + tl.arange(0, BNS)
        rows = tl.arange(0, C)
        st_off = rp[:, None] * N + rn[None, :]
        st_ok = (rp < P)[:, None] & (rn < N)[None, :]
        for i in range(tl.program_id(1), tl.load(work_ptr), tl.num_programs(1)):
            s = tl.load(work_ptr + 1 + i)
            c0 = tl.load(seqc_ptr + s)
            c1 = tl.load(seqc_ptr + s + 1)
            sp = tl.load(start_pos_ptr + s)
            slot = tl.load(slots_ptr + s, mask=has_state != 0, other=0).to(tl.int64)
            cached = _reads_cache(c0, c1, tl.load(start_ptr + c0, mask=c1 > c0, other=0),
                                  tl.load(end_ptr + c0, mask=c1 > c0, other=0), C, ALIGNED)
            # a sequence at position 0 never reads its slot (slots are reused, not zeroed)
            read = (has_state != 0) & (sp > 0) & (c1 > c0) & (cached == 0)
            hs = tl.load(ssm_ptr + (slot * H + h) * (P * N) + st_off, mask=st_ok & read, other=0.0)
            folds = 0
            for n in range(c0.to(tl.int64), c1.to(tl.int64)):
                base = n * H + h
                if cached == 0:
                    tl.store(h_ws + (base * NP + rn[None, :]) * PP + rp[:, None], hs.to(DT))
                start = tl.load(start_ptr + n)
                L = tl.load(end_ptr + n) - start - 1
                if ALIGNED:
                    fold = L == C - 1  # a partial chunk stays out of the state
                else:
                    fold = L >= 0
                # loaded and multiplied whatever `fold` says (an unfolded chunk's rows load as
                # zeros and its product is dropped), so the loads carry no branch and the walk
                # can prefetch the next chunk's tiles (STATE_NUM_STAGES)
                first = tl.load(first_ptr + n)
                pos = start + rows
                from_buf = (pos < first) & (has_state != 0) & fold
                from_step = (pos >= first) & (pos <= start + L) & fold
                trow = (tl.load(tok0_ptr + n) - first + pos).to(tl.int64)
                brow = slot * C + rows
                gam = tl.load(gam_ws + base * C + rows)
                d = tl.load(dt_ws + base * C + rows)
                gl = tl.max(tl.where(rows == L, gam, float("-inf")), axis=0)
                w = tl.where(rows <= L, tl.exp(tl.where(rows <= L, gl - gam, 0.0)), 0.0) * d
                xt = _tile(x_ptr + h * P, sx, bx_ptr + h * P, H * P, trow, brow, from_step, from_buf, rp, P, PP)
                bt = _tile(b_ptr + g * N, sb, bb_ptr + g * N, G * N, trow, brow, from_step, from_buf, rn, N, NP)
                bs = (bt.to(tl.float32) * w[:, None]).to(DT)
                hs = tl.where(fold, _dot(tl.trans(xt), bs, hs * tl.exp(gl), EMULATE, PREC), hs)
                folds += fold.to(tl.int32)
            # written back where it changed: a chunk folded in, or a sequence at position 0 (its
            # slot holds another sequence's state); a decode step inside a chunk leaves it as is.
            # The load's addresses summed anew (not CSE'd with it): its [BP, N] tile of 64-bit
            # pointers is not kept live through the walk, where registers are short
            changed = st_ok & (has_state != 0) & (c1 > c0) & ((folds > 0) | (sp == 0))
            tl.store(ssm_ptr + slot * (H * P * N) + (h * (P * N) + st_off), hs, mask=changed)
            if ALIGNED:  # and its copy in the model dtype, for the output kernel's cached path
                tl.store(hr_ptr + slot * (H * P * N) + (h * (P * N) + st_off), hs.to(DT), mask=changed)

    @triton.jit(**_JIT)
    def _ssd_output_kernel(
        x_ptr, c_ptr, d_ptr, y_ptr, bx_ptr, hr_ptr, slots_ptr, start_pos_ptr,
        seq_ptr, start_ptr, first_ptr, end_ptr, tok0_ptr, seqc_ptr,
        cb_ws, dt_ws, gam_ws, h_ws, sx, sc, has_state,
        H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, C: tl.constexpr,
        PP: tl.constexpr, NP: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, BM: tl.constexpr,
        KB: tl.constexpr, CACHED: tl.constexpr, ALIGNED: tl.constexpr, EMULATE: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """One program per (head, chunk, P tile) (the heads of a group side by side: they read
        the same CB and C rows), for the chunks that read their boundary state from the cache
        (CACHED: _reads_cache, every decode step but the one completing a chunk) or for the
        others (not CACHED; the other chunks' programs load nothing and return): two
        specialisations, launched one after the other, so that each has the registers and
        the occupancy its own path needs. The outputs of the chunk's new rows,
        y = exp(gamma) (C h) + M x + D x with M the lower-inclusive CB exp(gamma_i - gamma_j)
        dt_j rounded to the model dtype, one tile of BM rows at a time over the row tiles that
        hold the step's rows (a decode step: one tile).

        Row i's arithmetic is the same in every tile and step: the K dims and their order are
        fixed per row (N in BN tiles for C h; for M x the chunk's columns in KB blocks up to the
        block holding the tile's last row, any block past row i's own adding exact zeros, as do
        the rows after the step's last one in x and in M), gamma and dt are the prep's
        whole-chunk values, and every other op is elementwise. The boundary state h is the
        state kernel's model-dtype copy, or for a step that stays inside one incomplete chunk
        (_reads_cache) the cached state's rounded copy ("ssm_rounded"): the state kernel
        stores both by the same .to(DT) of the same fp32 tile, so both are the same bits."""
        h = tl.program_id(0)
        n = tl.program_id(1)
        pt = tl.program_id(2)
        g = h // (H // G)
        DT = h_ws.dtype.element_ty
        s, start, end, _, _, _, _, _, slot = _chunk_rows(
            n, seq_ptr, start_ptr, first_ptr, end_ptr, tok0_ptr, slots_ptr, has_state, C)
        first = tl.load(first_ptr + n)
        tok0 = tl.load(tok0_ptr + n)
        base = n.to(tl.int64) * H + h
        rp = pt * BP + tl.arange(0, BP)
        dh = tl.load(d_ptr + h).to(tl.float32)
        mine = _reads_cache(tl.load(seqc_ptr + s), tl.load(seqc_ptr + s + 1), start, end, C, ALIGNED) == CACHED
        # as the state kernel: a sequence at position 0 has the zero state (its slot is stale)
        st_ok = (rp < P) & (has_state != 0) & (tl.load(start_pos_ptr + s) > 0)
        st_row = ((slot * H + h) * P + rp) * N
        t0 = (first - start) // BM
        t1 = tl.where(mine, (end - 1 - start) // BM + 1, t0)
        # one N tile and every row tile in this program: the boundary state's [N, BP] operand of
        # C h is the same for every row tile, loaded once (the state kernel's copy; the cached
        # path computes one tile anyway)
        HOIST: tl.constexpr = (BN == NP) and (not CACHED)
        if HOIST:
            h_all = tl.load(h_ws + (base * NP + tl.arange(0, NP)[:, None]) * PP + rp[None, :],
                            mask=(tl.arange(0, NP) < NP)[:, None] & mine, other=0.0)
        for t in range(t0, t1):
            r, r_buf, r_step, r_trow, r_brow = _row_tile(t, start, first, end, tok0, slot, has_state, C, BM)
            acc = tl.zeros([BM, BP], dtype=tl.float32)
            for n0 in tl.static_range(0, NP, BN):
                cols = n0 + tl.arange(0, BN)
                ct = tl.load(c_ptr + g * N + r_trow[:, None] * sc + cols[None, :], mask=_mask2(r_step, cols, N, NP),
                             other=0.0)
                if CACHED:
                    hp = tl.load(hr_ptr + st_row[:, None] + cols[None, :], mask=_mask2(st_ok, cols, N, NP),
                                 other=0.0)
                    hb = tl.trans(hp.to(DT))
                elif HOIST:
                    hb = h_all
                else:
                    hb = tl.load(h_ws + (base * NP + cols[:, None]) * PP + rp[None, :])
                acc = _dot(ct, hb, acc, EMULATE, PREC)
            gi = tl.load(gam_ws + base * C + r)
            acc = acc * tl.exp(gi)[:, None]
            # M x over the chunk's columns in blocks of KB, up to the block holding the tile's
            # last row: the later columns of M are exact zeros for every row of the tile
            for kb in range(((t + 1) * BM + KB - 1) // KB):
                k, k_buf, k_step, k_trow, k_brow = _row_tile(kb, start, first, end, tok0, slot, has_state, C, KB)
                incl = k[None, :] <= r[:, None]
                cb = tl.load(cb_ws + ((n.to(tl.int64) * G + g) * C + r[:, None]) * C + k[None, :])
                gk = tl.load(gam_ws + base * C + k)
                dk = tl.load(dt_ws + base * C + k)
                m = tl.where(incl, cb * tl.exp(tl.where(incl, gi[:, None] - gk[None, :], 0.0)) * dk[None, :], 0.0)
                xk = _tile(x_ptr + h * P, sx, bx_ptr + h * P, H * P, k_trow, k_brow, k_step, k_buf, rp, P, PP)
                acc = _dot(m.to(DT), xk, acc, EMULATE, PREC)
            xr = _tile(x_ptr + h * P, sx, bx_ptr + h * P, H * P, r_trow, r_brow, r_step, r_buf, rp, P, PP)
            y = acc + dh * xr.to(tl.float32)
            y = tl.where(y == 0.0, 0.0, y)  # only the sign of an exact zero could tell schedules apart
            tl.store(y_ptr + r_trow[:, None] * (H * P) + h * P + rp[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=_mask2(r_step, rp, P, PP))

    @triton.jit(**_JIT)
    def _ssd_buffer_kernel(
        x_ptr, b_ptr, bx_ptr, bb_ptr, bdt_ptr, slots_ptr,
        start_ptr, first_ptr, end_ptr, tok0_ptr, seqc_ptr, dt_ws, sx, sb,
        H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, C: tl.constexpr,
        XB: tl.constexpr, HB: tl.constexpr, GNB: tl.constexpr,
    ):
        """Programs (sequence, row slice r of R, column block j): when the sequence's last chunk
        stays incomplete, the step's rows of it (first + r, first + r + R, ... < end) into the
        buffer, one row at a time, each the row's x at columns [j XB, (j + 1) XB) of H P (XB
        divides H P), or for the last block its dt (every head, from the prep's workspace) and
        B (every group). Bit copies; a decode step copies its one row per sequence."""
        s = tl.program_id(0)
        j = tl.program_id(2)
        c0 = tl.load(seqc_ptr + s)
        c1 = tl.load(seqc_ptr + s + 1)
        n = tl.maximum(c1 - 1, 0).to(tl.int64)
        start = tl.load(start_ptr + n)
        first = tl.load(first_ptr + n)
        end = tl.load(end_ptr + n)
        stop = tl.where((c1 > c0) & (end - start < C), end, first)  # no rows unless incomplete
        tok = tl.load(tok0_ptr + n) - first  # token index = tok + position
        slot = tl.load(slots_ptr + s).to(tl.int64)
        r0 = first + tl.program_id(1)
        R = tl.num_programs(1)
        if j * XB < H * P:
            cols = j * XB + tl.arange(0, XB)
            for pos in range(r0, stop, R):
                xv = tl.load(x_ptr + (tok + pos).to(tl.int64) * sx + cols)
                tl.store(bx_ptr + (slot * C + pos - start) * (H * P) + cols, xv)
        else:
            hh = tl.arange(0, HB)
            cn = tl.arange(0, GNB)
            for pos in range(r0, stop, R):
                brow = slot * C + pos - start
                dv = tl.load(dt_ws + (n * H + hh) * C + pos - start, mask=hh < H)
                tl.store(bdt_ptr + brow * H + hh, dv, mask=hh < H)
                bv = tl.load(b_ptr + (tok + pos).to(tl.int64) * sb + cn, mask=cn < G * N)
                tl.store(bb_ptr + brow * (G * N) + cn, bv, mask=cn < G * N)


# ---- checks shared by both devices ------------------------------------------------------------

# the state's rows of a partial chunk and the rounded state (aligned mode), as the Triton entry passes them
BUFFERS = ("buf_x", "buf_B", "buf_dt", ROUNDED_STATE)


def _check(x, dt, dt_bias, A_log, B, C, D, md: StateMetadata, state, chunk_size: int, aligned: bool):
    if x.dim() != 3 or B.dim() != 3 or C.shape != B.shape or B.shape[0] != x.shape[0]:
        raise ValueError("expected x [T, H, P] and B, C [T, G, N]")
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G:
        raise ValueError(f"the heads ({H}) must be a multiple of the groups ({G})")
    check_grid(chunk_size, "head_dim and d_state", P, N)
    if dt.shape != (T, H) or dt_bias.shape != (H,) or A_log.shape != (H,) or D.shape != (H,):
        raise ValueError("dt must be [T, H]; dt_bias, A_log and D [H]")
    if B.dtype != x.dtype or C.dtype != x.dtype:
        raise ValueError("x, B and C must share the model dtype")
    for t in (x, B, C, dt):
        if t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) != t.shape[2]):
            raise ValueError("x, B, C and dt need contiguous rows (the row stride is free)")
    Cs = chunk_size
    check_state(md, state, aligned, (H, P, N), "H, P, N",
                {"buf_x": ((Cs, H, P), x.dtype), "buf_B": ((Cs, G, N), x.dtype), "buf_dt": ((Cs, H), torch.float32),
                 ROUNDED_STATE: ((H, P, N), x.dtype)})


# ---- CUDA (Triton) -------------------------------------------------------------------------------

def mamba2_chunk_triton(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                        B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, dt_min: float, md: StateMetadata,
                        state: dict[str, torch.Tensor] | None, *, chunk_size: int = 128,
                        aligned: bool) -> torch.Tensor:
    """The chunked Mamba-2 scan on the step's packed tokens (module docstring).

    x [T, H, P], B, C [T, G, N] in the model dtype and dt [T, H] (before softplus), each with
    contiguous rows at any row stride (views of the projection and conv outputs); dt_bias,
    A_log, D [H]. state: None (no cache: every sequence starts at position 0, nothing is
    written) or the layer's cache tensors by name, indexed by md.slots: "ssm" [slots, H, P,
    N] float32 and, aligned, its copy rounded to the model dtype "ssm_rounded" [slots, H, P,
    N] and the partial-chunk buffer "buf_x" [slots, C, H, P], "buf_B" [slots, C, G, N] (model
    dtype), "buf_dt" [slots, C, H] float32, updated in place.
    Returns y [T, H, P] in the model dtype (D x included). Never syncs with the host beyond
    what md.chunk_plan does (nothing for decode steps)."""
    require_triton(x)
    _check(x, dt, dt_bias, A_log, B, C, D, md, state, chunk_size, aligned)
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    Cs = chunk_size
    y = torch.empty((T, H, P), dtype=x.dtype, device=x.device)
    plan = md.chunk_plan(Cs, aligned)
    NC = plan.num_chunks
    S = md.start_pos.shape[0]
    if NC == 0 or T == 0:
        return y
    x, dt, B, C = (_rows_aligned16(t) for t in (x, dt, B, C))
    dev = x.device
    PP, NP = _next_pow2(P), _next_pow2(N)
    BN = min(NP, BLOCK_N_MAX)
    bm = min(ROW_TILE, Cs)
    bm_cached = min(OUT_CACHED_ROW_TILE, bm)
    if bm % bm_cached:
        raise ValueError(f"OUT_CACHED_ROW_TILE ({OUT_CACHED_ROW_TILE}) must divide ROW_TILE ({ROW_TILE})")
    emulate, prec = dot_mode(x)
    # rows of CB in the row tiles that hold a step's rows only (the rest is never read)
    cb_ws = torch.empty((NC, G, Cs, Cs), dtype=torch.float32, device=dev)
    dt_ws = torch.empty((NC, H, Cs), dtype=torch.float32, device=dev)
    gam_ws = torch.empty((NC, H, Cs), dtype=torch.float32, device=dev)
    # every entry, padding included (zeros there), is written by the state kernel, except for
    # the chunks whose output kernel reads the cached state itself (_reads_cache)
    h_ws = torch.empty((NC, H, NP, PP), dtype=x.dtype, device=dev)

    has_state, ssm, slots, (bx, bb, bdt, hr) = launch_state(md, state, aligned, BUFFERS, (x, B, dt_ws, h_ws), dev)
    launch = dict(enable_fp_fusion=False)
    sx, sb, sc, sdt = x.stride(0), B.stride(0), C.stride(0), dt.stride(0)
    # the state kernel's work list: [count, sequences...] (written by prep's first program)
    work = torch.empty(S + 1, dtype=torch.int32, device=dev)
    _ssd_prep_kernel[(NC, G)](
        B, C, dt, dt_bias, A_log, bb, bdt, slots,
        plan.seq, plan.start, plan.first_new, plan.end, plan.token0, plan.seq_chunks, md.start_pos, work,
        cb_ws, dt_ws, gam_ws, float(dt_min), sb, sc, sdt, has_state, S,
        H=H, G=G, N=N, C=Cs, NP=NP, BN=BN, BM=bm, ALIGNED=bool(aligned), SBLK=WORK_LIST_BLOCK,
        EMULATE=emulate, PREC=prec, num_warps=PREP_NUM_WARPS, num_stages=1, **launch)
    bp_state, bn_state = min(PP, STATE_BLOCK_P_MAX), min(NP, STATE_BLOCK_N_MAX)
    tiles = (PP // bp_state) * (NP // bn_state)
    # a fixed grid (shapes only: CUDA graphs); its programs stride over the listed sequences
    per_pair = min(S, max(1, STATE_PROGRAMS // (H * tiles)))
    _ssd_state_kernel[(H, per_pair, tiles)](
        x, B, bx, bb, ssm, hr, slots, md.start_pos,
        plan.start, plan.first_new, plan.end, plan.token0, plan.seq_chunks, work,
        dt_ws, gam_ws, h_ws, sx, sb, has_state,
        H=H, G=G, P=P, N=N, C=Cs, PP=PP, NP=NP, BP=bp_state, BNS=bn_state,
        ALIGNED=bool(aligned), EMULATE=emulate, PREC=prec, num_warps=STATE_NUM_WARPS, num_stages=STATE_NUM_STAGES,
        **launch)
    # the chunks whose boundary state is the cached one (_reads_cache: aligned mode only; the
    # zero state without a cache), then the others
    for cached in ((True, False) if aligned else (False,)):
        bp_out = min(PP, OUT_CACHED_BLOCK_P_MAX if cached else OUT_BLOCK_P_MAX)
        _ssd_output_kernel[(H, NC, PP // bp_out)](
            x, C, D, y, bx, hr, slots, md.start_pos,
            plan.seq, plan.start, plan.first_new, plan.end, plan.token0, plan.seq_chunks,
            cb_ws, dt_ws, gam_ws, h_ws, sx, sc, has_state,
            H=H, G=G, P=P, N=N, C=Cs, PP=PP, NP=NP, BN=min(NP, OUT_BLOCK_N_MAX), BP=bp_out,
            BM=bm_cached if cached else bm, KB=min(OUT_K_BLOCK, Cs), CACHED=cached,
            ALIGNED=bool(aligned), EMULATE=emulate, PREC=prec,
            num_warps=OUT_CACHED_NUM_WARPS if cached else OUT_NUM_WARPS,
            num_stages=OUT_CACHED_NUM_STAGES if cached else OUT_NUM_STAGES, **launch)
    if aligned and state is not None:
        xb = min(BUFFER_BLOCK_MAX, (H * P) & -(H * P))  # the largest power of two dividing H P, capped
        row_progs = max(1, min(md.max_query_len, Cs - 1, BUFFER_ROW_PROGRAMS))  # a decode step: 1
        _ssd_buffer_kernel[(S, row_progs, H * P // xb + 1)](
            x, B, bx, bb, bdt, slots,
            plan.start, plan.first_new, plan.end, plan.token0, plan.seq_chunks, dt_ws, sx, sb,
            H=H, G=G, P=P, N=N, C=Cs, XB=xb, HB=_next_pow2(H), GNB=_next_pow2(G * N),
            num_warps=BUFFER_NUM_WARPS, **launch)
    return y


# ---- CPU (torch) ---------------------------------------------------------------------------------

def _chunk_torch(xt, bt, ct, dtt, h, L: int, A, Dv, R: int):
    """One chunk as a full C-row tile, all heads at once (every shape fixed by the model's dims
    and C). xt [C, H, P], bt, ct [C, G, N] (model dtype), dtt [C, H] fp32, h [H, P, N] fp32,
    A, Dv [H] fp32, L = last valid row, R = heads per group. Returns (y [C, H, P] fp32, state
    after the chunk's rows <= L)."""
    Cs = xt.shape[0]
    DT = xt.dtype
    xf = xt.float().transpose(0, 1)                              # [H, C, P]
    bg = bt.float().transpose(0, 1)                              # [G, C, N]
    cg = ct.float().transpose(0, 1)
    d = dtt.t()                                                  # [H, C]
    gam = (dtt * A).cumsum(0).t()                                # [H, C]
    idx = torch.arange(Cs, device=xt.device)
    incl = idx[:, None] >= idx[None, :]
    cb = (cg @ bg.transpose(1, 2)).repeat_interleave(R, 0)       # [H, C, C]
    diff = gam[:, :, None] - gam[:, None, :]
    m = torch.where(incl, cb * torch.where(incl, diff, 0.0).exp() * d[:, None, :], 0.0).to(DT).float()
    ch = cg.repeat_interleave(R, 0)                              # [H, C, N]
    hd = h.to(DT).float()
    y = (ch @ hd.transpose(1, 2)) * gam.exp()[:, :, None] + m @ xf + Dv[:, None, None] * xf
    y = torch.where(y == 0, 0.0, y)
    gl = gam[:, L]
    ok = idx <= L
    w = torch.where(ok, torch.where(ok, gl[:, None] - gam, 0.0).exp(), 0.0) * d
    bs = (bg.repeat_interleave(R, 0) * w[:, :, None]).to(DT).float()
    h_new = h * gl.exp()[:, None, None] + xf.transpose(1, 2) @ bs
    return y.transpose(0, 1), h_new


def mamba2_chunk_torch(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                       B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, dt_min: float, md: StateMetadata,
                       state: dict[str, torch.Tensor] | None, *, chunk_size: int = 128,
                       aligned: bool) -> torch.Tensor:
    """The CPU entry: same contract as mamba2_chunk_triton, computed in float32 torch one
    chunk at a time, each chunk a full C-row tile of fixed-shape ops (chunk_scan.scan_chunks_torch)."""
    _check(x, dt, dt_bias, A_log, B, C, D, md, state, chunk_size, aligned)
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = H // G
    y = torch.empty((T, H, P), dtype=x.dtype, device=x.device)
    chunks = host_chunks(md, chunk_size, aligned, state, T)
    if chunks is None:
        return y
    with torch.no_grad():
        dtv = dt_torch(dt, dt_bias, dt_min)
        A = neg_exp_torch(A_log)
        Dv = D.float()
        inputs = ((x, "buf_x"), (B, "buf_B"), (C, None), (dtv, "buf_dt"))
        scan_chunks_torch(chunks, y, inputs, state, (H, P, N), chunk_size, aligned,
                          lambda tiles, h, L: _chunk_torch(*tiles, h, L, A, Dv, R))
    return y


# ---- differentiable reference and the training Function ---------------------------------------

def mamba2_reference(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                     B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, dt_min: float, cu_seqlens,
                     chunk_size: int = 128) -> torch.Tensor:
    """The chunked Mamba-2 scan in plain differentiable torch, over packed sequences that all
    start at position 0 with a zero state. Computes in the inputs' dtype (float32 / float64;
    lower precisions in float32), returns y [T, H, P] in x's dtype. Sequences are padded to
    whole chunks and batched (zero rows change no earlier row); heads stay split as (group,
    head of the group) so C B^T is formed once per group."""
    out_dtype = x.dtype
    acc = reference_dtype(x.dtype)
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = H // G
    Cs = chunk_size
    seqs = PaddedChunks(cu_seqlens, Cs)
    if T == 0 or not seqs.lens:
        return x.new_zeros((T, H, P))
    nC, Pd, S = seqs.num_chunks, seqs.rows, len(seqs.lens)

    def batch(t):  # [T, ...] -> [S, nC, C, ...]
        return seqs.pad(t).reshape(S, nC, Cs, *t.shape[1:])

    dtv = torch.clamp(F.softplus(dt.to(acc) + dt_bias.to(acc)), min=dt_min)
    A = -torch.exp(A_log.to(acc))
    xb = batch(x.to(acc)).reshape(S, nC, Cs, G, R, P).permute(0, 1, 3, 4, 2, 5)   # [S, nC, G, R, C, P]
    bg = batch(B.to(acc)).permute(0, 1, 3, 2, 4)                                   # [S, nC, G, C, N]
    cg = batch(C.to(acc)).permute(0, 1, 3, 2, 4)
    d = batch(dtv).reshape(S, nC, Cs, G, R).permute(0, 1, 3, 4, 2)                 # [S, nC, G, R, C]
    gam = (d * A.view(G, R, 1)).cumsum(-1)
    idx = torch.arange(Cs, device=x.device)
    incl = idx[:, None] >= idx[None, :]
    diff = gam[..., :, None] - gam[..., None, :]
    decay = torch.where(incl, torch.where(incl, diff, 0.0).exp(), 0.0)
    cb = cg @ bg.transpose(-1, -2)                                                   # [S, nC, G, C, C]
    y_diag = (cb[:, :, :, None] * decay * d[..., None, :]) @ xb
    gl = gam[..., -1]                                                                # [S, nC, G, R]
    w = (gl[..., None] - gam).exp() * d
    local = (xb * w[..., None]).transpose(-1, -2) @ bg[:, :, :, None]                # [S, nC, G, R, P, N]
    # every chunk's boundary state at once (no loop over chunks: a handful of large ops for
    # autograd, not nC small ones): h_c = sum_{c' < c} exp(gl_{c'+1} + ... + gl_{c-1}) local_c'.
    # The exponents are sums over each segment (a masked cumsum), not differences of one long
    # cumsum, which would lose a short segment's sum to the rounding of the long ones.
    ci = torch.arange(nC, device=x.device)
    glc = gl.permute(0, 2, 3, 1)                                                     # [S, G, R, nC]
    upto = torch.where(ci[:, None] > ci[None, :], glc[..., :, None], 0.0).cumsum(-2)  # [.., c, c']: c' < i <= c
    seg = torch.cat((torch.zeros_like(upto[..., :1, :]), upto[..., :-1, :]), -2)     # c' < i < c
    Lc = torch.where(ci[:, None] > ci[None, :], torch.where(ci[:, None] > ci[None, :], seg, 0.0).exp(), 0.0)
    h = (Lc @ local.permute(0, 2, 3, 1, 4, 5).reshape(S, G, R, nC, P * N)).reshape(S, G, R, nC, P, N)
    h = h.permute(0, 3, 1, 2, 4, 5)                                                  # [S, nC, G, R, P, N]
    y_off = (cg[:, :, :, None] @ h.transpose(-1, -2)) * gam.exp()[..., None]          # [S, nC, G, R, C, P]
    y = (y_diag + y_off).permute(0, 1, 4, 2, 3, 5).reshape(S, Pd, H, P)
    y = y + D.to(acc)[:, None] * batch(x.to(acc)).reshape(S, Pd, H, P)
    return seqs.unpad(y).to(out_dtype)


class Mamba2ChunkScanFn(torch.autograd.Function):
    """y = fwd(x, dt, dt_bias, A_log, B, C, D, dt_min, md, None): the engine's kernel (so a
    training forward has the rollout's bits); the backward is mamba2_reference's: the fused
    kernels on a GPU, else autograd of the reference recomputed in float32 (float64 for
    float64 inputs). Every sequence starts at 0."""

    @staticmethod
    def forward(ctx, fwd: Callable, x, dt, dt_bias, A_log, B, C, D, dt_min: float, md: StateMetadata,
                chunk_size: int):
        ctx.save_for_backward(x, dt, dt_bias, A_log, B, C, D)
        ctx.dt_min, ctx.cu, ctx.chunk_size = dt_min, md.cu_seqlens, chunk_size
        return fwd(x, dt, dt_bias, A_log, B, C, D, dt_min, md, None)

    @staticmethod
    def backward(ctx, dy):
        needs, xs = ctx.needs_input_grad[1:8], ctx.saved_tensors
        if (any(needs) and dy.is_cuda and dy.dtype != torch.float64 and ctx.chunk_size <= FUSED_MAX_CHUNK
                and fused_backward_ok(xs[0], xs[4])):
            # the fused kernels (mamba2_backward.py): the same gradients, 1.4x faster on the H200
            grads = mamba2_backward_triton(*xs, dy, ctx.dt_min, ctx.cu, ctx.chunk_size)
            grads = [d if n else None for d, n in zip(grads, needs)]
        else:
            grads = reference_grads(lambda *a: mamba2_reference(*a, ctx.dt_min, ctx.cu, ctx.chunk_size), xs,
                                    needs, dy)
        return (None, *grads, None, None, None)
