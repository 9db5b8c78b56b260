"""Paged attention on the CPU, and the float64 reference both implementations are tested against.

* ``paged_attention_cpu``: float32, the SAME tile / split / merge order as
  the Triton kernel in vllm/kernels/attention.py. What the CPU engine and a
  CPU trainer run (in both numerics modes), and its bits are invariant across
  prefill, chunked prefill and decode, batch composition, slot and physical
  block ids.
* ``paged_attention_ref``: plain float64 math (gather the context, causal
  softmax). The correctness reference for tests; no claims about bits.

The torch version is bit-invariant by construction, not by luck of the
backend: torch's CPU matmul / sum / exp may pick kernels (and reduction
orders, or SIMD-body vs scalar-tail code) by shape, alignment and thread
split. So every reduction here is an explicit pairwise tree of elementwise
adds, and exp is computed with elementwise float64 arithmetic
(``_exp_det``). Elementwise IEEE add/mul/div/max on the same inputs give the
same bits however the tensor is shaped, strided or vectorised. It does NOT
reproduce the Triton kernel's bits (different dot and exp arithmetic).
"""
from __future__ import annotations

import math

import torch

from vllm.kernels.attention import KV_SPLIT_SIZE, KV_TILE

# Elements of the largest per-step temporary ([head_dim, kv heads, rows, tiles,
# KV_TILE] fp32). Only affects speed / memory: grouping tiles is invisible
# in the bits because the per-tile recurrence is unchanged.
_TORCH_STEP_ELEMS = 1 << 22
# A sequence with at least this many rows in a tile step uses its own K/V by
# broadcasting instead of a per-row gather (speed only).
_TORCH_BROADCAST_MIN_ROWS = 16

_LOG2E = 1.4426950408889634
# Cody-Waite split of ln 2: _LN2_HI has 32 significant bits so n * _LN2_HI is
# exact for |n| < 2**21.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_EXP_COEFFS = [1.0 / math.factorial(k) for k in range(14)]


