"""The delta rule from chunk to chunk, the sequential part of Gated DeltaNet's training backward.

`gdn_reference` (gdn_chunk.py) computes every per-chunk quantity (gamma, A, T, w, u, the
decayed keys) as batched ops over all chunks at once; only the state has to be carried from
one chunk to the next:

    v_new_c = u_c - w_c S_c,      S_(c+1) = e_c S_c + kd_c^T v_new_c,      S_0 = 0

for u [B, H, nC, C, V], w, kd [B, H, nC, C, K] and the chunks' decays e [B, H, nC]. This
module is that recurrence with its hand-written backward (the gradient reaching S_(c+1)
carried from the last chunk to the first):

    dv_new_c = g_vn_c + kd_c dS,   dkd_c = v_new_c dS^T,   de_c = <S_c, dS>,
    du_c = dv_new_c,   dw_c = -dv_new_c S_c^T,   dS <- g_S_c + e_c dS - w_c^T dv_new_c

where g_S_c and g_vn_c are the gradients reaching the returned states and v_new.

Two implementations of each direction, one per device:
- CUDA: one Triton program per (sequence, head, V tile) walks the chunks with the state (or
  its gradient) in registers, so a 10,240-token sequence is one launch, not 160 chunks of
  small ops. The backward walk keeps only dv_new and the state's gradient, storing the
  gradient reaching each chunk's end state, and a program per chunk takes dkd, dw and de over
  all of V after it (two launches, no per-tile parts). With bf16 dots the dots' operands (w,
  kd, v_new) and the state-shaped tensors may pass in bfloat16 (gdn_backward passes them so). Dots are
  3xTF32 for float32 callers (near-fp32; ieee float32 dots compile to FMA loops that spill at
  these tiles), or bf16 operands where the GDN backward of bfloat16 inputs asks
  (training_tiles.dot_precision), so the results agree with the float32 torch loops within
  rounding, not bit for bit: this is a backward, checked against float64
  (tests/test_chunk_recurrence.py), not a parity path.
- CPU (and float64, which the gradchecks use): the same formulas as torch loops over chunks.
Under TRITON_INTERPRET=1 the Triton entries run on CPU tensors (the tests).
"""
from __future__ import annotations

import torch

from vllm.kernels.chunk_scan import require_triton
from vllm.kernels.chunk_tiles import HAS_TRITON, aligned16, next_pow2
from vllm.kernels import training_tiles
from vllm.kernels.training_tiles import matrix_desc as _desc, rows_aligned

# (V tile, warps, pipeline stages) of the forward walk per dot precision (V above the tile is
# split over programs). H200, 32 heads x 160 chunks of 64, K = V = 128 (V tile / warps /
# stages): bf16 32/4/2 383 us (32/8/2 453, 64/4/2 430, 32/4/1 728); tf32x3 32/4/2 678 (32/8/2
# 770, 32/4/1 1,006). A 16-wide tile at 8 warps hit an illegal memory access at K = 128 (not
# looked into; `_blocks` never takes that tile). With bfloat16 in and out, as the GDN backward
# runs it (H100, `backward_sweep.py recurrence --bf16-only`): 32/4/1 597 us, 32/4/2 305,
# 32/4/3 241, 32/4/4 does not fit (254 kB of shared memory), 32/8/2 347, 64/4/2 328, 64/4/3
# 249, 64/8/2 404 (float32 in and out, 32/4/3 is slower: 508 against 459; bf16 dots take
# bfloat16 from gdn_backward). `benchmarks/kernels/backward_sweep.py` measures them.
FORWARD_CONFIG = {"bf16": (32, 4, 3), "tf32x3": (32, 4, 2)}
INTERPRETER_CONFIG = (32, 4, 2)
# The backward in two launches: the walk keeps to what must be sequential (dv_new and the
# state's gradient, two dots a chunk: 166 registers / 106 kB at V tile 32, so twice the walks a
# walk that also took dkd, dw and de could run at 249 / 205 kB) and stores the gradient reaching
# each chunk's end state; a program per (sequence x head, chunk) then takes dkd, dw and de over
# all of V (no per-V-tile parts to sum). (V tile, warps, stages) of the walk; (V tile, warps)
# of the per-chunk program. H200, the same shapes (benchmarks/kernels/gdn.py --backward): bf16
# walk 643 + parts 351 us against 1,196 for the single walk at 64/4/2 (GDN backward 4,433 ->
# 3,705 us); tf32x3 walk 1,047 + parts 732 against 2,284 (13,674 -> 12,217 us).
BACKWARD_WALK_CONFIG = {"bf16": (32, 4, 2), "tf32x3": (32, 8, 2)}
BACKWARD_PARTS_CONFIG = {"bf16": (32, 8), "tf32x3": (32, 8)}
# a cap on the V tile over every config (the tests lower it to split small V)
BLOCK_V_MAX = 64


