"""Expert MLPs whose down projection is the K-leaf tree (vllm/kernels/leaf_tree.py).

Under tensor parallelism an expert's intermediate dim I is sharded: rank r holds gate and
up rows, and down columns, of the contiguous slice r of I. The down projection is then a
row-parallel GEMM over I, so it is cut into `leaves` contiguous leaves of I / G each, each
a float32 accumulation from zero, added in the fixed balanced tree; a rank computes its
subtree (G / C leaves) here and the ranks' roots are finished by `leaf_tree.tree_sum`.
Every (token, slot) pair's output is that root in float32, merged afterwards by the usual
fixed-slot merge (kernels/moe.py).

Invariant mode only: fast mode runs `ops.moe_experts` and sums the ranks' partials.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.kernels import leaf_tree, moe, ops


# ATen's CPU elementwise loops take a vector or a scalar path by where an element falls in
# the row (a row shorter than two vectors is all scalar), and the two round exp differently.
# A rank's slice of I is shorter than the whole: padding each half of the row to a multiple
# of this width keeps every element on the vector path whatever the slice.
_CPU_ACT_WIDTH = 64


def _silu_and_mul_cpu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for one row [1, 2n], each element on ATen's vector path."""
    gate, up = h.chunk(2, dim=-1)
    n = gate.shape[-1]
    pad = -n % _CPU_ACT_WIDTH
    return (F.silu(F.pad(gate, (0, pad))) * F.pad(up, (0, pad)))[:, :n]


def experts_tree_rows_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                          leaves: int) -> torch.Tensor:
    """CPU: every (token, slot) pair alone as a [1, K] row (moe.experts_rows_cpu's rule),
    the activation on ATen's vector path (`_silu_and_mul_cpu`), the down projection a tree
    of float32 leaves -> y [T, k, H] float32."""
    T, k = ids.shape
    H, inter = w2.shape[1], w2.shape[2]
    bounds = leaf_tree.leaf_bounds(inter, leaves)
    if T == 0:
        return x.new_zeros((0, k, H), dtype=torch.float32)
    ids_host = ids.tolist()
    w2_leaves: dict = {}
    out = []
    for t in range(T):
        row = x[t:t + 1].clone()
        for s in range(k):
            e = ids_host[t][s]
            act = _silu_and_mul_cpu(F.linear(row, w13[e])).float()
            if e not in w2_leaves:
                w2e = w2[e].float()
                w2_leaves[e] = [w2e[:, lo:hi].contiguous() for lo, hi in bounds]
            out.append(leaf_tree.tree_sum([F.linear(act[:, lo:hi].contiguous(), w)
                                           for (lo, hi), w in zip(bounds, w2_leaves[e])]))
    return torch.cat(out, 0).view(T, k, H)


def experts_tree_grouped_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                                leaves: int) -> torch.Tensor:
    """CUDA: the grouped Triton GEMM for gate_up, then one grouped down GEMM per leaf
    (strided views of the activation and of w2, float32 out) added by the tree ->
    y [T, k, H] float32. One launch per leaf: to be fused as the dense tree kernel is."""
    T, k = ids.shape
    E, H, inter = w13.shape[0], w2.shape[1], w2.shape[2]
    bounds = leaf_tree.leaf_bounds(inter, leaves)
    if T == 0:
        return x.new_zeros((0, k, H), dtype=torch.float32)
    block_m = moe.pick_moe_config(T * k, E)[0]
    plan = moe.make_plan(ids, E, block_m)
    h = moe.grouped_linear(x, w13, plan, a_indexed=True, a_div=k, c_indexed=False)
    act = ops.silu_and_mul(h)
    parts = [moe.grouped_linear(act[:, lo:hi], w2[:, :, lo:hi], plan, a_indexed=False, c_indexed=True,
                                num_c_rows=T * k, out_dtype=torch.float32) for lo, hi in bounds]
    return leaf_tree.tree_sum(parts).view(T, k, H)


def moe_experts_tree(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                     leaves: int) -> torch.Tensor:
    """The invariant expert MLPs with a `leaves`-leaf down projection (a rank's subtree)."""
    leaf_tree.check_leaves(leaves, w2.shape[2])
    if x.is_cuda:
        return experts_tree_grouped_triton(x, w13, w2, ids, leaves)
    return experts_tree_rows_cpu(x, w13, w2, ids, leaves)
