"""Paged attention with a fixed reduction order (prefill, chunked prefill, decode).

One Triton kernel serves every attention call of the engine. Its promise: the
output bits for one query token (sequence content, absolute position p, head h)
do not depend on how the token was scheduled -- full prefill, any chunk of a
chunked prefill, single-token decode (with or without parallel KV splits) --
nor on the other sequences in the batch, the sequence's slot, its physical
block ids, or padding rows. docs/attention.md explains why each axis cannot
change the bits; the short version:

* KV positions are reduced in tiles of KV_TILE tokens anchored at absolute
  position 0, in increasing order, with an fp32 online softmax.
* Tiles are grouped into splits of ``kv_split_size`` tokens (also anchored at
  0). Every split starts a fresh online softmax; split partials are merged in
  increasing order with one formula (``_merge``). Prefill walks the splits
  inside one program; decode may instead run them as parallel programs plus a
  merge kernel that applies the same ``_merge`` to the same partials.
* Work that a row does not need (tiles/splits past its position, rows padding
  a Q tile) is an exact identity on its state, so the amount of such work --
  which is what differs between schedules -- cannot show in the bits.
* Everything summed goes through ``tl.dot(a, b, acc)`` (including the softmax
  denominator, as a dot with a ones tile), whose per-row bits do not depend on
  the tile height BLOCK_M; fp contraction is disabled so mul/add never fuse
  differently between kernel specialisations.

All tunables live in the block below. KV_TILE and the split size change the
bits (they define the reduction order) and must be the same for every call of
a model -- in the engine AND in the trainer. Everything else (BLOCK_M, warps,
stages, the decode-parallel heuristic) only changes speed.
"""
from __future__ import annotations

import os

import torch

# --------------------------------------------------------------------------
# Tunables (the one place). See docs/attention.md.
# --------------------------------------------------------------------------
# Reduction-order constants: changing either changes the output bits.
KV_TILE = 64  # KV tokens per online-softmax step (power of two, >= 16).
KV_SPLIT_SIZE = 512  # KV tokens per split (multiple of KV_TILE).

# Speed-only constants (the bits do not depend on them), keyed by head_dim.
# Values checked by compiling for sm_90 (Triton 3.9 AOT): no register spills
# except ~88 B for head_dim 256.
# Prefill Q tile height in rows (= query tokens x padded GQA group). Two fp32
# [BLOCK_M, head_dim] accumulators (running + current split) live in
# registers, which is what limits BLOCK_M for head_dim 256.
PREFILL_BLOCK_M = {16: 64, 32: 64, 64: 128, 128: 128, 256: 64}
PREFILL_NUM_WARPS = {16: 4, 32: 4, 64: 8, 128: 8, 256: 8}
PREFILL_NUM_STAGES = {16: 2, 32: 2, 64: 3, 128: 3, 256: 2}
# fp32 caches (tests only on GPU) take the ieee-fp32 dot path: small tiles.
PREFILL_BLOCK_M_FP32 = 16
# Decode: one query token x G heads, padded up to the smallest tl.dot height
# (16 -> mma.sync tiles; prefill's 64/128 rows use wgmma). If an H200 run of
# the GPU invariance tests ever shows decode != prefill bits, set this to
# PREFILL_BLOCK_M's value (decode then runs the same wgmma tile shape; still
# memory-bound).
DECODE_MIN_BLOCK_M = 16
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
MERGE_NUM_WARPS = 4
# Decode runs KV splits as parallel programs when (sequences x kv heads) would
# otherwise leave the GPU idle (H200: 132 SMs) and contexts span >= 2 splits.
DECODE_PARALLEL_MAX_PROGRAMS = 264
# Under TRITON_INTERPRET (CPU tests) smaller prefill tiles keep numpy fast.
INTERPRET_PREFILL_BLOCK_M = 32

# --------------------------------------------------------------------------

try:  # The module must import on machines without Triton (CPU engine).
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    HAS_TRITON = False

# Read once, like triton.jit does when it decides between JIT and interpreter.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


