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
  its output tiles in ONE K loop over all leaves, the subtrees waiting for a right sibling
  in registers ("tmar" / "plainr") or with the top level of them in an L2-resident scratch
  ("tmah"), added in tree order;
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
def _after_bulk_stores(row, EMULATE: tl.constexpr):
    """`row` unchanged, returned after this thread's bulk (TMA) stores have finished
    writing global memory (`cp.async.bulk.wait_group 0`). A TMA store's own wait (`.read`)
    only waits until its shared-memory source has been read, so a TMA load of rows stored
    earlier in the kernel takes its row from here: the data dependence orders the load
    after the wait (an unused result would be dropped). Every thread runs the wait, and a
    box of the tile is stored and loaded by the same thread (the same box-to-warp mapping
    for both; in the sm_90 PTX a bar.sync also separates the wait from the load's issue).
    The interpreter (EMULATE) has no inline PTX and needs no wait."""
    if not EMULATE:
        row = tl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n mov.u32 $0, $1;", "=r,r", [row],
                                        dtype=tl.int32, is_pure=False, pack=1)
    return row


@triton.jit
def _scratch_levels(cur, j, stack_desc, row0, LEVELS: tl.constexpr, REG_LEVELS: tl.constexpr, BM: tl.constexpr,
                    EMULATE: tl.constexpr):
    """Levels REG_LEVELS .. LEVELS - 1 of the binary counter, their waiting subtrees in
    this program's rows of the float32 scratch (row0 + (level - REG_LEVELS) * BM): where
    leaf j closes the pair the left sibling is loaded and added on the left, where it opens
    one `cur` is stored. After the last leaf `cur` is the root."""
    for level in tl.static_range(REG_LEVELS, LEVELS):
        low = (2 << level) - 1
        row = row0 + (level - REG_LEVELS) * BM
        if (j & low) == low:
            cur = stack_desc.load([_after_bulk_stores(row, EMULATE), 0]) + cur
        elif (j & low) == (low >> 1):
            stack_desc.store([row, 0], cur)
    return cur


@triton.jit
def _counter_level(cur, s, j, LEVEL: tl.constexpr, LEVELS: tl.constexpr):
    """One level of the binary counter of waiting subtrees held in registers, at the end
    of leaf j (a runtime scalar, the same in every thread). Where bits 0 .. LEVEL of j are
    all set the pair at this level closes: the waiting left sibling `s` is added on the
    left and `cur` (the pair) moves up; where only the bits below LEVEL are set `cur`
    waits in `s` for its right sibling. The top level also holds the root: its pair closes
    only at the last leaf (every bit set), and the sum stays in `s`."""
    low = (2 << LEVEL) - 1
    if (j & low) == low:
        if LEVEL == LEVELS - 1:
            s = s + cur
        else:
            cur = s + cur
    elif (j & low) == (low >> 1):
        s = cur
    return cur, s


@triton.jit
def _counter_regs(cur, s0, s1, s2, s3, j, LEVELS: tl.constexpr, REG_LEVELS: tl.constexpr):
    """Leaf j's sum `cur` into the lowest REG_LEVELS (<= LEVELS <= 4) levels of the register
    counter s0 .. s3 (unused ones pass through and the compiler drops them), level by level
    up from 0; returns `cur` as it leaves them (the pair that moves up to the levels above,
    when j closes every one) and the counter. With REG_LEVELS = LEVELS, after the last leaf
    the whole tree is in s{LEVELS-1}: at 8 leaves ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
    (l6 + l7)), as `tree_sum`. One branch per level on j: Triton keeps the MMA asynchronous
    with the accumulator read only under these branches (a wait there), where fully nested
    branches made it wait after every dot, and the branches cost fewer instructions and
    registers than selects over every level."""
    if REG_LEVELS > 0:
        cur, s0 = _counter_level(cur, s0, j, 0, LEVELS)
    if REG_LEVELS > 1:
        cur, s1 = _counter_level(cur, s1, j, 1, LEVELS)
    if REG_LEVELS > 2:
        cur, s2 = _counter_level(cur, s2, j, 2, LEVELS)
    if REG_LEVELS > 3:
        cur, s3 = _counter_level(cur, s3, j, 3, LEVELS)
    return cur, s0, s1, s2, s3


@triton.jit
def _counter_root(s0, s1, s2, s3, LEVELS: tl.constexpr):
    """The tree's root after the last leaf: the top level of the register counter."""
    if LEVELS == 1:
        root = s0
    elif LEVELS == 2:
        root = s1
    elif LEVELS == 3:
        root = s2
    else:
        root = s3
    return root


