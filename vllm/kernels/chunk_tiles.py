"""What the chunked recurrence kernels share (Gated DeltaNet: gdn_chunk.py; Mamba-2:
mamba2_chunk.py): the Triton import guard, the one-compiled-kernel-per-model jit options,
the tensor-core dot (emulated in fp32 under the interpreter), padded-column masks, and where
a chunk's rows come from (the step's tokens or the rows of a partial chunk the state kept,
ChunkPlan in vllm/forward_context.py)."""
from __future__ import annotations

import inspect
import os

import torch

try:  # the kernel modules must import on machines without Triton (CPU engine)
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False

# Read once, like triton.jit does when it decides between JIT and interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """t contiguous at a 16-byte aligned address. Triton specialises a kernel on pointer
    alignment, which can change the register layouts its reductions run in: every call
    gets the aligned specialisation, so every call runs one compiled kernel."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def rows_aligned16(t: torch.Tensor) -> torch.Tensor:
    """[T, ...] with rows contiguous inside, 16-byte aligned and a multiple of 16 elements apart:
    t itself where it already is (a view of a wider projection row, read at its row stride),
    else a copy into rows padded to a multiple of 16 elements. Every call then passes the
    kernels an aligned pointer and a row stride Triton specialises as divisible by 16, whatever
    the step: a [1, ...] step's row stride is arbitrary (torch keeps or resets it as it likes)
    and a plain contiguous copy's would be the row's width, which need not be divisible by 16
    when the view's stride is; either would compile another kernel, with its own reductions."""
    if t.dim() < 2 or t.numel() == 0:
        return aligned16(t)
    inner = t[0]
    if t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 and inner.is_contiguous():
        return t
    width = inner.numel()
    padded = -(-width // 16) * 16
    inner_strides = torch.empty(t.shape[1:], device="meta").stride()
    out = torch.empty((t.shape[0], padded), dtype=t.dtype, device=t.device)
    out = out.as_strided(t.shape, (padded, *inner_strides))
    return out.copy_(t)


if HAS_TRITON:
    # One compiled kernel per model, whatever the step: `has_state` (0 for the trainer, 1 for
    # the engine) is not specialised on, and neither is the alignment of the int32 metadata
    # (ChunkPlan's fields are views at offsets that depend on the chunk count; they are only
    # read as scalars). Data tensors are always passed 16-byte aligned (`aligned16`).
    JIT_OPTIONS = {"do_not_specialize": ["has_state"]}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        JIT_OPTIONS["do_not_specialize_on_alignment"] = [
            "slots_ptr", "seq_ptr", "start_ptr", "first_ptr", "end_ptr", "tok0_ptr", "seqc_ptr", "start_pos_ptr"]

    @triton.jit
    def dot_rows(a, b, acc, EMULATE: tl.constexpr, PREC: tl.constexpr):
        """acc + a @ b with fp32 accumulation, for kernels that compute the same row in tiles
        of different row counts (a decode path's few rows, a prefill's whole chunk). On the GPU
        it is tl.dot at PREC: a tl.dot row's bits do not depend on the tile's row or column
        count (measured on the H200 with an fp32 accumulator, mma.sync and wgmma alike). Under
        the interpreter (EMULATE) tl.dot is np.matmul, whose BLAS kernels round a row
        differently as the row count changes (and differently across numpy releases), so there
        every element is summed over K (a power of two) by one fixed binary tree, from fp32
        copies of the operands (the interpreter keeps bf16 as raw uint16)."""
        if EMULATE:
            M: tl.constexpr = a.shape[0]
            N: tl.constexpr = b.shape[1]
            p = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
            for lvl in tl.static_range(1, 17):
                half: tl.constexpr = a.shape[1] >> lvl
                if half > 0:
                    # pairs (j, j + half): x + y rounds as y + x, whatever order numpy takes
                    p = tl.sum(tl.reshape(p, [M, 2, half, N]), 1)
            return acc + tl.reshape(p, [M, N])
        else:
            return tl.dot(a, b, acc, input_precision=PREC)

    @triton.jit
    def row_tile(t, start, first, end, tok0, slot, has_state, C: tl.constexpr, BM: tl.constexpr):
        """Rows t * BM .. t * BM + BM - 1 of a chunk (chunk_rows for one row tile):
        the rows, which come from the buffer or the step, their token and buffer rows."""
        r = t * BM + tl.arange(0, BM)
        pos = start + r
        from_buf = (pos < first) & (has_state != 0)
        from_step = (pos >= first) & (pos < end)
        trow = (tok0 - first + pos).to(tl.int64)
        brow = slot * C + r
        return r, from_buf, from_step, trow, brow

    @triton.jit
    def unit_lower_inverse(N, EMULATE: tl.constexpr):
        """(I + N)^-1 of a strictly lower DB x DB block N (DB a power of two), as the product
        (I - N)(I + N^2)(I + N^4)... (N^DB = 0): 3xTF32 dots only (unit_lower_block_row)."""
        DB: tl.constexpr = N.shape[0]
        r = tl.arange(0, DB)
        P = tl.where(r[:, None] == r[None, :], 1.0, 0.0) - N                 # I - N
        Np = N
        for lvl in tl.static_range(1, 16):
            if (DB >> lvl) > 1:
                Np = dot_rows(Np, Np, tl.zeros([DB, DB], dtype=tl.float32), EMULATE, "tf32x3")
                P = dot_rows(P, Np, P, EMULATE, "tf32x3")                    # P (I + N^(2^lvl))
        return P

    @triton.jit
    def dot_rows3(a, b, acc, EMULATE: tl.constexpr, PREC: tl.constexpr):
        """dot_rows of batched operands, [B, M, K] x [B, K, N]: each batch's rows get the bits
        dot_rows gives the same operands alone (on the GPU one mma schedule per tile; under
        EMULATE the same fixed tree over K)."""
        if EMULATE:
            B: tl.constexpr = a.shape[0]
            M: tl.constexpr = a.shape[1]
            N: tl.constexpr = b.shape[2]
            p = a.to(tl.float32)[:, :, :, None] * b.to(tl.float32)[:, None, :, :]
            for lvl in tl.static_range(1, 17):
                half: tl.constexpr = a.shape[2] >> lvl
                if half > 0:
                    p = tl.sum(tl.reshape(p, [B, M, 2, half, N]), 2)
            return acc + tl.reshape(p, [B, M, N])
        else:
            return tl.dot(a, b, acc, input_precision=PREC)

    @triton.jit
    def unit_lower_inverses(N3, EMULATE: tl.constexpr):
        """unit_lower_inverse of every strictly lower DB x DB block of N3 [B, DB, DB], side by
        side: one chain of batched dots instead of B chains one after the other, each block's
        entries with the bits unit_lower_inverse gives it alone."""
        DB: tl.constexpr = N3.shape[1]
        r = tl.arange(0, DB)
        P = tl.where(r[:, None] == r[None, :], 1.0, 0.0)[None, :, :] - N3      # I - N
        Np = N3
        for lvl in tl.static_range(1, 16):
            if (DB >> lvl) > 1:
                Np = dot_rows3(Np, Np, tl.zeros(N3.shape, dtype=tl.float32), EMULATE, "tf32x3")
                P = dot_rows3(P, Np, P, EMULATE, "tf32x3")                     # P (I + N^(2^lvl))
        return P

    @triton.jit
    def invert_diagonal_blocks_in_place(ws, b_first, DB: tl.constexpr, C: tl.constexpr, EMULATE: tl.constexpr):
        """Overwrites the DB x DB diagonal blocks b_first .. C / DB - 1 of the strictly lower
        C x C matrix A in the float32 row-major workspace `ws` (stored by every thread before a
        barrier) with their inverses (I + A[b, b])^-1, all at once (unit_lower_inverses), for
        unit_lower_block_row_in_place(diag_inverted=True). The inverses of the blocks do not
        depend on each other: a whole chunk's block rows then wait on one chain of dots, not on
        one per block row."""
        NB: tl.constexpr = C // DB
        blk = tl.arange(0, NB)[:, None, None]
        r = tl.arange(0, DB)
        ptrs = ws + (blk * DB + r[None, :, None]) * C + blk * DB + r[None, None, :]
        todo = (blk >= b_first) & (r >= 0)[None, :, None] & (r >= 0)[None, None, :]
        P3 = unit_lower_inverses(tl.load(ptrs, mask=todo, other=0.0), EMULATE)
        tl.debug_barrier()  # every thread's reads of the blocks precede their overwrite
        tl.store(ptrs, P3, mask=todo)
        tl.debug_barrier()  # the inverses' stores precede every thread's reads of them

    @triton.jit
    def unit_lower_block_row(Ab, Tprev, bi, DB: tl.constexpr, EMULATE: tl.constexpr):
        """Block row bi (rows bi DB .. bi DB + DB - 1) of T = (I + A)^-1 for a strictly lower
        C x C matrix A, from Ab, A's rows of the block [DB, C], and Tprev, T's rows before
        the block ([C, C], zero rows from bi DB on). The diagonal block is (I + N)^-1 of N,
        A's DB x DB diagonal block, as the product (I - N)(I + N^2)(I + N^4)... (N^DB = 0);
        the rest is T[b, :b] = -T[b, b] (A[b, :b] T[:b, :b]). Only dots (3xTF32; under
        EMULATE dot_rows' fixed-tree float32 sums) and exact copies: their bits depend on
        the operands' values and shapes alone, so every path that computes a block row from
        the same rows of A and T gets the same bits, however it got them (registers, the T
        cache) and whatever else it computes. Row i of the
        block reads A's rows <= i (the others enter multiplied by exact zeros), so a zero
        row of A (past a chunk's last row) gives the row e_i. No entry is -0."""
        C: tl.constexpr = Ab.shape[1]
        NB: tl.constexpr = C // DB
        cols = tl.arange(0, C)
        sel = tl.arange(0, NB)[None, :, None] == bi
        P = unit_lower_inverse(tl.sum(tl.where(sel, tl.reshape(Ab, (DB, NB, DB)), 0.0), 1), EMULATE)  # A[b, b]: a copy
        X = dot_rows(tl.where(cols[None, :] < bi * DB, Ab, 0.0), Tprev, tl.zeros([DB, C], dtype=tl.float32),
                     EMULATE, "tf32x3")
        # 0 - x: no -0 (X's columns from bi DB on are exact zeros)
        Y = 0.0 - dot_rows(P, X, tl.zeros([DB, C], dtype=tl.float32), EMULATE, "tf32x3")
        diag = tl.reshape(tl.where(sel, P[:, None, :], 0.0), (DB, C))
        return tl.where(cols[None, :] < bi * DB, Y, diag)

    @triton.jit
    def unit_lower_block_row_in_place(ws, bi, diag_inverted, DB: tl.constexpr, C: tl.constexpr,
                                      EMULATE: tl.constexpr):
        """Block row bi of T = (I + A)^-1 (A strictly lower, C x C) in a float32 row-major
        [C, C] workspace `ws` of this program that holds T's rows before the block and A's rows
        of the block (stored by every thread before a barrier). Overwrites the block's rows of A
        with T's and returns them ([DB, C]). The diagonal block as in unit_lower_block_row, or,
        where diag_inverted (runtime), as invert_diagonal_blocks_in_place already left it (the
        same bits); the
        rest T[b, :b] = -T[b, b] sum_{m < b} A[b, m] T[m, :], the sum chained over m in
        increasing order from the workspace's DB x DB blocks of A and block rows of T: dots of K
        DB over the b blocks before the diagonal only (unit_lower_block_row multiplies the
        block's rows of A by all of T's rows, a K of C). Dots and exact copies only, as there;
        no entry is -0."""
        r = tl.arange(0, DB)
        cols = tl.arange(0, C)
        rb = bi * DB + r
        Pd = tl.load(ws + rb[:, None] * C + (bi * DB + r)[None, :])   # A[b, b] (a copy), or its inverse
        if diag_inverted:
            P = Pd
        else:
            P = unit_lower_inverse(Pd, EMULATE)
        X = tl.zeros([DB, C], dtype=tl.float32)
        for m in range(0, bi):
            Am = tl.load(ws + rb[:, None] * C + (m * DB + r)[None, :])
            Tm = tl.load(ws + (m * DB + r)[:, None] * C + cols[None, :])
            X = dot_rows(Am, Tm, X, EMULATE, "tf32x3")
        # 0 - x: no -0 (X's columns from bi DB on are exact zeros, as T's rows before the block are)
        Y = 0.0 - dot_rows(P, X, tl.zeros([DB, C], dtype=tl.float32), EMULATE, "tf32x3")
        tl.debug_barrier()  # every thread's reads of the block's rows of A precede their overwrite
        off_diag = (cols < bi * DB) | (cols >= bi * DB + DB)
        tl.store(ws + rb[:, None] * C + cols[None, :], Y, mask=(r >= 0)[:, None] & off_diag[None, :])
        tl.store(ws + rb[:, None] * C + (bi * DB + r)[None, :], P)
        tl.debug_barrier()  # the block row's stores precede every thread's reads of it
        return tl.load(ws + rb[:, None] * C + cols[None, :])

    @triton.jit
    def mask2(row_ok, cols, N: tl.constexpr, NP: tl.constexpr):
        """row_ok x (cols < N). The column test only where the dim is padded (N < NP): a mask
        constant along the row keeps the loads vectorised (without it every element gets its
        own 64-bit pointer and the prep kernels spill)."""
        if N == NP:
            return row_ok[:, None]
        else:
            return row_ok[:, None] & (cols < N)[None, :]

    @triton.jit
    def tile_rows(step_ptr, step_row, buf_ptr, buf_row, trow, brow, from_step, from_buf, cols,
                  N: tl.constexpr, NP: tl.constexpr):
        """A chunk's [C, cols] tile: the step's tokens where from_step, the kept rows of the
        sequence's partial chunk where from_buf, zeros elsewhere (bit copies either way)."""
        a = tl.load(step_ptr + trow[:, None] * step_row + cols[None, :], mask=mask2(from_step, cols, N, NP),
                    other=0.0)
        b = tl.load(buf_ptr + brow[:, None] * buf_row + cols[None, :], mask=mask2(from_buf, cols, N, NP),
                    other=0.0)
        return tl.where(from_buf[:, None], b, a)

    @triton.jit
    def chunk_rows(n, seq_ptr, start_ptr, first_ptr, end_ptr, tok0_ptr, slots_ptr, has_state, C: tl.constexpr):
        """Chunk n's sequence, its rows and where each comes from: the buffer row of the
        sequence's slot (rows before the step's first token) or the step's token index."""
        s = tl.load(seq_ptr + n)
        start = tl.load(start_ptr + n)
        first = tl.load(first_ptr + n)
        end = tl.load(end_ptr + n)
        tok0 = tl.load(tok0_ptr + n)
        rows = tl.arange(0, C)
        pos = start + rows
        from_buf = (pos < first) & (has_state != 0)
        from_step = (pos >= first) & (pos < end)
        trow = (tok0 - first + pos).to(tl.int64)
        slot = tl.load(slots_ptr + s, mask=has_state != 0, other=0).to(tl.int64)
        brow = slot * C + rows
        return s, start, end, rows, from_buf, from_step, trow, brow, slot
