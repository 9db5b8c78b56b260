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
- `tree_linear_triton` (CUDA, invariant): one persistent launch, each program computing
  its output tiles' leaves in turn and adding them in tree order (the subtrees waiting for
  a right sibling in an L2-resident scratch);
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
def _tree_matmul_kernel(a_ptr, b_ptr, c_ptr, stack_ptr, M, N, KL,
                        stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                        LEAVES: tl.constexpr, LEVELS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """Persistent: each program walks output tiles; per tile, the leaves in order, each the
    invariant GEMM's float32 accumulation from zero over its K range. The tree is evaluated
    as a binary counter: after leaf j, the finished subtrees waiting for a right sibling
    (at most LEVELS of them, one per level) are added on the left, lower index first, and
    the result waits at the first level where j's bit is 0. Those waiting subtrees live in
    this program's rows of an L2-resident float32 scratch (`stack_ptr`), not in registers:
    a register stack of log2(leaves) accumulator tiles spilled inside the K loop."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    lm = tl.arange(0, BM)
    ln = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    slot = stack_ptr + pid.to(tl.int64) * (LEVELS * BM * BN) + lm[:, None] * BN + ln[None, :]
    for tile in range(pid, num_tiles, nprog):
        pid_m, pid_n = matmul._tile_coords(tile, M, N, BM, BN, GROUP_M)
        rm = pid_m.to(tl.int64) * BM + lm
        rn = pid_n.to(tl.int64) * BN + ln
        for j in tl.static_range(LEAVES):
            cur = matmul._dot_k(a_ptr + j * KL * stride_ak, b_ptr + j * KL * stride_bk, rm, rn, rk, M, N, KL,
                                stride_am, stride_ak, stride_bn, stride_bk, BM, BN, BK, EVEN_K)
            for level in tl.static_range(LEVELS):
                low = (2 << level) - 1
                if (j & low) == low:
                    # bits 0..level of j all set: the left sibling at this level finished
                    # earlier (every thread stored its part of it before the barrier that
                    # followed the store)
                    cur = tl.load(slot + level * BM * BN) + cur
                elif (j & low) == (low >> 1):
                    # the lower bits set, this one clear: wait here for the right sibling
                    tl.store(slot + level * BM * BN, cur)
                    tl.debug_barrier()
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, cur,
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _counter_step(stack_desc, cur, j, row0, LEVELS: tl.constexpr, BM: tl.constexpr):
    """Leaf j's sum `cur` into the binary counter of waiting subtrees (rows row0 .. row0 +
    LEVELS of the scratch, BM rows each): at each level where j closes a pair the waiting
    left sibling is added on the left, where j opens one `cur` waits there. Returns the
    subtree `cur` ended as (the whole tree after the last leaf). With j a compile-time
    constant (one loop per leaf) the branches resolve at compile time."""
    for level in tl.static_range(LEVELS):
        low = (2 << level) - 1
        if (j & low) == low:
            cur = stack_desc.load([(row0 + level) * BM, 0]) + cur
        elif (j & low) == (low >> 1):
            stack_desc.store([(row0 + level) * BM, 0], cur)
    return cur


@triton.jit
def _tree_tma_kernel(a_desc, b_desc, c_desc, stack_desc, M, N, KL,
                     LEAVES: tl.constexpr, LEVELS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, GROUP_M: tl.constexpr):
    """`_tree_matmul_kernel` with Hopper TMA loads and stores (the invariant GEMM's
    `_tma_dot_k` form per leaf; KL a multiple of BK, so a leaf never reads its neighbour's
    K; the waiting subtrees and the output through descriptors too): the same bits, with no
    per-element pointer tensors held in registers."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in range(pid, num_tiles, nprog):
        pid_m, pid_n = matmul._tile_coords(tile, M, N, BM, BN, GROUP_M)
        for j in tl.static_range(LEAVES):
            cur = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(0, KL // BK):
                a = a_desc.load([pid_m * BM, j * KL + ki * BK])
                b = b_desc.load([pid_n * BN, j * KL + ki * BK])
                cur = tl.dot(a, b.T, cur)
            cur = _counter_step(stack_desc, cur, j, pid * LEVELS, LEVELS, BM)
        c_desc.store([pid_m * BM, pid_n * BN], cur)


@triton.jit
def _tree_tma_flat_kernel(a_desc, b_desc, c_desc, stack_desc, M, N, KL,
                          LEAVES: tl.constexpr, LEVELS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, GROUP_M: tl.constexpr):
    """`_tree_tma_kernel` with one K loop over all leaves, so the TMA pipeline keeps loading
    across leaf boundaries: at the end of leaf j the binary counter runs (as there), and the
    accumulator restarts from exact zeros for leaf j + 1. Every leaf is still one float32
    accumulation from zero over its own K: the same bits."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    steps = KL // BK
    for tile in range(pid, num_tiles, nprog):
        pid_m, pid_n = matmul._tile_coords(tile, M, N, BM, BN, GROUP_M)
        cur = tl.zeros((BM, BN), dtype=tl.float32)
        for it in range(0, LEAVES * steps):
            a = a_desc.load([pid_m * BM, it * BK])
            b = b_desc.load([pid_n * BN, it * BK])
            cur = tl.dot(a, b.T, cur)
            if (it + 1) % steps == 0:
                j = it // steps
                cur = _counter_step(stack_desc, cur, j, pid * LEVELS, LEVELS, BM)
                if j < LEAVES - 1:
                    cur = tl.zeros((BM, BN), dtype=tl.float32)
        c_desc.store([pid_m * BM, pid_n * BN], cur)


# (max M, impl, BM, BN, BK, warps, stages). Speed only: the per-leaf form fixes the bits
# whatever the tile and impl (as for the invariant GEMM). "tmaf" is "tma" with one K loop
# over all leaves (the pipeline runs across leaf boundaries). "tma"/"tmaf" need K / leaves to be a
# multiple of BK and 16-byte aligned rows, else the entry runs as "plain". Register use read
# offline for sm_90 (triton.compile + cuobjdump -res-usage, 8 leaves): tma 128x128x64 at 8
# warps 210 registers, no spill, 164 KB shared; 128x256 does not fit shared memory; the
# plain kernel spills at 128x128 (its pointer tensors). Timed by benchmarks/kernels/tp_tree.py.
TREE_GPU_CONFIGS: list[tuple] = [   # the H200 winners of `benchmarks/kernels/tp_tree.py --sweep` (benchmarks/NOTES.md)
    (16, "plain", 16, 32, 128, 4, 4),
    (64, "tmaf", 64, 64, 128, 4, 4),
    (256, "tma", 64, 128, 64, 4, 4),
    (1 << 62, "tma", 128, 128, 64, 8, 4),
]
TREE_INTERPRET_CONFIGS: list[tuple] = [(1 << 62, "plain", 16, 16, 16, 1, 1)]  # the invariant GEMM's interpreter tiles


def _tree_config(M: int) -> tuple:
    table = TREE_INTERPRET_CONFIGS if matmul._interpreting() else TREE_GPU_CONFIGS
    return next(tuple(cfg) for max_m, *cfg in table if M <= max_m)


_STACKS: dict = {}


def _stack(device: torch.device, numel: int) -> torch.Tensor:
    """The programs' float32 scratch for waiting subtrees, kept per device (only grows).
    Its contents never outlive a launch; launches on one stream are ordered."""
    key = (device.type, device.index)
    buf = _STACKS.get(key)
    if buf is None or buf.numel() < numel:
        buf = _STACKS[key] = torch.empty(max(numel, 1), dtype=torch.float32, device=device)
    return buf


def tree_linear_triton(x: torch.Tensor, weight: torch.Tensor, leaves: int, config: tuple | None = None,
                       allow_cublaslt: bool = True) -> torch.Tensor:
    """CUDA (or the Triton interpreter), invariant: x [..., K], weight [N, K] -> float32
    [..., N] in one launch. `config` = (impl, BM, BN, BK, warps, stages) overrides the
    table (speed only). `allow_cublaslt` is taken for the numerics table's kernel options and
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
    impl, bm, bn, bk, warps, stages = config or _tree_config(M)
    KL = K // leaves
    levels = leaves.bit_length() - 1
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    programs = min(tiles, matmul._num_programs(x.device)) if x.device.type == "cuda" else tiles
    # one BM x BN float32 tile per level per program (at least one: a descriptor needs rows)
    stack = _stack(x.device, programs * max(levels, 1) * bm * bn).narrow(0, 0, programs * max(levels, 1) * bm * bn)
    if impl in ("tma", "tmaf") and KL % bk == 0 and matmul._tma_ok(a, weight, c):
        from triton.tools.tensor_descriptor import TensorDescriptor
        kernel = _tree_tma_flat_kernel if impl == "tmaf" else _tree_tma_kernel
        kernel[(programs,)](
            TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
            TensorDescriptor.from_tensor(c, [bm, bn]), TensorDescriptor.from_tensor(stack.view(-1, bn), [bm, bn]),
            M, N, KL, LEAVES=leaves, LEVELS=levels, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps,
            num_stages=stages)
    else:
        _tree_matmul_kernel[(programs,)](
            a, weight, c, stack, M, N, KL, a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), c.stride(0),
            c.stride(1), LEAVES=leaves, LEVELS=levels, BM=bm, BN=bn, BK=bk, GROUP_M=8, EVEN_K=KL % bk == 0,
            num_warps=warps, num_stages=stages)
    return c.reshape(*lead, N)
