"""The K-leaf tree GEMM of row-parallel layers: y = x @ W^T with K cut into `leaves`
contiguous leaves of K / leaves each, every leaf one plain float32 accumulation (the
invariant GEMM's `acc = tl.dot(a, b, acc)` form, from zero), the leaves combined by a
fixed balanced float32 binary tree, lower index on the left.

Tensor parallelism at size C (vllm/parallel/tensor_parallel.py) gives rank r the
contiguous leaves [r G/C, (r + 1) G/C): a whole subtree of the same tree. Each rank
computes its subtree root with these functions (`leaves` = G / C), the roots are
gathered as bit patterns, and `tree_sum` of the roots finishes the tree. So every C
dividing G evaluates one expression, and TP=1 with G leaves equals TP=C bit for bit.

Implementations (all return float32 [.., N], the subtree root; the caller adds the bias
and rounds once, after the top of the tree):
- `tree_linear_rows` (CPU, invariant): each row alone, each leaf `F.linear` of contiguous
  float32 copies (the rule of kernels/torch_ops.py's row forms);
- `tree_linear_triton` (CUDA, invariant): one launch, each program computing its output
  tile's leaves in turn and adding them in tree order in registers;
- `tree_linear_leafwise`: one invariant GEMM launch per leaf (float32 out) and `tree_sum`:
  what the fused kernel must equal bit for bit (tests, benchmarks);
- `tree_linear_reference`: float64;
- `linear_partial_fast`: fast mode's plain partial (no tree).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllm.kernels import matmul

# the fused kernel unrolls at most this many leaves per launch (a rank's subtree)
MAX_KERNEL_LEAVES = 16


def check_leaves(leaves: int, K: int | None = None) -> int:
    """`leaves` must be a power of two >= 1 (and divide K when given)."""
    if not isinstance(leaves, int) or isinstance(leaves, bool) or leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"the number of K leaves must be a power of two >= 1, got {leaves!r}")
    if K is not None and K % leaves:
        raise ValueError(f"K={K} cannot be cut into {leaves} equal leaves")
    return leaves


def leaf_bounds(K: int, leaves: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of each leaf along K, in leaf order."""
    check_leaves(leaves, K)
    width = K // leaves
    return [(j * width, (j + 1) * width) for j in range(leaves)]


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The balanced binary tree over `parts` (a power-of-two count): adjacent pairs added
    level by level, lower index on the left. Elementwise IEEE adds only."""
    check_leaves(len(parts))
    level = list(parts)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def _leaf_rows(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """One row [1, K] -> its subtree root [1, N] float32."""
    return tree_sum([F.linear(x[:, lo:hi].contiguous(), weight[:, lo:hi].contiguous())
                     for lo, hi in leaf_bounds(x.shape[-1], leaves)])


def tree_linear_rows(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """CPU, invariant: x [..., K], weight [N, K] -> float32 [..., N], one row at a time
    (the library takes the same path for a row whatever the batch), each leaf of float32
    copies made contiguous (a leaf's bits must not depend on where its slice sat)."""
    K = x.shape[-1]
    N = weight.shape[0]
    check_leaves(leaves, K)
    if weight.shape[1] != K:
        raise ValueError(f"tree_linear: x has K={K}, weight has K={weight.shape[1]}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, K).float()
    wf = weight.float()
    if rows.shape[0] == 0:
        return torch.empty((*lead, N), dtype=torch.float32, device=x.device)
    out = torch.cat([_leaf_rows(rows[i:i + 1], wf, leaves) for i in range(rows.shape[0])], 0)
    return out.reshape(*lead, N)


def tree_linear_leafwise(x: torch.Tensor, weight: torch.Tensor, leaves: int, config: tuple | None = None,
                         allow_cublaslt: bool = True) -> torch.Tensor:
    """One invariant GEMM per leaf (float32 out), then `tree_sum`: the composition the
    fused kernel computes."""
    K = x.shape[-1]
    parts = [matmul.invariant_matmul(x[..., lo:hi], weight[:, lo:hi], out_dtype=torch.float32, config=config,
                                     allow_cublaslt=allow_cublaslt) for lo, hi in leaf_bounds(K, leaves)]
    return tree_sum(parts)


def linear_partial_fast(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """Fast mode: no tree, one library GEMM over the rank's K (`leaves` unused), float32 out;
    the ranks' partials are then summed (an all-reduce)."""
    del leaves
    return F.linear(x, weight).float()


def tree_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 x @ W^T (what every tree approximates)."""
    return x.double() @ weight.double().t()


@triton.jit
def _leaf(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j, stride_am, stride_ak, stride_bn, stride_bk,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    # leaf j: the invariant GEMM's float32 accumulation over [j KL, (j + 1) KL), from zero
    return matmul._dot_k(a_ptr + j * KL * stride_ak, b_ptr + j * KL * stride_bk, rm, rn, rk, M, N, KL,
                         stride_am, stride_ak, stride_bn, stride_bk, BM, BN, BK, EVEN_K)


@triton.jit
def _tree2(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j, stride_am, stride_ak, stride_bn, stride_bk,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    left = _leaf(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j, stride_am, stride_ak, stride_bn, stride_bk, BM, BN, BK, EVEN_K)
    right = _leaf(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j + 1, stride_am, stride_ak, stride_bn, stride_bk,
                  BM, BN, BK, EVEN_K)
    return left + right


@triton.jit
def _tree4(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j, stride_am, stride_ak, stride_bn, stride_bk,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    left = _tree2(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j, stride_am, stride_ak, stride_bn, stride_bk, BM, BN, BK, EVEN_K)
    right = _tree2(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j + 2, stride_am, stride_ak, stride_bn, stride_bk,
                   BM, BN, BK, EVEN_K)
    return left + right


@triton.jit
def _tree8(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j, stride_am, stride_ak, stride_bn, stride_bk,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    left = _tree4(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j, stride_am, stride_ak, stride_bn, stride_bk, BM, BN, BK, EVEN_K)
    right = _tree4(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j + 4, stride_am, stride_ak, stride_bn, stride_bk,
                   BM, BN, BK, EVEN_K)
    return left + right


@triton.jit
def _tree16(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j, stride_am, stride_ak, stride_bn, stride_bk,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    left = _tree8(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j, stride_am, stride_ak, stride_bn, stride_bk, BM, BN, BK, EVEN_K)
    right = _tree8(a_ptr, b_ptr, rm, rn, rk, M, N, KL, j + 8, stride_am, stride_ak, stride_bn, stride_bk,
                   BM, BN, BK, EVEN_K)
    return left + right


@triton.jit
def _tree_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, KL,
                        stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                        LEAVES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_n = matmul._tile_coords(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    if LEAVES == 1:
        total = _leaf(a_ptr, b_ptr, rm, rn, rk, M, N, KL, 0, stride_am, stride_ak, stride_bn, stride_bk,
                      BM, BN, BK, EVEN_K)
    elif LEAVES == 2:
        total = _tree2(a_ptr, b_ptr, rm, rn, rk, M, N, KL, 0, stride_am, stride_ak, stride_bn, stride_bk,
                       BM, BN, BK, EVEN_K)
    elif LEAVES == 4:
        total = _tree4(a_ptr, b_ptr, rm, rn, rk, M, N, KL, 0, stride_am, stride_ak, stride_bn, stride_bk,
                       BM, BN, BK, EVEN_K)
    elif LEAVES == 8:
        total = _tree8(a_ptr, b_ptr, rm, rn, rk, M, N, KL, 0, stride_am, stride_ak, stride_bn, stride_bk,
                       BM, BN, BK, EVEN_K)
    else:
        total = _tree16(a_ptr, b_ptr, rm, rn, rk, M, N, KL, 0, stride_am, stride_ak, stride_bn, stride_bk,
                        BM, BN, BK, EVEN_K)
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, total, mask=(rm[:, None] < M) & (rn[None, :] < N))


# (max M, BM, BN, BK, warps, stages): up to log2(leaves) + 1 float32 accumulator tiles are
# live at once, so tiles stay at 128 x 128 or below. Speed only: the per-leaf form fixes
# the bits whatever the tile (as for the invariant GEMM); to be tuned on the H200
# (benchmarks/kernels/tp_tree.py).
TREE_GPU_CONFIGS: list[tuple] = [
    (16, 16, 64, 128, 4, 4),
    (64, 64, 64, 128, 4, 4),
    (1 << 62, 128, 128, 64, 8, 3),
]
TREE_INTERPRET_CONFIGS: list[tuple] = [(1 << 62, 16, 16, 16, 1, 1)]  # the invariant GEMM's interpreter tiles


def _tree_config(M: int) -> tuple:
    table = TREE_INTERPRET_CONFIGS if matmul._interpreting() else TREE_GPU_CONFIGS
    return next(tuple(cfg) for max_m, *cfg in table if M <= max_m)


def tree_linear_triton(x: torch.Tensor, weight: torch.Tensor, leaves: int, config: tuple | None = None,
                       allow_cublaslt: bool = True) -> torch.Tensor:
    """CUDA (or the Triton interpreter), invariant: x [..., K], weight [N, K] -> float32
    [..., N] in one launch. `config` = (BM, BN, BK, warps, stages) overrides the table
    (speed only). `allow_cublaslt` is taken for the numerics table's kernel options and
    unused: every leaf runs in Triton."""
    del allow_cublaslt
    K = x.shape[-1]
    N, Kw = weight.shape
    check_leaves(leaves, K)
    if Kw != K:
        raise ValueError(f"tree_linear: x has K={K}, weight has K={Kw}")
    if leaves > MAX_KERNEL_LEAVES:
        return tree_linear_leafwise(x, weight, leaves)
    lead = x.shape[:-1]
    a = x.reshape(-1, K)
    M = a.shape[0]
    c = torch.empty((M, N), dtype=torch.float32, device=x.device)
    if M == 0:
        return c.reshape(*lead, N)
    bm, bn, bk, warps, stages = config or _tree_config(M)
    KL = K // leaves
    _tree_matmul_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        a, weight, c, M, N, KL, a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), c.stride(0), c.stride(1),
        LEAVES=leaves, BM=bm, BN=bn, BK=bk, GROUP_M=8, EVEN_K=KL % bk == 0, num_warps=warps, num_stages=stages)
    return c.reshape(*lead, N)
