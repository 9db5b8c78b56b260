"""Pure-torch paged attention: a float64 reference and the CPU implementation.

* ``paged_attention_ref``: plain float64 math (gather the context, causal
  softmax). The correctness reference for tests; no claims about bits.
* ``paged_attention_torch``: float32, the SAME tile / split / merge order as
  the Triton kernel in vllm/kernels/attention.py. The CPU engine uses it when
  Triton is unavailable, and its bits are invariant across prefill, chunked
  prefill and decode, batch composition, slot and physical block ids.

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

# Elements of the largest per-step temporary ([kv heads, rows, tiles, KV_TILE,
# head_dim] fp32). Only affects speed / memory: grouping tiles is invisible
# in the bits because the per-tile recurrence is unchanged.
_TORCH_STEP_ELEMS = 1 << 22

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


def _gather_context(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens [0, length) of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    nblk = -(-length // block_size)
    blocks = block_table_row[:nblk].long()
    return cache[blocks].reshape(nblk * block_size, *cache.shape[2:])[:length]


def _seq_bounds(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor):
    cu = cu_seqlens_q.tolist()
    return [(cu[s], cu[s + 1], int(L)) for s, L in enumerate(seq_lens.tolist())]


def paged_attention_ref(
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, out=None, *,
    max_query_len: int, max_seq_len: int | None = None,
    kv_split_size: int = KV_SPLIT_SIZE, decode_parallel_splits: bool | None = None,
) -> torch.Tensor:
    """float64 causal attention over the gathered context (the reference).

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
        k = _gather_context(k_cache, block_table[s], L).double().repeat_interleave(G, dim=1)
        v = _gather_context(v_cache, block_table[s], L).double().repeat_interleave(G, dim=1)
        qq = q[start:end].double()  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", qq, k) * scale
        causal = torch.arange(L, device=q.device)[None, :] <= pos[:, None]  # [n, L]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible KV
        o = torch.einsum("hnl,lhd->nhd", probs, v)
        out[start:end] = o.to(out.dtype)
    return out


