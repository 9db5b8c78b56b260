"""Mixture-of-experts kernels: routing, the expert plan, the grouped GEMM (forward,
dgrad, wgrad), the fixed-slot float32 merge, and their references.

Where MoE usually breaks batch invariance, and what these kernels do instead:

* routing: softmax over the router's float32 logits with a fixed-order sum (exact max,
  elementwise exp, the sampler's pairwise tree of adds), top-k by a STABLE descending
  sort, so ties go to the lower expert id; `norm_topk_prob` divides by the slot-order
  sum `w0 + w1 + ...`. Every step is a function of the token's own row.
* expert computation: a token's k (token, slot) pairs are rows of a grouped GEMM whose
  rows are sorted by expert and cut into blocks of BM rows that never straddle two
  experts (each expert's segment is padded to a multiple of BM). Each output element is
  ONE float32 reduction along K, ascending, in the `acc = tl.dot(a, b, acc)` form of
  `kernels/matmul.py` (the form whose bits do not depend on the tile shape or on the
  row's position in its tile), so a row's result depends on its own row and its
  expert's weights only: not on how many rows chose that expert or where they sit. On
  CPU each pair is computed on its own, as a fresh [1, K] row (the CPU invariant
  path's rule, `kernels/torch_ops.py`).
* merge: a token's k expert outputs (float32 straight from the down GEMM's accumulator)
  are combined as `acc = y0 * w0; acc = acc + y1 * w1; ...` in slot order (the k-rank of
  the expert for that token), never in arrival order, and rounded once to the model
  dtype. No floating-point atomics anywhere.

`fast` mode keeps the plain baseline: torch softmax + topk, `torch._grouped_mm` (or a
per-expert loop) in the model dtype, a torch sum over slots.

The three ops (moe_route, moe_experts, moe_merge) are rows of the numerics table
(`kernels/numerics_table.py`), and the op shim (`kernels/ops.py`) dispatches them with the
forward context's mode like every other op. The expert MLPs take their activation from the
shim (`act`: its silu_and_mul, with that op's table row and autograd Function), so this
module imports neither. The autograd Functions live in `kernels/moe_autograd.py`, which
imports nothing from here: the kernels they wrap are passed in.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllm.kernels.moe_autograd import GroupedGemmFn

logger = logging.getLogger(__name__)


# ============================================================================ routing
@dataclass
class Routing:
    """Per token: the chosen experts in slot order, their float32 weights, and the full
    float32 router probabilities (for the load-balancing loss)."""
    ids: torch.Tensor      # [T, k] int64, slot order (descending probability, ties: lower id)
    weights: torch.Tensor  # [T, k] float32
    probs: torch.Tensor    # [T, E] float32


def _fixed_softmax(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim whose bits depend only on the row: exact max, elementwise
    exp, the sampler's fixed pairwise sum, one division."""
    from vllm.sample.sampler import _pairwise_sum

    z = logits - logits.amax(dim=-1, keepdim=True)
    e = torch.exp(z)
    return e / _pairwise_sum(e)


def _slot_sum(x: torch.Tensor) -> torch.Tensor:
    """x [T, k] -> [T, 1]: x0 + x1 + ... in slot order."""
    acc = x[:, :1]
    for s in range(1, x.shape[1]):
        acc = acc + x[:, s:s + 1]
    return acc