def _exp_det(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for fp32 x <= 0 (or -inf), deterministic to the bit.

    Range reduction + degree-13 Taylor polynomial in float64 (relative error
    ~1e-16 before the final rounding to fp32), using only elementwise
    mul/add/round and an exact power-of-two built from the exponent bits.
    """
    xd = x.double().clamp(min=-150.0)  # exp(-150) rounds to +0 in fp32
    n = torch.round(xd * _LOG2E)
    r = (xd - n * _LN2_HI) - n * _LN2_LO  # |r| <= ~0.347
    poly = torch.full_like(r, _EXP_COEFFS[13])
    for c in reversed(_EXP_COEFFS[:13]):
        poly = poly * r + c
    two_n = torch.bitwise_left_shift(n.to(torch.int64) + 1023, 52).view(torch.float64)
    return (poly * two_n).to(torch.float32)


def _tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` (a power-of-two length) as a fixed pairwise tree of
    elementwise adds: element i pairs with i + n/2, level by level."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n & (n - 1):
        raise ValueError("tree reduction needs a power-of-two length")
    while n > 1:
        n //= 2
        x = x.narrow(dim, 0, n) + x.narrow(dim, n, n)
    return x.squeeze(dim)


def _gather_context(cache: torch.Tensor, block_table_row: torch.Tensor, length: int,
                    scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Tokens [0, length) of one sequence: [length, num_kv_heads, head_dim]. An FP8 cache
    (`scale`: its [blocks, block_size, heads] float32 scales) is dequantized to `dtype`
    by vllm.kernels.fp8.dequantize_kv, the formula every reader of the cache uses."""
    block_size = cache.shape[1]
    nblk = -(-length // block_size)
    blocks = block_table_row[:nblk].long()
    out = cache[blocks].reshape(nblk * block_size, *cache.shape[2:])[:length]
    if scale is None:
        return out
    from vllm.kernels.fp8 import dequantize_kv
    s = scale[blocks].reshape(nblk * block_size, *scale.shape[2:])[:length]
    return dequantize_kv(out, s, dtype)


def _seq_bounds(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor):
    cu = cu_seqlens_q.tolist()
    return [(cu[s], cu[s + 1], int(L)) for s, L in enumerate(seq_lens.tolist())]


def paged_attention_ref(
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, out=None, *,
    max_query_len: int, max_seq_len: int | None = None,
    kv_split_size: int = KV_SPLIT_SIZE, decode_parallel_splits: bool | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 causal attention over the gathered context (the reference); an FP8 cache is
    dequantized to q's dtype first.

    Query rows with no KV position to attend to (seq_len 0) give zeros.
    """
    del max_query_len, max_seq_len, kv_split_size, decode_parallel_splits
    num_q_heads = q.shape[1]
    G = num_q_heads // k_cache.shape[2]
    if out is None:
        out = torch.zeros_like(q)
    for s, (start, end, L) in enumerate(_seq_bounds(cu_seqlens_q, seq_lens)):
        n = end - start
        if n <= 0:
            continue
        if L <= 0:
            out[start:end] = 0
            continue
        pos = torch.arange(L - n, L, device=q.device)  # absolute query positions
        k = _gather_context(k_cache, block_table[s], L, k_scale, q.dtype).double().repeat_interleave(G, dim=1)
        v = _gather_context(v_cache, block_table[s], L, v_scale, q.dtype).double().repeat_interleave(G, dim=1)
        qq = q[start:end].double()  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", qq, k) * scale
        causal = torch.arange(L, device=q.device)[None, :] <= pos[:, None]  # [n, L]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible KV
        o = torch.einsum("hnl,lhd->nhd", probs, v)
        out[start:end] = o.to(out.dtype)
    return out


def paged_attention_cpu(
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, out=None, *,
    max_query_len: int, max_seq_len: int | None = None,
    kv_split_size: int = KV_SPLIT_SIZE, decode_parallel_splits: bool | None = None,
) -> torch.Tensor:
    """float32 paged attention in the Triton kernel's tile/split/merge order (an FP8 cache is
    read through its model-dtype copy, vllm/kernels/cache_dequant.py).

    Same signature and semantics as vllm.kernels.attention.paged_attention_triton.
    max_query_len / max_seq_len / decode_parallel_splits are accepted for
    interface compatibility and do not change the arithmetic (parallel and
    sequential decode splits give the same bits by construction, so there is
    one path here). Host-syncs on the metadata: CPU use only.

    All query rows of the batch are processed together, vectorised over
    sequences, kv heads and rows; the Python loops run over splits and tile
    groups of the longest context only. A row whose position lies before a
    tile (a shorter sequence, an earlier query token) simply does not take
    part in that step, which is bit-identical to the kernel's fully masked
    identity step -- so batching cannot change a row's bits.
    """
    del max_query_len, max_seq_len, decode_parallel_splits
    if kv_split_size <= 0 or kv_split_size % KV_TILE:
        raise ValueError(f"kv_split_size must be a positive multiple of KV_TILE={KV_TILE}")
    T = KV_TILE
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    G = num_q_heads // num_kv_heads
    d_pad = 1 << (head_dim - 1).bit_length()  # tree over head_dim needs 2^k
    dev = q.device
    f32 = torch.float32
    neg_inf = float("-inf")
    if out is None:
        out = torch.zeros_like(q)

    # ---- rows: (sequence, query token, head in GQA group), per kv head ----
    live = []  # (batch index, q start, q len, seq_len) of sequences with work
    for s, (start, end, L) in enumerate(_seq_bounds(cu_seqlens_q, seq_lens)):
        n = end - start
        if n <= 0:
            continue  # q_len 0 padding sequence: nothing to write
        if L <= 0:
            out[start:end] = 0  # seq_len 0 padding sequence
            continue
        live.append((s, start, n, L))
    if not live:
        return out
    L_max = max(L for *_, L in live)
    ctx = -(-L_max // T) * T  # padded context length (whole tiles)
    # Contexts, zero past each sequence's length (the kernel's masked loads,
    # other=0, so a tile always has T columns). Layouts put the reduced axis
    # first so every tree level adds two contiguous halves:
    #   Kt [S', D, Hkv, ctx] for scores (reduced over D),
    #   Vt [S', ctx, Hkv, D] for P @ V  (reduced over the tile's T tokens).
    Kt = torch.zeros(len(live), d_pad, num_kv_heads, ctx, dtype=f32, device=dev)
    Vt = torch.zeros(len(live), ctx, num_kv_heads, head_dim, dtype=f32, device=dev)
    q_rows, row_pos, row_seq = [], [], []
    for i, (s, start, n, L) in enumerate(live):
        Kt[i, :head_dim, :, :L] = _gather_context(k_cache, block_table[s], L).to(f32).permute(2, 1, 0)
        Vt[i, :L] = _gather_context(v_cache, block_table[s], L).to(f32)
        # Row r = token * G + g: the kernel's GQA packing.
        q_rows.append(q[start:start + n].to(f32).view(n, num_kv_heads, G, head_dim)
                      .permute(3, 1, 0, 2).reshape(head_dim, num_kv_heads, n * G))
        row_pos.append((L - n + torch.arange(n, device=dev)).repeat_interleave(G))
        row_seq.append(torch.full((n * G,), i, dtype=torch.long, device=dev))
    Qt = torch.cat(q_rows, 2)  # [D, Hkv, R]
    if d_pad != head_dim:
        Qt = torch.nn.functional.pad(Qt, (0, 0, 0, 0, 0, d_pad - head_dim))
    row_pos, row_seq = torch.cat(row_pos), torch.cat(row_seq)
    R = Qt.shape[2]

    M = torch.full((num_kv_heads, R), neg_inf, dtype=f32, device=dev)
    Lsum = torch.zeros(num_kv_heads, R, dtype=f32, device=dev)
    ACC = torch.zeros(num_kv_heads, R, head_dim, dtype=f32, device=dev)

    def tile_step(rows, kg, vg, kpos, nt, m, l, acc):
        """Online softmax over nt tiles for `rows` (global row ids), given
        their K [D, Hkv, rows|1, nt, T] and V [T, Hkv, rows|1, nt, D]."""
        # Scores [Hkv, rows, nt, T]: exact elementwise products, tree sum.
        S = _tree_sum(Qt[:, :, rows, None, None] * kg, 0) * scale
        S = torch.where(kpos[None, None] <= row_pos[rows][None, :, None, None], S, neg_inf)
        m0 = m[:, rows]
        m_run = torch.cummax(torch.cat([m0[..., None], S.amax(-1)], -1), dim=-1).values
        m_prev, m_run = m_run[..., :-1], m_run[..., 1:]
        m_ref = torch.where(m_run == neg_inf, 0.0, m_run)
        alpha = _exp_det(m_prev - m_ref)  # [Hkv, rows, nt]
        P = _exp_det(S - m_ref[..., None])  # [Hkv, rows, nt, T]
        rs = _tree_sum(P, -1)
        PV = _tree_sum(P.permute(3, 0, 1, 2)[..., None] * vg, 0)  # [Hkv, rows, nt, D]
        lc, ac = l[:, rows], acc[:, rows]
        for t in range(nt):  # online softmax, strictly tile by tile
            lc = lc * alpha[..., t] + rs[..., t]
            ac = ac * alpha[..., t, None] + PV[:, :, t]
        l[:, rows], acc[:, rows], m[:, rows] = lc, ac, m_run[..., -1]

    for lo in range(0, L_max, kv_split_size):
        hi = min(lo + kv_split_size, L_max)
        act = (row_pos >= lo).nonzero().squeeze(1)  # rows that see this split
        # Fresh split state (indexed by global row id; only act rows used).
        m = torch.full((num_kv_heads, R), neg_inf, dtype=f32, device=dev)
        l = torch.zeros(num_kv_heads, R, dtype=f32, device=dev)
        acc = torch.zeros(num_kv_heads, R, head_dim, dtype=f32, device=dev)
        t0 = lo
        while t0 < hi:
            rows_all = (row_pos >= t0).nonzero().squeeze(1)  # ascending, grouped by sequence
            # Group nt consecutive tiles and chunk rows to bound the largest
            # temporary; the per-tile recurrence is unchanged by either.
            per_row_tile = num_kv_heads * T * d_pad
            nt = max(1, min(-(-(hi - t0) // T), _TORCH_STEP_ELEMS // (per_row_tile * len(rows_all))))
            t1 = t0 + nt * T
            row_chunk = max(1, _TORCH_STEP_ELEMS // (per_row_tile * nt))
            kpos = t0 + torch.arange(nt * T, device=dev).view(nt, T)
            # Sequences with many rows here (prefill) broadcast their own K/V;
            # the rest (decode rows) gather K/V per row. Same arithmetic.
            seqs, counts = torch.unique_consecutive(row_seq[rows_all], return_counts=True)
            small, off = [], 0
            for i, c in zip(seqs.tolist(), counts.tolist()):
                rows_i = rows_all[off:off + c]
                off += c
                if c < _TORCH_BROADCAST_MIN_ROWS:
                    small.append(rows_i)
                    continue
                kg = Kt[i, :, :, None, t0:t1].unflatten(-1, (nt, T))  # [D, Hkv, 1, nt, T]
                vg = Vt[i, t0:t1].unflatten(0, (nt, T)).permute(1, 2, 0, 3)[:, :, None]  # [T, Hkv, 1, nt, D]
                for c0 in range(0, c, row_chunk):
                    tile_step(rows_i[c0:c0 + row_chunk], kg, vg, kpos, nt, m, l, acc)
            if small:
                small = torch.cat(small)
                for c0 in range(0, len(small), row_chunk):
                    rows = small[c0:c0 + row_chunk]
                    seq_idx = row_seq[rows]
                    kg = Kt[seq_idx, :, :, t0:t1].permute(1, 2, 0, 3).unflatten(-1, (nt, T))
                    vg = Vt[seq_idx, t0:t1].unflatten(1, (nt, T)).permute(2, 3, 0, 1, 4)
                    tile_step(rows, kg, vg, kpos, nt, m, l, acc)
            t0 = t1
        # Merge this split's partial into the running state (kernel's _merge).
        M0, m_j = M[:, act], m[:, act]
        M_new = torch.maximum(M0, m_j)
        M_ref = torch.where(M_new == neg_inf, 0.0, M_new)
        a = _exp_det(M0 - M_ref)
        b = _exp_det(m_j - M_ref)
        Lsum[:, act] = Lsum[:, act] * a + l[:, act] * b
        ACC[:, act] = ACC[:, act] * a[..., None] + acc[:, act] * b[..., None]
        M[:, act] = M_new

    # Finalize (kernel's _finalize): rows with no KV -> 0, canonical +0.
    ok = Lsum > 0
    o = ACC / torch.where(ok, Lsum, 1.0)[..., None]
    o = torch.where(ok[..., None], o, 0.0)
    o = torch.where(o == 0, 0.0, o)
    r = 0
    for s, start, n, L in live:
        out[start:start + n] = (o[:, r:r + n * G].view(num_kv_heads, n, G, head_dim).permute(1, 0, 2, 3)
                                .reshape(n, num_q_heads, head_dim).to(out.dtype))
        r += n * G
    return out