if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm.kernels.training_tiles import mm as _mm
    from vllm.kernels.training_tiles import to_dtype_rn as _to_dtype_rn

    @triton.jit
    def _fwd_kernel(u_desc, w_desc, kd_desc, e_ptr, states_desc, vn_desc, NC,
                    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
        """Program (sequence x head, V tile): S_0 = 0; per chunk c, store S_c, v_new_c = u_c - w_c S_c,
        S_(c+1) = e_c S_c + kd_c^T v_new_c. Tiles move through tensor descriptors over the
        [chunks, rows, cols] views (zero padding past C / K / V, clipped stores): no per-element
        pointer tiles held in registers across the loop."""
        bh = tl.program_id(0)
        v0 = tl.program_id(1) * BV
        S = tl.zeros((BK, BV), dtype=tl.float32)
        for c in range(NC):
            chunk = bh * NC + c
            states_desc.store([chunk, 0, v0], tl.reshape(_to_dtype_rn(S, states_desc.dtype), (1, BK, BV)))
            w = tl.reshape(w_desc.load([chunk, 0, 0]), (BC, BK))
            u = tl.reshape(u_desc.load([chunk, 0, v0]), (BC, BV)).to(tl.float32)
            vn = u - _mm(w, S, PREC)
            vn_desc.store([chunk, 0, v0], tl.reshape(_to_dtype_rn(vn, vn_desc.dtype), (1, BC, BV)))
            kd = tl.reshape(kd_desc.load([chunk, 0, 0]), (BC, BK))
            e = tl.load(e_ptr + chunk)
            S = S * e + _mm(tl.trans(kd), vn, PREC)

    @triton.jit
    def _bwd_walk_kernel(w_desc, kd_desc, e_ptr, gs_desc, gvn_desc, du_desc, ds_desc, NC,
                         BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
        """Program (sequence x head, V tile): dS = 0; per chunk from the last: store dS (the
        gradient reaching the chunk's end state), dv_new = g_vn + kd dS (= du), then dS of the
        chunk before. _bwd_parts_kernel takes the rest from what it stored."""
        bh = tl.program_id(0)
        v0 = tl.program_id(1) * BV
        dS = tl.zeros((BK, BV), dtype=tl.float32)
        for i in range(NC):
            chunk = bh * NC + (NC - 1 - i)
            ds_desc.store([chunk, 0, v0], tl.reshape(_to_dtype_rn(dS, ds_desc.dtype), (1, BK, BV)))
            kd = tl.reshape(kd_desc.load([chunk, 0, 0]), (BC, BK))
            dvn = tl.reshape(gvn_desc.load([chunk, 0, v0]), (BC, BV)) + _mm(kd, dS, PREC)
            du_desc.store([chunk, 0, v0], tl.reshape(_to_dtype_rn(dvn, du_desc.dtype), (1, BC, BV)))
            w = tl.reshape(w_desc.load([chunk, 0, 0]), (BC, BK))
            e = tl.load(e_ptr + chunk)
            gs = tl.reshape(gs_desc.load([chunk, 0, v0]), (BK, BV)).to(tl.float32)
            dS = gs + dS * e - _mm(tl.trans(w), dvn, PREC)

    @triton.jit
    def _bwd_parts_kernel(states_desc, vn_desc, du_desc, ds_desc, dw_desc, dkd_desc, de_ptr, NV,
                          BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
        """Program (sequence x head x chunk): dkd = v_new dS^T, dw = -dv_new S^T, de = <S, dS>
        over the V tiles in order, accumulated in registers, written once."""
        chunk = tl.program_id(0)
        dkd = tl.zeros((BC, BK), dtype=tl.float32)
        dw = tl.zeros((BC, BK), dtype=tl.float32)
        de = tl.zeros((BK, BV), dtype=tl.float32)
        for iv in range(NV):
            v0 = iv * BV
            # float32 for de's products (widening bfloat16 states and gradients is exact)
            dS = tl.reshape(ds_desc.load([chunk, 0, v0]), (BK, BV)).to(tl.float32)
            S = tl.reshape(states_desc.load([chunk, 0, v0]), (BK, BV)).to(tl.float32)
            vn = tl.reshape(vn_desc.load([chunk, 0, v0]), (BC, BV))
            dvn = tl.reshape(du_desc.load([chunk, 0, v0]), (BC, BV))
            dkd += _mm(vn, tl.trans(dS), PREC)
            dw -= _mm(dvn, tl.trans(S), PREC)
            de += S * dS
        dkd_desc.store([chunk, 0, 0], tl.reshape(dkd, (1, BC, BK)))
        dw_desc.store([chunk, 0, 0], tl.reshape(dw, (1, BC, BK)))
        tl.store(de_ptr + chunk, tl.sum(tl.sum(de, 1), 0))


def _blocks(C: int, K: int, V: int, block_v: int) -> tuple[int, int, int]:
    """(BC, BK, BV): powers of two >= 16 (tl.dot's smallest tile), K and V never under 32 (the
    zero-filled columns of a K or V of 16 cost little; 16-wide tiles at 8 warps faulted on the
    H200) and V split at block_v (and BLOCK_V_MAX)."""
    def p2(n):
        return max(16, next_pow2(n))
    return p2(C), max(32, p2(K)), min(max(32, p2(V)), block_v, BLOCK_V_MAX)


BF16_PRECISIONS = ("bf16", "bf16_emulated")


def _check(u, w, kd, e, prec: str):
    if e.dtype != torch.float32 or u.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the Triton chunk recurrence takes float32 e and float32 (or bfloat16) u, got {e.dtype}, "
                         f"{u.dtype}")
    if u.dtype == torch.bfloat16 and (prec not in BF16_PRECISIONS or u.shape[-1] % 8):
        raise ValueError(f"a bfloat16 u needs bf16 dots and V a multiple of 8 (16-byte rows), got {prec}, "
                         f"V = {u.shape[-1]}")
    if w.dtype != kd.dtype or w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the Triton chunk recurrence takes float32 (or bfloat16) w and kd, got {w.dtype}, {kd.dtype}")
    if w.dtype == torch.bfloat16 and (prec not in BF16_PRECISIONS or w.shape[-1] % 8):
        raise ValueError(f"bfloat16 w and kd need bf16 dots and K a multiple of 8 (16-byte rows), got "
                         f"{prec}, K = {w.shape[-1]}")
    B, H, nC, C, V = u.shape
    if w.shape != kd.shape or w.shape[:4] != (B, H, nC, C) or tuple(e.shape) != (B, H, nC):
        raise ValueError(f"chunk recurrence: u {tuple(u.shape)}, w {tuple(w.shape)}, kd {tuple(kd.shape)}, "
                         f"e {tuple(e.shape)} do not agree")
    if not _dims_ok(w.shape[-1], V):
        raise ValueError(f"the Triton chunk recurrence needs K and V multiples of 4 (16-byte rows), "
                         f"got {w.shape[-1]}, {V}")


def _dims_ok(K: int, V: int) -> bool:
    return rows_aligned(K, V)


def recurrence_forward_triton(u, w, kd, e, precision: str | None = None, vn_dtype: torch.dtype = torch.float32,
                              states_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(states [B, H, nC, K, V] in states_dtype, v_new [B, H, nC, C, V] in vn_dtype); the
    dots at `precision` (training_tiles.dot_precision of the float32 inputs where None). With
    bf16 dots, w and kd may come in bfloat16 and v_new go out in it: the dots round them to it
    anyway, so the results are the same bits (half the bytes). u may come in bfloat16 too
    (bf16 dots): v_new = u - w S then takes u as given, widened exactly (the bits of u
    rounded to bfloat16 and passed in float32). States stored in bfloat16 (the
    walk carries them in float32) are rounded to nearest: a lower precision for the backward's
    elementwise uses of them (de)."""
    require_triton(u)
    prec = precision or training_tiles.dot_precision(u)
    _check(u, w, kd, e, prec)
    for name, dt in (("v_new", vn_dtype), ("states", states_dtype)):
        if dt != torch.float32 and (dt != torch.bfloat16 or prec not in BF16_PRECISIONS or u.shape[-1] % 8):
            raise ValueError(f"{name} in {dt} needs bf16 dots and V a multiple of 8, got {prec}, V = {u.shape[-1]}")
    B, H, nC, C, V = u.shape
    K = w.shape[-1]
    u, w, kd, e = (aligned16(t) for t in (u, w, kd, e))
    states = u.new_empty((B, H, nC, K, V), dtype=states_dtype)
    vn = torch.empty_like(u, dtype=vn_dtype)
    if u.numel() == 0:
        return states.zero_(), vn
    block_v, warps, stages = FORWARD_CONFIG.get(prec, INTERPRETER_CONFIG)
    BC, BK, BV = _blocks(C, K, V, block_v)
    _fwd_kernel[(B * H, -(-V // BV))](
        _desc(u, (BC, BV)), _desc(w, (BC, BK)), _desc(kd, (BC, BK)), e, _desc(states, (BK, BV)),
        _desc(vn, (BC, BV)), nC, BC=BC, BK=BK, BV=BV, PREC=prec, num_warps=warps, num_stages=stages,
        enable_fp_fusion=True)
    return states, vn


def recurrence_backward_walk_triton(w, kd, e, states, g_states, g_vn, precision: str | None = None,
                                    du_dtype: torch.dtype = torch.float32):
    """The sequential half of the backward: (du, d_end), du = dv_new per chunk and d_end the
    gradient reaching each chunk's end state (in the states' dtype), for a caller that takes
    dw = -du S^T, dkd = v_new d_end^T and de = <S, d_end> itself (the GDN backward, in its
    final kernel, beside the other reads of S and v_new). Arguments as
    recurrence_backward_triton's (states for its shape and dtype only)."""
    require_triton(w)
    B, H, nC, C, V = g_vn.shape
    K = w.shape[-1]
    w, kd, e, g_states, g_vn = (aligned16(t) for t in (w, kd, e, g_states, g_vn))
    prec = precision or training_tiles.dot_precision(w)
    if du_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"du_dtype must be float32 or bfloat16, got {du_dtype}")
    if du_dtype == torch.bfloat16 and (prec not in BF16_PRECISIONS or V % 8):
        raise ValueError(f"a bfloat16 du needs bf16 dots and V a multiple of 8 (16-byte rows), got {prec}, V = {V}")
    du = torch.empty_like(g_vn, dtype=du_dtype)
    d_end = torch.empty_like(states)  # per chunk, the gradient reaching its end state (states' dtype)
    if g_vn.numel() == 0:
        return du.zero_(), d_end.zero_()
    block_v, warps, stages = BACKWARD_WALK_CONFIG.get(prec, INTERPRETER_CONFIG)
    BC, BK, BV = _blocks(C, K, V, block_v)
    _bwd_walk_kernel[(B * H, -(-V // BV))](
        _desc(w, (BC, BK)), _desc(kd, (BC, BK)), e, _desc(g_states, (BK, BV)), _desc(g_vn, (BC, BV)),
        _desc(du, (BC, BV)), _desc(d_end, (BK, BV)), nC, BC=BC, BK=BK, BV=BV, PREC=prec,
        num_warps=warps, num_stages=stages, enable_fp_fusion=True)
    return du, d_end


def recurrence_backward_triton(w, kd, e, states, vn, g_states, g_vn, precision: str | None = None,
                               du_dtype: torch.dtype = torch.float32):
    """(du, dw, dkd, de), float32, of the forward above, given the gradients reaching its
    outputs (w, kd, states and v_new as the forward took and gave them; g_states in float32 or,
    with bfloat16 states, bfloat16). The gradient reaching each chunk's end state passes from
    the walk to the per-chunk program in the states' dtype. `du_dtype` bfloat16 (bf16 dots
    only): du rounded to nearest, for a caller whose every use of du is a dot operand, which
    rounds it so anyway; dw, dkd and de keep their bits."""
    require_triton(w)
    B, H, nC, C, V = vn.shape
    K = w.shape[-1]
    # dw and dkd are made like w and kd: from aligned copies (16-byte rows, as descriptors need)
    w, kd, e, states, vn = (aligned16(t) for t in (w, kd, e, states, vn))
    prec = precision or training_tiles.dot_precision(w)
    du, d_end = recurrence_backward_walk_triton(w, kd, e, states, g_states, g_vn, prec, du_dtype)
    dw, dkd, de = (torch.empty_like(t, dtype=torch.float32) for t in (w, kd, e))
    if vn.numel() == 0:
        return du, dw.zero_(), dkd.zero_(), de.zero_()
    block_v, warps = BACKWARD_PARTS_CONFIG.get(prec, INTERPRETER_CONFIG[:2])
    BC, BK, BV = _blocks(C, K, V, block_v)
    _bwd_parts_kernel[(B * H * nC,)](
        _desc(states, (BK, BV)), _desc(vn, (BC, BV)), _desc(du, (BC, BV)), _desc(d_end, (BK, BV)),
        _desc(dw, (BC, BK)), _desc(dkd, (BC, BK)), de, -(-V // BV), BC=BC, BK=BK, BV=BV, PREC=prec,
        num_warps=warps, enable_fp_fusion=True)
    return du, dw, dkd, de


def recurrence_forward_torch(u, w, kd, e) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward as a torch loop over chunks (CPU, float64)."""
    B, H, nC, _, V = u.shape
    S = u.new_zeros((B, H, w.shape[-1], V))
    states = u.new_empty((B, H, nC, w.shape[-1], V))
    vn = torch.empty_like(u)
    for c in range(nC):
        states[:, :, c] = S
        vn[:, :, c] = u[:, :, c] - w[:, :, c] @ S
        S = S * e[:, :, c, None, None] + kd[:, :, c].transpose(-1, -2) @ vn[:, :, c]
    return states, vn


def recurrence_backward_torch(w, kd, e, states, vn, g_states, g_vn):
    """The backward as a torch loop over chunks, last to first (CPU, float64)."""
    du, dw, dkd, de = torch.empty_like(vn), torch.empty_like(w), torch.empty_like(kd), torch.empty_like(e)
    dS = torch.zeros_like(states[:, :, 0])  # d loss / d S_(c+1): nothing reads the last chunk's end state
    for c in reversed(range(e.shape[2])):
        dvn = g_vn[:, :, c] + kd[:, :, c] @ dS
        dkd[:, :, c] = vn[:, :, c] @ dS.transpose(-1, -2)
        de[:, :, c] = (states[:, :, c] * dS).sum((-1, -2))
        du[:, :, c] = dvn
        dw[:, :, c] = -(dvn @ states[:, :, c].transpose(-1, -2))
        dS = g_states[:, :, c] + dS * e[:, :, c, None, None] - w[:, :, c].transpose(-1, -2) @ dvn
    return du, dw, dkd, de


def _use_triton(values: torch.Tensor, keys: torch.Tensor) -> bool:
    return (HAS_TRITON and values.is_cuda and values.dtype == torch.float32
            and _dims_ok(keys.shape[-1], values.shape[-1]))


class ChunkRecurrenceFn(torch.autograd.Function):
    """(states, v_new) = recurrence(u, w, kd, e) with the backward above: the Triton programs
    for float32 CUDA tensors, the torch loops otherwise."""

    @staticmethod
    def forward(ctx, u, w, kd, e):
        fwd = recurrence_forward_triton if _use_triton(u, w) else recurrence_forward_torch
        states, vn = fwd(u, w, kd, e)
        ctx.save_for_backward(w, kd, e, states, vn)
        return states, vn

    @staticmethod
    def backward(ctx, g_states, g_vn):
        w, kd, e, states, vn = ctx.saved_tensors
        bwd = recurrence_backward_triton if _use_triton(vn, w) else recurrence_backward_torch
        return bwd(w, kd, e, states, vn, g_states, g_vn)