if HAS_TRITON:
    # The combine functions behind tl.sum / tl.max. Under the interpreter,
    # calling tl.sum (itself a jit function) costs milliseconds of patching per
    # call, while tl.reduce with these exact functions maps straight to numpy;
    # used on the EMULATE (interpreter) path only.
    _SUM_COMBINE = tl.standard._sum_combine
    _MAX_COMBINE = tl.standard._elementwise_max

    @triton.jit
    def _merge(M, L, ACC, m, l, acc):
        """Fold split partial (m, l, acc) into the running (M, L, ACC).

        The single merge formula shared by the in-kernel split loop and the
        decode merge kernel. An empty partial (m = -inf, l = 0, acc = 0) is an
        exact identity on a row with finite M (a = 1, b = 0).
        """
        M_new = tl.maximum(M, m)
        M_ref = tl.where(M_new == float("-inf"), 0.0, M_new)
        a = tl.exp2(M - M_ref)
        b = tl.exp2(m - M_ref)
        L = L * a + l * b
        ACC = ACC * a[:, None] + acc * b[:, None]
        return M_new, L, ACC

    @triton.jit
    def _finalize(L, ACC):
        """ACC / L with rows that saw no KV (padding, seq_len 0) set to 0.

        Signed zeros are canonicalised to +0: which zeros an exact identity
        step adds (0 * v vs 0 * 0) can differ between schedules, and that can
        only ever show as the sign of an output that is exactly zero.
        """
        ok = L > 0.0
        L_safe = tl.where(ok, L, 1.0)
        o = tl.math.div_rn(ACC, L_safe[:, None])
        o = tl.where(ok[:, None], o, 0.0)
        return tl.where(o == 0.0, 0.0, o)

    @triton.jit
    def _paged_attn_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, seqlen_ptr,
        ws_acc_ptr, ws_ml_ptr,
        qk_scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_bt,
        num_kv_heads, max_splits,
        G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, KV_TILE: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, WRITE_PARTIALS: tl.constexpr,
        EMULATE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One program per (q tile | split, sequence, kv head).

        Rows of the Q tile are (query token, head in GQA group) pairs:
        row r -> token r // G_PAD, head r % G_PAD, so one KV tile load serves
        all G query heads that share the kv head.

        WRITE_PARTIALS=False: axis 0 is the Q tile; all splits are walked and
        merged in order, the final output is written.
        WRITE_PARTIALS=True (decode only, BLOCK_Q == 1): axis 0 is the split;
        the split partial (m, l, acc) goes to the fp32 workspace and
        _merge_splits_kernel finishes.
        """
        pid0 = tl.program_id(0)
        seq = tl.program_id(1)
        kvh = tl.program_id(2)

        q_start = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - q_start
        seq_len = tl.load(seqlen_ptr + seq)
        if WRITE_PARTIALS:
            qt = 0
        else:
            qt = pid0
        # KV range this Q tile needs: up to its last row's position.
        kv_end = tl.minimum(seq_len, seq_len - q_len + tl.minimum(q_len, (qt + 1) * BLOCK_Q))
        # Q tiles past this sequence's queries (and q_len == 0 padding
        # sequences) have nothing to do; neither do decode splits past the
        # context (the merge kernel never reads them). One top-level return.
        done = qt * BLOCK_Q >= q_len
        if WRITE_PARTIALS:
            done = done | (pid0 * SPLIT >= kv_end)
        if done:
            return

        rows = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        tok = qt * BLOCK_Q + rows // G_PAD
        hh = rows % G_PAD
        row_ok = (rows // G_PAD < BLOCK_Q) & (tok < q_len) & (hh < G)
        head = kvh * G + hh
        # Absolute position of each query row; -1 masks every KV position.
        row_pos = tl.where(row_ok, seq_len - q_len + tok, -1)
        q_row = (q_start + tok).to(tl.int64)
        q = tl.load(
            q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None], other=0.0)

        bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        offs_t = tl.arange(0, KV_TILE)
        # The softmax denominator is a dot with a ones tile rather than
        # tl.sum(p, 1): tl.sum's cross-thread order follows the register
        # layout, which changes with BLOCK_M / num_warps; the dot's per-row
        # bits do not. Built in fp32 and cast (1.0 is exact in every dtype):
        # a bf16 tl.full has no constant builder in some Triton interpreters.
        ones = tl.full([KV_TILE, 16], 1.0, tl.float32).to(q_ptr.dtype.element_ty)

        if WRITE_PARTIALS:
            split_lo = pid0 * SPLIT
            split_hi = split_lo + 1  # exactly this program's split
        else:
            split_lo = 0
            split_hi = kv_end  # every split, in increasing order
        # Running state across splits (unused when writing partials).
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.full([BLOCK_M], 0.0, tl.float32)
        ACC = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
        for lo in range(split_lo, split_hi, SPLIT):
            # ---- one split: fresh online softmax over tiles [lo, hi) ----
            # lo is a multiple of SPLIT (hence of KV_TILE): tiles are
            # anchored at absolute position 0 whatever the schedule.
            hi = tl.minimum(lo + SPLIT, kv_end)
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_acc = tl.full([BLOCK_M, 16], 0.0, tl.float32)
            acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
            for start in tl.range(lo, hi, KV_TILE):
                pos = start + offs_t
                # Positions beyond the context are never read: their
                # block-table entry may be anything and their cache slots may
                # hold NaN. other=0 keeps masked K/V finite.
                in_ctx = pos < seq_len
                blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
                slot = (pos % BLOCK_SIZE).to(tl.int64)
                k = tl.load(
                    k_base + blk[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :],
                    mask=in_ctx[:, None], other=0.0)
                v = tl.load(
                    v_base + blk[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :],
                    mask=in_ctx[:, None], other=0.0)
                # The interpreter's tl.dot is np.matmul, whose per-element
                # bits change with the row count (BLAS kernel choice) and
                # which mishandles bf16: emulate dots there with exact fp32
                # products summed in a fixed, shape-independent order.
                if EMULATE:
                    s = tl.reduce(q.to(tl.float32)[:, :, None] * tl.trans(k).to(tl.float32)[None, :, :],
                                  1, _SUM_COMBINE)
                else:
                    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
                s = s * qk_scale
                # Causal mask per row; padding rows have row_pos = -1.
                s = tl.where(pos[None, :] <= row_pos[:, None], s, float("-inf"))
                if EMULATE:
                    tile_max = tl.reduce(s, 1, _MAX_COMBINE)
                else:
                    tile_max = tl.max(s, axis=1)
                m_new = tl.maximum(m, tile_max)
                # A row with nothing unmasked yet keeps m = -inf: use 0 as
                # the reference so no (-inf) - (-inf) NaN appears. A fully
                # masked tile for a row with finite m gives alpha = exp2(0) = 1
                # and p = 0, so (m, l, acc) stay bit-identical: tiles a row
                # does not need are invisible in its bits.
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_ref)
                p = tl.exp2(s - m_ref[:, None]).to(v.dtype)
                if EMULATE:
                    pf = p.to(tl.float32)[:, :, None]
                    l_sum = tl.reduce(pf * ones.to(tl.float32)[None, :, :], 1, _SUM_COMBINE)
                    l_acc = l_acc * alpha[:, None] + l_sum
                    acc = acc * alpha[:, None] + tl.reduce(pf * v.to(tl.float32)[None, :, :], 1, _SUM_COMBINE)
                else:
                    # The fused tl.dot(a, b, acc) form: bit-identical across
                    # BLOCK_M on H200, unlike acc += tl.dot(a, b).
                    l_acc = tl.dot(p, ones, l_acc * alpha[:, None], input_precision=PRECISION)
                    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
                m = m_new
            # All 16 columns of l_acc hold the same sum; max extracts it exactly.
            if EMULATE:
                l = tl.reduce(l_acc, 1, _MAX_COMBINE)
            else:
                l = tl.max(l_acc, axis=1)
            # ---- split partial (m, l, acc) done ----
            if WRITE_PARTIALS:
                # Workspace [seq, kv head, split, BLOCK_M (, HEAD_DIM)] fp32:
                # all BLOCK_M rows are stored so the merge reads full tiles.
                ws_row = ((seq.to(tl.int64) * num_kv_heads + kvh) * max_splits + pid0) * BLOCK_M + rows
                tl.store(ws_ml_ptr + ws_row * 2, m)
                tl.store(ws_ml_ptr + ws_row * 2 + 1, l)
                tl.store(ws_acc_ptr + ws_row[:, None] * HEAD_DIM + offs_d[None, :], acc)
            else:
                M, L, ACC = _merge(M, L, ACC, m, l, acc)
        if not WRITE_PARTIALS:
            o = _finalize(L, ACC)
            tl.store(
                out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _merge_splits_kernel(
        out_ptr, cu_ptr, seqlen_ptr, ws_acc_ptr, ws_ml_ptr,
        stride_ot, stride_oh, num_kv_heads, max_splits,
        G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """Decode epilogue: merge the split partials of one (sequence, kv head)
        in increasing split order with the same _merge/_finalize, on the same
        [BLOCK_M, HEAD_DIM] row layout, as the sequential decode kernel."""
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        q_start = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - q_start
        seq_len = tl.load(seqlen_ptr + seq)
        if q_len <= 0:
            return
        rows = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        hh = rows % G_PAD
        row_ok = (rows // G_PAD < 1) & (hh < G)
        head = kvh * G + hh
        # Same expression as the partial kernel (BLOCK_Q = 1).
        kv_end = tl.minimum(seq_len, seq_len - q_len + tl.minimum(q_len, 1))
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.full([BLOCK_M], 0.0, tl.float32)
        ACC = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
        base = (seq.to(tl.int64) * num_kv_heads + kvh) * max_splits
        # max_seq_len (hence max_splits) must bound seq_len; the clamp only
        # keeps a violated bound from reading past the workspace.
        n_splits = tl.minimum((kv_end + SPLIT - 1) // SPLIT, max_splits)
        for j in range(0, n_splits):
            ws_row = (base + j) * BLOCK_M + rows
            m = tl.load(ws_ml_ptr + ws_row * 2)
            l = tl.load(ws_ml_ptr + ws_row * 2 + 1)
            acc = tl.load(ws_acc_ptr + ws_row[:, None] * HEAD_DIM + offs_d[None, :])
            M, L, ACC = _merge(M, L, ACC, m, l, acc)
        o = _finalize(L, ACC)
        q_row = q_start.to(tl.int64)
        tl.store(
            out_ptr + q_row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _check_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, kv_split_size):
    """Shape/dtype checks on metadata only (no device sync)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("expected q [T, Hq, D] and k/v caches [blocks, block_size, Hkv, D]")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError("q and kv cache head_dim differ")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError("num_q_heads must be a multiple of num_kv_heads")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError("head_dim must be a power of two >= 16")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError("block_size must be a power of two")
    if kv_split_size <= 0 or kv_split_size % KV_TILE != 0:
        raise ValueError(f"kv_split_size must be a positive multiple of KV_TILE={KV_TILE}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError("q, k_cache and v_cache must share a dtype")
    if block_table.dtype != torch.int32 or cu_seqlens_q.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_table, cu_seqlens_q and seq_lens must be int32")
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1 or block_table.shape[0] < seq_lens.shape[0]:
        raise ValueError("cu_seqlens_q must be [S+1] and block_table [>=S, max_blocks]")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous in its last dim")


def use_decode_parallel_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int | None,
                               kv_split_size: int = KV_SPLIT_SIZE) -> bool:
    """Shape-only heuristic: parallel KV splits for few (sequence, kv head)
    pairs with contexts spanning >= 2 splits. Either choice gives the same
    bits; this only decides speed."""
    if max_seq_len is None or _cdiv(max_seq_len, kv_split_size) < 2:
        return False
    return num_seqs * num_kv_heads < DECODE_PARALLEL_MAX_PROGRAMS


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int,
    max_seq_len: int | None = None,
    kv_split_size: int = KV_SPLIT_SIZE,
    decode_parallel_splits: bool | None = None,
) -> torch.Tensor:
    """Causal paged attention; see module docstring and docs/attention.md.

    An FP8 cache is read through its model-dtype copy (vllm/kernels/cache_dequant.py):
    the caches here are in q's dtype.

    q [T, Hq, D] packed by cu_seqlens_q [S+1]; seq_lens [S] = context length
    including the query tokens; k/v caches [num_blocks, block_size, Hkv, D];
    block_table [S, max_blocks] int32. max_query_len / max_seq_len are host
    ints (upper bounds) that size the grid, so the call never syncs and is
    CUDA-graph capturable. max_query_len == 1 selects the decode path;
    max_seq_len is required for parallel decode splits.

    Returns out [T, Hq, D] in q's dtype. Rows of sequences with q_len 0 are
    not written; rows of sequences with no KV (seq_len 0) are zero; when
    ``out`` is None, rows past cu_seqlens_q[-1] are zero.

    Needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before
    triton was imported (tests). The CPU engine runs
    vllm.kernels.attention_cpu.paged_attention_cpu instead (same tile / split /
    merge order and invariances, not this kernel's bits): the numerics table
    (vllm/kernels/numerics_table.py) picks by device, so an engine and a trainer
    on the same device type always agree."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if not q.is_cuda and not _INTERPRET:
        raise RuntimeError("CPU tensors need TRITON_INTERPRET=1 (set before importing triton)")
    _check_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, kv_split_size)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.zeros_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError("out must match q's shape and be contiguous in head_dim")
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out

    G = num_q_heads // num_kv_heads
    G_PAD = _next_pow2(G)
    is_decode = max_query_len == 1
    if decode_parallel_splits is None:
        decode_parallel_splits = is_decode and use_decode_parallel_splits(
            num_seqs, num_kv_heads, max_seq_len, kv_split_size)
    if decode_parallel_splits and (not is_decode or max_seq_len is None):
        raise ValueError("parallel splits need max_query_len == 1 and max_seq_len")

    if is_decode:
        block_q = 1
        block_m = max(DECODE_MIN_BLOCK_M, G_PAD)
        num_warps, num_stages = DECODE_NUM_WARPS, DECODE_NUM_STAGES
    else:
        if _INTERPRET:
            base_m = INTERPRET_PREFILL_BLOCK_M
        elif q.dtype == torch.float32:
            base_m = PREFILL_BLOCK_M_FP32
        else:
            base_m = PREFILL_BLOCK_M.get(head_dim, 64)
        # Short queries (spec decode, small chunks) get a shorter Q tile;
        # BLOCK_M never changes the bits, only wasted rows.
        block_q = max(1, min(max(base_m, G_PAD) // G_PAD, _next_pow2(max_query_len)))
        block_m = max(DECODE_MIN_BLOCK_M, block_q * G_PAD)
        num_warps = PREFILL_NUM_WARPS.get(head_dim, 4)
        num_stages = PREFILL_NUM_STAGES.get(head_dim, 2)

    # log2-domain scores: exp2 is the native instruction.
    qk_scale = float(scale) * 1.4426950408889634
    emulate = _INTERPRET or not q.is_cuda
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    common = dict(G=G, G_PAD=G_PAD, BLOCK_M=block_m, HEAD_DIM=head_dim)
    launch = dict(num_warps=num_warps, num_stages=num_stages,
                  # Keep every mul/add a separately rounded op: FMA contraction
                  # is a compiler choice that may differ between
                  # specialisations (prefill vs decode vs merge kernel).
                  enable_fp_fusion=False)

    if decode_parallel_splits:
        max_splits = max(1, _cdiv(max_seq_len, kv_split_size))
        ws_acc = torch.empty((num_seqs, num_kv_heads, max_splits, block_m, head_dim),
                             dtype=torch.float32, device=q.device)
        ws_ml = torch.empty((num_seqs, num_kv_heads, max_splits, block_m, 2),
                            dtype=torch.float32, device=q.device)
        grid = (max_splits, num_seqs, num_kv_heads)
    else:
        max_splits = 1
        ws_acc = ws_ml = out  # unused placeholders (never dereferenced)
        grid = (_cdiv(max_query_len, block_q), num_seqs, num_kv_heads)

    _paged_attn_kernel[grid](
        out, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens,
        ws_acc, ws_ml,
        qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        num_kv_heads, max_splits,
        BLOCK_Q=block_q, KV_TILE=KV_TILE, SPLIT=kv_split_size, BLOCK_SIZE=block_size,
        WRITE_PARTIALS=bool(decode_parallel_splits), EMULATE=emulate, PRECISION=precision,
        **common, **launch,
    )
    if decode_parallel_splits:
        _merge_splits_kernel[(num_seqs, num_kv_heads)](
            out, cu_seqlens_q, seq_lens, ws_acc, ws_ml,
            out.stride(0), out.stride(1), num_kv_heads, max_splits,
            SPLIT=kv_split_size, **common,
            num_warps=MERGE_NUM_WARPS, num_stages=1, enable_fp_fusion=False,
        )
    return out