def paged_attention_torch(
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, out=None, *,
    max_query_len: int, max_seq_len: int | None = None,
    kv_split_size: int = KV_SPLIT_SIZE, decode_parallel_splits: bool | None = None,
) -> torch.Tensor:
    """float32 paged attention in the Triton kernel's tile/split/merge order.

    Same signature and semantics as vllm.kernels.attention.paged_attention.
    max_query_len / max_seq_len / decode_parallel_splits are accepted for
    interface compatibility and do not change the arithmetic (parallel and
    sequential decode splits are the same bits by construction, so there is
    only one path here). Host-syncs on the metadata: CPU use only.
    """
    del max_query_len, max_seq_len, decode_parallel_splits
    if kv_split_size <= 0 or kv_split_size % KV_TILE:
        raise ValueError(f"kv_split_size must be a positive multiple of KV_TILE={KV_TILE}")
    T = KV_TILE
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    G = num_q_heads // num_kv_heads
    d_pad = 1 << (head_dim - 1).bit_length()  # tree over head_dim needs 2^k
    if out is None:
        out = torch.zeros_like(q)
    neg_inf = float("-inf")

    for s, (start, end, L) in enumerate(_seq_bounds(cu_seqlens_q, seq_lens)):
        n = end - start
        if n <= 0:
            continue  # q_len 0 padding sequence: nothing to write
        if L <= 0:
            out[start:end] = 0  # seq_len 0 padding sequence
            continue
        first = L - n  # absolute position of this sequence's first query row
        n_tiles = -(-L // T)
        # Context as [Hkv, n_tiles * T, D], zero past L: the kernel's masked
        # loads (other=0), so a tile always has exactly T columns.
        k = torch.zeros(num_kv_heads, n_tiles * T, d_pad, dtype=torch.float32, device=q.device)
        v = torch.zeros(num_kv_heads, n_tiles * T, head_dim, dtype=torch.float32, device=q.device)
        k[:, :L, :head_dim] = _gather_context(k_cache, block_table[s], L).float().permute(1, 0, 2)
        v[:, :L] = _gather_context(v_cache, block_table[s], L).float().permute(1, 0, 2)
        # Rows r = token * G + g (the kernel's GQA packing), per kv head.
        R = n * G
        qq = torch.zeros(num_kv_heads, R, d_pad, dtype=torch.float32, device=q.device)
        qq[..., :head_dim] = (q[start:end].float().view(n, num_kv_heads, G, head_dim)
                              .permute(1, 0, 2, 3).reshape(num_kv_heads, R, head_dim))
        pos = (first + torch.arange(n, device=q.device)).repeat_interleave(G)  # [R], ascending

        M = torch.full((num_kv_heads, R), neg_inf, dtype=torch.float32, device=q.device)
        Lsum = torch.zeros(num_kv_heads, R, dtype=torch.float32, device=q.device)
        ACC = torch.zeros(num_kv_heads, R, head_dim, dtype=torch.float32, device=q.device)

        def first_row(kv_pos: int) -> int:
            # Rows are sorted by position, so the rows that see any KV
            # position >= kv_pos form a suffix. Skipping the others is
            # bit-identical to the kernel's fully-masked identity steps.
            return min(R, max(0, kv_pos - first) * G)

        for lo in range(0, L, kv_split_size):
            hi = min(lo + kv_split_size, L)
            r0 = first_row(lo)
            m = torch.full((num_kv_heads, R - r0), neg_inf, dtype=torch.float32, device=q.device)
            l = torch.zeros(num_kv_heads, R - r0, dtype=torch.float32, device=q.device)
            acc = torch.zeros(num_kv_heads, R - r0, head_dim, dtype=torch.float32, device=q.device)
            t0 = lo
            while t0 < hi:
                # A group of nt consecutive tiles is evaluated at once; the
                # online-softmax recurrence below is still strictly per tile.
                rg = first_row(t0)
                rows = R - rg
                per_tile = max(1, num_kv_heads * rows * T * d_pad)
                nt = max(1, min(-(-(hi - t0) // T), _TORCH_STEP_ELEMS // per_tile))
                t1 = t0 + nt * T
                rel = rg - r0
                kg = k[:, t0:t1].reshape(num_kv_heads, nt, T, d_pad)
                vg = v[:, t0:t1].reshape(num_kv_heads, nt, T, head_dim)
                # Scores [Hkv, rows, nt, T]: exact elementwise products, tree sum.
                S = _tree_sum(qq[:, rg:, None, None, :] * kg[:, None], -1) * scale
                kpos = torch.arange(t0, t1, device=q.device).view(nt, T)
                S = torch.where(kpos[None, None] <= pos[rg:, None, None][None], S, neg_inf)
                m0 = m[:, rel:]
                m_run = torch.cummax(torch.cat([m0[..., None], S.amax(-1)], -1), dim=-1).values
                m_prev, m_run = m_run[..., :-1], m_run[..., 1:]
                m_ref = torch.where(m_run == neg_inf, 0.0, m_run)
                alpha = _exp_det(m_prev - m_ref)  # [Hkv, rows, nt]
                P = _exp_det(S - m_ref[..., None])  # [Hkv, rows, nt, T]
                rs = _tree_sum(P, -1)
                PV = _tree_sum(P[..., None] * vg[:, None], -2)  # [Hkv, rows, nt, D]
                lc, ac = l[:, rel:], acc[:, rel:]
                for t in range(nt):
                    lc = lc * alpha[..., t] + rs[..., t]
                    ac = ac * alpha[..., t, None] + PV[:, :, t]
                l[:, rel:], acc[:, rel:], m[:, rel:] = lc, ac, m_run[..., -1]
                t0 = t1
            # Merge this split's partial into the running state (kernel's _merge).
            M0 = M[:, r0:]
            M_new = torch.maximum(M0, m)
            M_ref = torch.where(M_new == neg_inf, 0.0, M_new)
            a = _exp_det(M0 - M_ref)
            b = _exp_det(m - M_ref)
            Lsum[:, r0:] = Lsum[:, r0:] * a + l * b
            ACC[:, r0:] = ACC[:, r0:] * a[..., None] + acc * b[..., None]
            M[:, r0:] = M_new

        # Finalize (kernel's _finalize): rows with no KV -> 0, canonical +0.
        ok = Lsum > 0
        o = ACC / torch.where(ok, Lsum, 1.0)[..., None]
        o = torch.where(ok[..., None], o, 0.0)
        o = torch.where(o == 0, 0.0, o)
        out[start:end] = (o.view(num_kv_heads, n, G, head_dim).permute(1, 0, 2, 3)
                          .reshape(n, num_q_heads, head_dim).to(out.dtype))
    return out