def route_invariant(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """logits [T, E] float32 -> Routing. Every op is exact or elementwise, or a reduction
    in a fixed order over the token's own row."""
    # float32 (float64 stays float64: the gradient tests run this forward in float64)
    probs = _fixed_softmax(logits if logits.dtype == torch.float64 else logits.float())
    vals, idx = torch.sort(probs, dim=-1, descending=True, stable=True)  # stable: ties -> lower id
    top, ids = vals[:, :top_k], idx[:, :top_k]
    weights = top / _slot_sum(top) if norm_topk_prob else top
    return Routing(ids.contiguous(), weights.contiguous(), probs)


def route_fast(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """The usual formulation (torch softmax + topk); tie order unspecified."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    weights = top / top.sum(dim=-1, keepdim=True) if norm_topk_prob else top
    return Routing(ids, weights, probs)


def route_reference(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """float64 reference (tests): torch softmax, stable sort for the lower-id tie rule."""
    probs = torch.softmax(logits.double(), dim=-1)
    vals, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, ids = vals[:, :top_k], idx[:, :top_k]
    weights = top / top.sum(dim=-1, keepdim=True) if norm_topk_prob else top
    return Routing(ids, weights, probs)


# ============================================================================ the expert plan
@dataclass
class ExpertPlan:
    """Where each (token, slot) pair sits in the grouped GEMM's padded, expert-sorted rows.

    Pair p = token * k + slot. Rows are sorted by expert (stable: ascending pair index
    within an expert); each expert's segment starts on a multiple of `block_m` and is
    padded to one, so a block of `block_m` rows never mixes experts. Built with device
    ops only (no host synchronisation: CUDA-graph safe); sizes depend on T alone."""
    top_k: int
    num_pairs: int
    num_experts: int
    block_m: int
    pair_at: torch.Tensor            # [num_blocks * block_m] int32: pair index or -1 (padding)
    pos_of_pair: torch.Tensor        # [num_pairs] int64: padded row of each pair
    block_expert: torch.Tensor       # [num_blocks] int32: expert of each block, -1 unused
    expert_block_start: torch.Tensor  # [E] int32
    expert_block_end: torch.Tensor    # [E] int32

    @property
    def num_rows(self) -> int:
        return self.pair_at.shape[0]


def make_plan(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertPlan:
    T, k = ids.shape
    R = T * k
    dev = ids.device
    flat = ids.reshape(-1).long()
    # integer scatter-add: exact, whatever the order the hardware applies it in
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    block_start = block_end - blocks
    row_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_e = flat.index_select(0, order)
    rank = torch.arange(R, device=dev) - row_start.index_select(0, sorted_e)
    dest = block_start.index_select(0, sorted_e) * block_m + rank
    # blocks used <= sum_e ceil(c_e / BM) <= R / BM + (experts hit) : a bound known on the host
    num_blocks = max(1, triton.cdiv(R, block_m) + min(R, num_experts))
    pair_at = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=dev)
    pair_at.index_copy_(0, dest, order.to(torch.int32))
    pos_of_pair = torch.empty(R, dtype=torch.long, device=dev)
    pos_of_pair.index_copy_(0, order, dest)
    be = torch.searchsorted(block_end, torch.arange(num_blocks, device=dev), right=True)
    block_expert = torch.where(be < num_experts, be, torch.full_like(be, -1)).to(torch.int32)
    return ExpertPlan(k, R, num_experts, block_m, pair_at, pos_of_pair, block_expert,
                      block_start.to(torch.int32), block_end.to(torch.int32))


# ============================================================================ grouped GEMM (Triton)
# tl.sum's combine function: under the interpreter tl.reduce with it maps straight to numpy
_SUM_COMBINE = tl.standard._sum_combine


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, pair_at_ptr, block_expert_ptr,
    N, K,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_INDEXED: tl.constexpr, A_DIV: tl.constexpr, C_INDEXED: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr,
):
    """Block b of padded rows p (all of expert e): c[crow(p), n] = sum_k a[arow(p), k] * b[e, n, k].

    arow(p) = pair_at[p] // A_DIV if A_INDEXED else p; crow(p) = pair_at[p] if C_INDEXED else p.
    Padding rows (pair_at = -1) are neither read nor written. One float32 accumulator per
    output, K ascending from zero, `acc = tl.dot(a, b, acc)`: the dense invariant GEMM's order."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        offs = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        pair = tl.load(pair_at_ptr + offs)
        valid = pair >= 0
        if A_INDEXED:
            a_row = tl.where(valid, pair // A_DIV, 0).to(tl.int64)
        else:
            a_row = offs
        rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        n_ok = rn[None, :] < N
        a_ptrs = a_ptr + a_row[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + e.to(tl.int64) * stride_be + rn[None, :] * stride_bn + rk[:, None] * stride_bk
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok, other=0.0)
            else:
                k_left = K - k * BK
                a = tl.load(a_ptrs, mask=valid[:, None] & (rk[None, :] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=n_ok & (rk[:, None] < k_left), other=0.0)
            if EMULATE:
                # the interpreter's tl.dot is np.matmul, whose per-element bits depend on
                # the row's position in the tile (BLAS kernel choice, e.g. AVX-512 edge
                # kernels): exact fp32 products summed in a fixed order instead
                acc = acc + tl.reduce(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1,
                                      _SUM_COMBINE)
            else:
                acc = tl.dot(a, b, acc)  # this form keeps bits independent of the tile shape
            a_ptrs += BK * stride_ak
            b_ptrs += BK * stride_bk
        if C_INDEXED:
            c_row = tl.where(valid, pair, 0).to(tl.int64)
        else:
            c_row = offs
        c_ptrs = c_ptr + c_row[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok)


@triton.jit
def _grouped_wgrad_kernel(
    dc_ptr, a_ptr, dw_ptr, pair_at_ptr, expert_block_start_ptr, expert_block_end_ptr,
    N, K,
    stride_dcm, stride_dcn, stride_am, stride_ak, stride_we, stride_wn, stride_wk,
    A_INDEXED: tl.constexpr, A_DIV: tl.constexpr, C_INDEXED: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """dw[e, n, k] = sum over expert e's rows p of dc[crow(p), n] * a[arow(p), k] (float32),
    blocks in ascending order. Experts without rows get exact zeros."""
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.load(expert_block_start_ptr + e)
    end = tl.load(expert_block_end_ptr + e)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = pid_k.to(tl.int64) * BK + tl.arange(0, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for blk in range(start, end):
        offs = (blk * BM + tl.arange(0, BM)).to(tl.int64)
        pair = tl.load(pair_at_ptr + offs)
        valid = pair >= 0
        if C_INDEXED:
            c_row = tl.where(valid, pair, 0).to(tl.int64)
        else:
            c_row = offs
        if A_INDEXED:
            a_row = tl.where(valid, pair // A_DIV, 0).to(tl.int64)
        else:
            a_row = offs
        dc = tl.load(dc_ptr + c_row[:, None] * stride_dcm + rn[None, :] * stride_dcn,
                     mask=valid[:, None] & (rn[None, :] < N), other=0.0)
        a = tl.load(a_ptr + a_row[:, None] * stride_am + rk[None, :] * stride_ak,
                    mask=valid[:, None] & (rk[None, :] < K), other=0.0)
        acc = tl.dot(tl.trans(dc), a, acc)
    w_ptrs = dw_ptr + e.to(tl.int64) * stride_we + rn[:, None] * stride_wn + rk[None, :] * stride_wk
    tl.store(w_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rk[None, :] < K))


# (max average rows per expert, BM, BN, BK, warps, stages). The block size BM is chosen
# from the batch (rows per expert) and the rest per GEMM; none of it changes bits (the
# same property as the dense tables, re-checked by tests/test_moe_kernels.py on the GPU
# and by benchmarks/kernels/moe_gemm.py --sweep).
MOE_GPU_CONFIGS: list[tuple] = [
    (16, 16, 64, 128, 4, 4),
    (48, 32, 64, 128, 4, 4),
    (160, 64, 128, 64, 4, 4),
    (1 << 62, 128, 128, 64, 8, 3),
]
# the interpreter emulates tl.dot with numpy, where tile shapes DO change bits: one shape,
# the dense kernel's (kernels/matmul.py INTERPRET_CONFIGS), so the two agree bit for bit
MOE_INTERPRET_CONFIG = (16, 16, 16, 1, 1)


def _interpreting() -> bool:
    """Triton's own switch (TRITON_INTERPRET=1: kernels run in its CPU interpreter), read
    here to pick the interpreter's tile shape."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pick_moe_config(num_pairs: int, num_experts: int) -> tuple:
    """(BM, BN, BK, warps, stages) for a layer step with `num_pairs` rows over `num_experts`."""
    if _interpreting():
        return MOE_INTERPRET_CONFIG
    avg = num_pairs / max(1, num_experts)
    for max_avg, *cfg in MOE_GPU_CONFIGS:
        if avg <= max_avg:
            return tuple(cfg)
    raise AssertionError("MOE_GPU_CONFIGS must end with an unbounded entry")


def _gemm_tiles(plan: ExpertPlan, config: tuple | None) -> tuple:
    cfg = config or pick_moe_config(plan.num_pairs, plan.num_experts)
    if cfg[0] != plan.block_m:
        raise ValueError(f"config block_m {cfg[0]} != the plan's block_m {plan.block_m}")
    return cfg


def _check_kernel_dtypes(*tensors: torch.Tensor) -> None:
    if any(t.dtype not in (torch.bfloat16, torch.float16, torch.float32) for t in tensors):
        raise ValueError(f"the grouped GEMM kernels take bfloat16/float16/float32, got "
                         f"{[str(t.dtype) for t in tensors]} (float64: use the references)")


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, plan: ExpertPlan, *, a_indexed: bool, a_div: int = 1,
                 c_indexed: bool, num_c_rows: int | None = None, out_dtype: torch.dtype | None = None,
                 transpose_w: bool = False, zero_padding: bool = False, config: tuple | None = None) -> torch.Tensor:
    """c[crow(p)] = a[arow(p)] @ w[e(p)]^T for every pair row p of the plan (w: [E, N, K];
    with transpose_w, w: [E, K, N] read as its transpose, for dgrad). Rows of c that no
    pair writes are zero when C is indexed by pair; padding rows of a padded-layout c are
    left unwritten (zero with zero_padding): no kernel ever reads them."""
    if transpose_w:
        E, K, N = w.shape
        s_be, s_bn, s_bk = w.stride(0), w.stride(2), w.stride(1)
    else:
        E, N, K = w.shape
        s_be, s_bn, s_bk = w.stride(0), w.stride(1), w.stride(2)
    if a.shape[-1] != K:
        raise ValueError(f"grouped_gemm: a has K={a.shape[-1]}, weights K={K}")
    _check_kernel_dtypes(a, w)
    out_dtype = out_dtype or a.dtype
    rows = num_c_rows if c_indexed else plan.num_rows
    c = (torch.zeros if (c_indexed or zero_padding) else torch.empty)((rows, N), dtype=out_dtype, device=a.device)
    if plan.num_pairs == 0:
        return c
    bm, bn, bk, warps, stages = _gemm_tiles(plan, config)
    grid = (plan.block_expert.shape[0], triton.cdiv(N, bn))
    _grouped_gemm_kernel[grid](
        a, w, c, plan.pair_at, plan.block_expert, N, K,
        a.stride(0), a.stride(1), s_be, s_bn, s_bk, c.stride(0), c.stride(1),
        A_INDEXED=a_indexed, A_DIV=a_div, C_INDEXED=c_indexed, BM=bm, BN=bn, BK=bk, EVEN_K=K % bk == 0,
        EMULATE=_interpreting(), num_warps=warps, num_stages=stages, enable_fp_fusion=True)
    return c


def grouped_wgrad(dc: torch.Tensor, a: torch.Tensor, plan: ExpertPlan, *, a_indexed: bool, a_div: int = 1,
                  c_indexed: bool, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dw[e] = sum over expert e's pair rows of dc[crow]^T a[arow] -> [E, N, K]."""
    N, K = dc.shape[-1], a.shape[-1]
    _check_kernel_dtypes(dc, a)
    dw = torch.empty((plan.num_experts, N, K), dtype=out_dtype, device=a.device)
    bm = plan.block_m
    if _interpreting():
        bn, bk, warps, stages = 16, 16, 1, 1
    else:
        bn, bk, warps, stages = (64, 64, 4, 3) if bm <= 64 else (64, 64, 8, 3)
    grid = (plan.num_experts, triton.cdiv(N, bn), triton.cdiv(K, bk))
    _grouped_wgrad_kernel[grid](
        dc, a, dw, plan.pair_at, plan.expert_block_start, plan.expert_block_end, N, K,
        dc.stride(0), dc.stride(1), a.stride(0), a.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        A_INDEXED=a_indexed, A_DIV=a_div, C_INDEXED=c_indexed, BM=bm, BN=bn, BK=bk,
        num_warps=warps, num_stages=stages, enable_fp_fusion=True)
    return dw


def grouped_linear(a: torch.Tensor, w: torch.Tensor, plan: ExpertPlan, *, a_indexed: bool, a_div: int = 1,
                   c_indexed: bool, num_c_rows: int | None = None, out_dtype: torch.dtype | None = None,
                   config: tuple | None = None) -> torch.Tensor:
    """grouped_gemm, under autograd (GroupedGemmFn: dgrad and wgrad by the grouped kernels)
    when a gradient is asked for."""
    if torch.is_grad_enabled() and (a.requires_grad or w.requires_grad):
        return GroupedGemmFn.apply(a, w, plan, a_indexed, a_div, c_indexed, num_c_rows, out_dtype, config,
                                   grouped_gemm, grouped_wgrad)
    return grouped_gemm(a, w, plan, a_indexed=a_indexed, a_div=a_div, c_indexed=c_indexed, num_c_rows=num_c_rows,
                        out_dtype=out_dtype, config=config)


def grouped_gemm_reference(a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float64 reference of the two expert GEMMs' shape: pair p = (t, s) -> a[t] @ w[ids[t, s]]^T, [T, k, N]."""
    T, k = ids.shape
    out = torch.zeros(T, k, w.shape[1], dtype=torch.float64, device=a.device)
    for t in range(T):
        for s in range(k):
            out[t, s] = w[ids[t, s]].double() @ a[t].double()
    return out


# ============================================================================ expert MLPs
def _silu_and_mul_ref(h: torch.Tensor) -> torch.Tensor:
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float64: y[t, s] = down_e(silu(gate_e x_t) * up_e x_t) for e = ids[t, s] -> [T, k, H]."""
    T, k = ids.shape
    y = torch.zeros(T, k, w2.shape[1], dtype=torch.float64, device=x.device)
    for t in range(T):
        for s in range(k):
            e = int(ids[t, s])
            y[t, s] = w2[e].double() @ _silu_and_mul_ref(w13[e].double() @ x[t].double())
    return y


def experts_grouped_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                           act: Callable, config: tuple | None = None) -> torch.Tensor:
    """Invariant expert MLPs on the grouped Triton GEMM -> y [T, k, H] float32 (the down
    GEMM's accumulator, unrounded: the merge rounds once). `act`: silu_and_mul."""
    T, k = ids.shape
    E, H = w13.shape[0], w2.shape[1]
    if T == 0:
        return x.new_zeros((0, k, H), dtype=torch.float32)
    block_m = (config or pick_moe_config(T * k, E))[0]
    plan = make_plan(ids, E, block_m)
    h = grouped_linear(x, w13, plan, a_indexed=True, a_div=k, c_indexed=False, config=config)  # [P, 2I]
    y = grouped_linear(act(h), w2, plan, a_indexed=False, c_indexed=True, num_c_rows=T * k,
                       out_dtype=torch.float32, config=config)
    return y.view(T, k, H)


def experts_rows_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                     act: Callable) -> torch.Tensor:
    """Invariant expert MLPs on CPU: every (token, slot) pair on its own, as fresh [1, K]
    rows of identical shape, so the library takes the same code path whatever the batch
    (the rule of the row forms in kernels/torch_ops.py). Down projection in float32 ->
    y [T, k, H] float32."""
    T, k = ids.shape
    H = w2.shape[1]
    if T == 0:
        return x.new_zeros((0, k, H), dtype=torch.float32)
    ids_host = ids.tolist()
    w2f = {}
    out = []
    for t in range(T):
        row = x[t:t + 1].clone()
        for s in range(k):
            e = ids_host[t][s]
            a = act(F.linear(row, w13[e]))
            if e not in w2f:
                w2f[e] = w2[e].float()
            out.append(F.linear(a.float(), w2f[e]))
    return torch.cat(out, 0).view(T, k, H)


_GROUPED_MM_BROKEN: set = set()


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _grouped_mm_ok(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """torch's grouped GEMM takes bf16 on Hopper and newer (sm90+)."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16 and w13.dtype == x.dtype
            and _capability_major(x.device.index if x.device.index is not None else torch.cuda.current_device()) >= 9
            and (x.device, x.dtype) not in _GROUPED_MM_BROKEN)


def experts_torch_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                             act: Callable) -> torch.Tensor:
    """The fast baseline on Hopper: torch's grouped GEMM (CUTLASS) over expert-sorted
    rows, model-dtype outputs -> y [T, k, H] in x.dtype. Device ops only (graph safe)."""
    T, k = ids.shape
    E, H = w13.shape[0], w2.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x.index_select(0, order // k)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    ys = torch._grouped_mm(act(h), w2.transpose(1, 2), offs=offs)
    y = torch.empty_like(ys).index_copy(0, order, ys)
    return y.view(T, k, H)


def experts_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                 act: Callable) -> torch.Tensor:
    """The plain per-expert loop (F.linear on each expert's gathered rows). Reads expert
    counts on the host: eager only."""
    T, k = ids.shape
    H = w2.shape[1]
    flat = ids.reshape(-1)
    y = x.new_zeros((T * k, H))
    for e in torch.unique(flat).tolist():
        rows = (flat == e).nonzero(as_tuple=True)[0]
        h = F.linear(x.index_select(0, rows // k), w13[e])
        y = y.index_copy(0, rows, F.linear(act(h), w2[e]))
    return y.view(T, k, H)


def experts_fast(x, w13, w2, ids, act):
    """The fast baseline on CUDA (on CPU it is experts_loop): torch's grouped GEMM where it
    takes the layout, else the Triton grouped GEMM (graph-safe without a host read of the
    expert counts)."""
    if ids.shape[0] == 0:
        return x.new_zeros((0, ids.shape[1], w2.shape[1]))
    if _grouped_mm_ok(x, w13):
        try:
            return experts_torch_grouped_mm(x, w13, w2, ids, act)
        except RuntimeError as err:  # an unsupported layout on this build: say so once, then Triton
            logger.warning("torch._grouped_mm refused (%s); fast mode uses the Triton grouped GEMM", err)
            _GROUPED_MM_BROKEN.add((x.device, x.dtype))
    return experts_grouped_triton(x, w13, w2, ids, act)


# ============================================================================ merge
def merge_slots_torch(y: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """out[t] = round(((y[t,0] w[t,0]) + y[t,1] w[t,1]) + ...), float32, slot order, one rounding.
    Elementwise mul and add only (each correctly rounded, no fusion across torch ops).
    (float64 inputs stay float64: the gradient tests run this forward in float64.)"""
    acc_dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
    yf = y.to(acc_dtype)
    wf = w.to(acc_dtype)
    acc = yf[:, 0] * wf[:, 0:1]
    for s in range(1, y.shape[1]):
        acc = acc + yf[:, s] * wf[:, s:s + 1]
    return acc.to(out_dtype)


@triton.jit
def _merge_slots_kernel(y_ptr, w_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.load(y_ptr + (t * TOPK) * H + cols, mask=ok, other=0.0).to(tl.float32) * tl.load(w_ptr + t * TOPK)
    for s in tl.static_range(1, TOPK):
        ys = tl.load(y_ptr + (t * TOPK + s) * H + cols, mask=ok, other=0.0).to(tl.float32)
        acc = acc + ys * tl.load(w_ptr + t * TOPK + s)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def merge_slots_triton(y: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """One launch computing merge_slots_torch's formula (mul and add kept apart: fp fusion
    off, so no FMA changes the rounding) -> the same bits."""
    T, k, H = y.shape
    y = y.contiguous()
    w = w.float().contiguous()
    out = torch.empty((T, H), dtype=out_dtype, device=y.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _merge_slots_kernel[(T, triton.cdiv(H, block))](y, w, out, H, TOPK=k, BLOCK_H=block, num_warps=4,
                                                     enable_fp_fusion=False)
    return out


def merge_fast(y, w, out_dtype):
    return (y.float() * w.float()[..., None]).sum(dim=1).to(out_dtype)


def merge_reference(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (y.double() * w.double()[..., None]).sum(dim=1)


# ============================================================================ contract
def moe_numerical_policy(numerics: str, device: str | torch.device) -> dict:
    """The MoE part of the execution contract's numerical section."""
    gpu = torch.device(device).type == "cuda"
    if numerics != "invariant":
        return {"routing": "torch softmax + topk (ties unspecified)",
                "experts": "torch._grouped_mm / per-expert F.linear, model dtype", "merge": "torch sum over slots"}
    return {
        "routing": "float32 logits (invariant GEMM); softmax = exp(x - max) / fixed pairwise sum; "
                   "top-k by stable descending sort (ties: lower expert id); norm_topk_prob: / slot-order sum",
        "experts": ({"kernel": "triton grouped gemm, rows sorted by expert, blocks never mix experts",
                     "form": "acc = tl.dot(a, b, acc)", "k_order": "ascending", "accumulate": "float32",
                     "tiles": MOE_GPU_CONFIGS, "down_output": "float32"}
                    if gpu else {"kernel": "torch F.linear one (token, slot) row at a time", "down_output": "float32"}),
        "merge": "float32, slot order (k-rank), acc = y0*w0; acc = acc + ys*ws; no fma; one cast",
    }