@triton.jit
def _tree_regs_kernel(a_ptr, b_ptr, c_ptr, M, N, KL,
                      stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                      LEAVES: tl.constexpr, LEVELS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """Persistent, pointer loads: per output tile ONE K loop over all leaves (the pipeline
    keeps loading across leaf boundaries), the subtrees waiting for a right sibling held in
    registers (`_counter_regs`, at most LEVELS float32 tiles next to the accumulator). Leaf
    j is iterations [j steps, (j + 1) steps) of the loop, its K tiles masked to its own K
    range when BK does not divide K / leaves; at its last iteration the counter takes the
    leaf's sum and the accumulator restarts from exact zeros. Every leaf is still one
    float32 accumulation from zero over its K, added in the fixed tree: the bits of
    `tree_linear_leafwise`. One leaf (LEVELS = 0) is the invariant GEMM."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    lm = tl.arange(0, BM)
    ln = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    steps = tl.cdiv(KL, BK)
    for tile in range(pid, num_tiles, nprog):
        pid_m, pid_n = matmul._tile_coords(tile, M, N, BM, BN, GROUP_M)
        rm = pid_m.to(tl.int64) * BM + lm
        rn = pid_n.to(tl.int64) * BN + ln
        if LEVELS == 0:
            root = matmul._dot_k(a_ptr, b_ptr, rm, rn, rk, M, N, KL, stride_am, stride_ak, stride_bn, stride_bk,
                                 BM, BN, BK, EVEN_K)
        else:
            a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
            b_ptrs = b_ptr + rn[None, :] * stride_bn + rk[:, None] * stride_bk
            m_ok = rm[:, None] < M
            n_ok = rn[None, :] < N
            cur = tl.zeros((BM, BN), dtype=tl.float32)
            s0 = tl.zeros((BM, BN), dtype=tl.float32)
            s1 = tl.zeros((BM, BN), dtype=tl.float32)
            s2 = tl.zeros((BM, BN), dtype=tl.float32)
            s3 = tl.zeros((BM, BN), dtype=tl.float32)
            for it in range(0, LEAVES * steps):
                j = it // steps
                ki = it - j * steps
                k0 = j * KL + ki * BK
                if EVEN_K:
                    a = tl.load(a_ptrs + k0 * stride_ak, mask=m_ok, other=0.0)
                    b = tl.load(b_ptrs + k0 * stride_bk, mask=n_ok, other=0.0)
                else:
                    k_left = KL - ki * BK
                    a = tl.load(a_ptrs + k0 * stride_ak, mask=m_ok & (rk[None, :] < k_left), other=0.0)
                    b = tl.load(b_ptrs + k0 * stride_bk, mask=n_ok & (rk[:, None] < k_left), other=0.0)
                cur = tl.dot(a, b, cur)
                if ki == steps - 1:
                    _, s0, s1, s2, s3 = _counter_regs(cur, s0, s1, s2, s3, j, LEVELS, LEVELS)
                    cur = tl.zeros((BM, BN), dtype=tl.float32)
            root = _counter_root(s0, s1, s2, s3, LEVELS)
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, root,
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _tree_tma_regs_kernel(a_desc, b_desc, c_desc, stack_desc, M, N, KL,
                          LEAVES: tl.constexpr, LEVELS: tl.constexpr, REG_LEVELS: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                          EMULATE: tl.constexpr):
    """`_tree_regs_kernel` with Hopper TMA loads and store (KL a multiple of BK, so a K tile
    never straddles two leaves): one K loop over all leaves. The counter's lowest
    REG_LEVELS levels wait in registers; the ones above (the longest-lived and least often
    touched: the top level is stored once and loaded once per tile) in an L2-resident
    scratch (`_scratch_levels`), which leaves registers for a wider tile. "tmar" keeps every
    level in registers (REG_LEVELS = LEVELS), "tmah" the top one in scratch. The leaf-end work sits under `if` (the form of Triton's persistent-matmul
    tutorial): the wgmma stays asynchronous (one group in flight) and waits for the
    accumulator only in that branch, where the counter reads it; the reset to zeros is
    register moves there. (Triton 3.8 runs OptimizeAccumulatorInit, which would turn the
    reset into the MMA's use-accumulator flag, only for sm_100 and newer.)"""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    steps = KL // BK
    row0 = pid * ((LEVELS - REG_LEVELS) * BM)
    for tile in range(pid, num_tiles, nprog):
        pid_m, pid_n = matmul._tile_coords(tile, M, N, BM, BN, GROUP_M)
        if LEVELS == 0:
            root = matmul._tma_dot_k(a_desc, b_desc, pid_m * BM, pid_n * BN, KL, BM, BN, BK)
            c_desc.store([pid_m * BM, pid_n * BN], root)
        else:
            cur = tl.zeros((BM, BN), dtype=tl.float32)
            s0 = tl.zeros((BM, BN), dtype=tl.float32)
            s1 = tl.zeros((BM, BN), dtype=tl.float32)
            s2 = tl.zeros((BM, BN), dtype=tl.float32)
            s3 = tl.zeros((BM, BN), dtype=tl.float32)
            for it in range(0, LEAVES * steps):
                a = a_desc.load([pid_m * BM, it * BK])
                b = b_desc.load([pid_n * BN, it * BK])
                cur = tl.dot(a, b.T, cur)
                if (it + 1) % steps == 0:
                    cur, s0, s1, s2, s3 = _counter_regs(cur, s0, s1, s2, s3, it // steps, LEVELS, REG_LEVELS)
                    if REG_LEVELS < LEVELS:  # the levels above in the scratch; the root comes out in cur
                        cur = _scratch_levels(cur, it // steps, stack_desc, row0, LEVELS, REG_LEVELS, BM, EMULATE)
                        if it == LEAVES * steps - 1:
                            c_desc.store([pid_m * BM, pid_n * BN], cur)
                    cur = tl.zeros((BM, BN), dtype=tl.float32)
            if REG_LEVELS == LEVELS:
                c_desc.store([pid_m * BM, pid_n * BN], _counter_root(s0, s1, s2, s3, LEVELS))


# (max M, impl, BM, BN, BK, warps, stages). Speed only: the per-leaf form fixes the bits
# whatever the tile and impl (as for the invariant GEMM). Every impl runs one K loop over all
# leaves: "tmar" / "plainr" with the waiting subtrees in registers (no scratch), "tmah" with
# the counter's top level in the scratch. The TMA impls need K / leaves to be a multiple of
# BK and 16-byte aligned rows, else the entry runs as "plainr". Register use read offline for
# sm_90 (triton.compile + cuobjdump -res-usage, 8 leaves): tmar (four float32 tiles live) 183
# registers at 64x64 / 4 warps and 128x64 or 64x128 / 8 warps, spilling at 64x128 / 4 warps
# and 128x128; tmah (three) 255 at 128x128 / 8 warps, a 56-byte spill. Measured and
# deleted (benchmarks/NOTES.md, sessions 16-24): the leaves in turn, their waiting subtrees
# in the scratch, with pointer loads ("plain") or TMA ("tma": 1.56-2.30x the invariant GEMM
# at large M), and "tmah2" (the top two levels in the scratch): none won at any M.
# Above M = 256 the choice follows the leaves: at 4 or fewer "tmar" keeps a 128 x 128 tile's
# waiting subtrees in registers (205 registers, no spill); at 8, short leaves (o_proj: 512)
# take "tmah" (the top level in the scratch), long ones (down_proj: 1,536) still "tmar".
# H200, Qwen3-8B's shapes, best / invariant GEMM at M = 4,096 and 16,384: 8 leaves o 1.70 /
# 1.57 (tmah; 3-10% under the tmar entry), down 1.43 / 1.39 (tmar); 4 leaves o 1.22 / 1.21,
# down 1.27 / 1.17 (tmar). At M = 32 "plainr" 16 x 64 costs 1.14-1.58x where the 64-row
# "tmar" entry cost 1.8-2.4x (benchmarks/NOTES.md).
TREE_GPU_CONFIGS: list[tuple] = [   # the H200 winners of `benchmarks/kernels/tp_tree.py --sweep` (benchmarks/NOTES.md)
    (16, "plainr", 16, 32, 256, 4, 4),
    (32, "plainr", 16, 64, 256, 4, 4),
    (64, "tmar", 64, 32, 128, 4, 6),
    (256, "tmar", 128, 64, 128, 8, 3),
]
TREE_GPU_LARGE_M = ("tmar", 128, 128, 64, 8, 4)
TREE_GPU_SHORT_LEAF = 1024          # K / leaves at or below it, at more than 4 leaves: the entry below
TREE_GPU_SHORT_LEAF_LARGE_M = ("tmah", 128, 128, 64, 8, 3)
# the one-K-loop impls: how many of the counter's top levels wait in the scratch (the rest in
# registers); where TMA cannot run they run as "plainr" (every level in registers)
ONE_LOOP_IMPLS = {"plainr": 0, "tmar": 0, "tmah": 1}
TREE_IMPLS = tuple(ONE_LOOP_IMPLS)
TREE_INTERPRET_CONFIGS: list[tuple] = [(1 << 62, "plainr", 16, 16, 16, 1, 1)]  # the invariant GEMM's interpreter tiles


def _tree_config(M: int, leaves: int, leaf_width: int) -> tuple:
    """(impl, BM, BN, BK, warps, stages) for M rows and `leaves` leaves of `leaf_width` (K /
    leaves) each."""
    if matmul._interpreting():
        return next(tuple(cfg) for max_m, *cfg in TREE_INTERPRET_CONFIGS if M <= max_m)
    for max_m, *cfg in TREE_GPU_CONFIGS:
        if M <= max_m:
            return tuple(cfg)
    if leaves > 4 and leaf_width <= TREE_GPU_SHORT_LEAF:
        return TREE_GPU_SHORT_LEAF_LARGE_M
    return TREE_GPU_LARGE_M


_STACKS: dict = {}
_RETIRED_STACKS: list = []


def _stack(device: torch.device, numel: int) -> torch.Tensor:
    """The programs' float32 scratch for waiting subtrees, kept per device (only grows).
    Its contents never outlive a launch; launches on one stream are ordered. A buffer that a
    larger one replaces stays allocated: a CUDA graph that captured a launch keeps its
    address (a few MB at most: programs x levels x one output tile)."""
    key = (device.type, device.index)
    buf = _STACKS.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED_STACKS.append(buf)
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
    if not (x.is_cuda and weight.is_cuda) and not matmul._interpreting():
        # a tensor descriptor over host memory is not checked at launch: the kernel would
        # fault on the device (and poison the CUDA context) instead of raising here
        raise RuntimeError("tree_linear_triton needs CUDA tensors (CPU tensors: TRITON_INTERPRET=1)")
    if leaves > MAX_KERNEL_LEAVES:
        return tree_linear_leafwise(x, weight, leaves)
    lead = x.shape[:-1]
    a = x.reshape(-1, K)
    M = a.shape[0]
    c = torch.empty((M, N), dtype=torch.float32, device=x.device)
    if M == 0:
        return c.reshape(*lead, N)
    impl, bm, bn, bk, warps, stages = config or _tree_config(M, leaves, K // leaves)
    if impl not in TREE_IMPLS:
        raise ValueError(f"tree impl must be one of {TREE_IMPLS}, got {impl!r}")
    KL = K // leaves
    levels = leaves.bit_length() - 1
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    programs = min(tiles, matmul._num_programs(x.device)) if x.device.type == "cuda" else tiles
    tma = impl.startswith("tma") and KL % bk == 0 and matmul._tma_ok(a, weight, c)
    opts = dict(LEAVES=leaves, LEVELS=levels, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    if not tma:
        _tree_regs_kernel[(programs,)](a, weight, c, M, N, KL, a.stride(0), a.stride(1), weight.stride(0),
                                       weight.stride(1), c.stride(0), c.stride(1), EVEN_K=KL % bk == 0, **opts,
                                       enable_fp_fusion=True)
        return c.reshape(*lead, N)
    from triton.tools.tensor_descriptor import TensorDescriptor
    descs = (TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
             TensorDescriptor.from_tensor(c, [bm, bn]))
    reg_levels = max(levels - ONE_LOOP_IMPLS[impl], 0)
    if reg_levels < levels:  # the scratch levels' float32 tiles, one per level per program
        numel = programs * (levels - reg_levels) * bm * bn
        stack_desc = TensorDescriptor.from_tensor(_stack(x.device, numel).narrow(0, 0, numel).view(-1, bn), [bm, bn])
    else:  # no scratch: the output's descriptor (same block type) stands in, never read
        stack_desc = descs[2]
    _tree_tma_regs_kernel[(programs,)](*descs, stack_desc, M, N, KL, REG_LEVELS=reg_levels,
                                       EMULATE=matmul._interpreting(), **opts, enable_fp_fusion=True)
    return c.reshape(*lead, N)
