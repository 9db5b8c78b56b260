"""Tensor parallelism whose bits do not depend on its size, applied after build.

Ranks 0..C-1 share the work of every layer without changing a bit:
- column-parallel layers (qkv_proj, gate_up_proj, each MoE expert's gate and up rows)
  and attention heads are cut by output rows: rank r computes the r-th contiguous
  C-th of each stacked shard (its q heads, its kv heads, its slice of the intermediate
  dim). No reduction crosses a shard, so nothing is summed.
- row-parallel layers (o_proj, down_proj, each MoE expert's down projection) reduce
  over a sharded K (the `tree_linear` op of the numerics table). In invariant mode K is cut into G contiguous leaves (`leaves`, a
  power of two >= C); rank r owns leaves [r G/C, (r + 1) G/C), a whole subtree of the
  fixed balanced float32 tree (vllm/kernels/leaf_tree.py), computes its root, and the
  exchange gathers the C roots as bit patterns; `tree_sum` of the roots finishes the
  tree, the bias is added and the sum rounded once. Every C dividing G evaluates the
  same expression, so TP=1 with G leaves equals TP=C bit for bit. Collectives move
  bits only; they never reduce. Fast mode sums plain partials instead (an all-reduce).

Two exchanges, one interface (`local_ranks`, `gather`, `sum`):
- `InProcessExchange(C)`: every rank in this process on one device (the model keeps all
  weights; each rank reads views of its slices): how one GPU proves TP=C's bits;
- `ProcessGroupExchange(group)`: one rank per process of a torch.distributed group
  (gloo on CPU, NCCL on GPUs), each keeping only its shards. Forward only (rollout,
  logprob scoring): it refuses a gradient.

MoE blocks with expert parallelism applied keep their experts whole (EP moves rows, the
tree still cuts each expert's down projection into G leaves). Models whose layers this
plan does not cover (recurrent mixers, FP8 linears) are refused with a ValueError.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from vllm.forward_context import current_numerics
from vllm.kernels import ops
from vllm.kernels.leaf_tree import check_leaves, tree_sum
from vllm.layers.attention import Attention
from vllm.layers.linear import FusedLinear, Linear
from vllm.layers.moe import FusedExperts, SparseMoeBlock

DEFAULT_LEAVES = 8
# HF's names of the sharded projections (those of every model the plan covers)
COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
LEAF_RULE = ("K cut into G contiguous equal leaves; each leaf one float32 accumulation from zero (the invariant "
             "GEMM's form); leaves added in a balanced float32 binary tree, lower index left; rank r of C owns "
             "leaves [r G/C, (r+1) G/C); roots all-gathered as bit patterns; bias added after the root; one cast")


def _wire(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class InProcessExchange:
    """All C ranks in this process: each rank's partial is computed here, so gathering is
    taking them in rank order."""

    def __init__(self, size: int):
        self.size = size
        self.local_ranks = list(range(size))

    def gather(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(parts)

    def sum(self, parts: list[torch.Tensor]) -> torch.Tensor:
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out


class ProcessGroupExchange:
    """Rank r of `group` computes partial r; all_gather moves the partials' bits."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.local_ranks = [dist.get_rank(group)]

    def _check_no_grad(self, t: torch.Tensor) -> None:
        if torch.is_grad_enabled() and t.requires_grad:
            raise ValueError("tensor parallelism over a process group is forward-only: run it under torch.no_grad()")

    def gather(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        (local,) = parts
        self._check_no_grad(local)
        wire = _wire(local)
        out = [torch.empty_like(wire) for _ in range(self.size)]
        dist.all_gather(out, wire, group=self.group)
        return [o.view(local.dtype) for o in out]

    def sum(self, parts: list[torch.Tensor]) -> torch.Tensor:
        (local,) = parts
        self._check_no_grad(local)
        # gloo has no bfloat16 reduction: fast mode sums in float32 there
        buf = local.float() if local.dtype in (torch.bfloat16, torch.float16) else local.clone()
        dist.all_reduce(buf, group=self.group)
        return buf.to(local.dtype)


@dataclass
class TensorParallel:
    """The plan every hook shares: C ranks, G leaves, the exchange."""
    size: int
    leaves: int
    exchange: object
    sharded: bool  # True: this process holds only its own shards (process group)

    def rank_slice(self, width: int, r: int) -> slice:
        """Rank r's contiguous slice of a dim of full width (the whole local dim when sharded)."""
        if self.sharded:
            return slice(0, width)
        part = width // self.size
        return slice(r * part, (r + 1) * part)

    @property
    def local_ranks(self) -> list[int]:
        return self.exchange.local_ranks

    @property
    def leaves_per_rank(self) -> int:
        return self.leaves // self.size

    def policy(self) -> dict:
        """The execution contract's numerical entry (vllm/contract.py): G and the leaf rule."""
        return {"leaves": self.leaves, "rule": LEAF_RULE}


class ColumnParallel:
    """A FusedLinear cut by output rows: each rank the r-th C-th of every stacked shard;
    the ranks' rows are put back in the layer's stacking order (in one process)."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp

    def __call__(self, layer: FusedLinear, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sharded:
            return ops.linear(x, layer.weight, layer.bias)
        outs = {sid: [] for sid in layer.shard_offsets}
        for r in self.tp.local_ranks:
            rows = [layer.shard(layer.weight, sid)[self.tp.rank_slice(size, r)]
                    for sid, (_, size) in layer.shard_offsets.items()]
            bias = None if layer.bias is None else torch.cat(
                [layer.shard(layer.bias, sid)[self.tp.rank_slice(size, r)] for sid, (_, size) in layer.shard_offsets.items()])
            y = ops.linear(x, torch.cat(rows), bias)
            for sid, part in zip(layer.shard_offsets, y.split([w.shape[0] for w in rows], dim=-1)):
                outs[sid].append(part)
        return torch.cat([p for sid in layer.shard_offsets for p in outs[sid]], dim=-1)


class RowParallel:
    """A Linear reducing over a sharded K: the leaf tree in invariant mode, a sum of plain
    partials in fast mode."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp

    def __call__(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        K = x.shape[-1]
        shards = [(x[..., tp.rank_slice(K, r)], layer.weight[:, tp.rank_slice(K, r)]) for r in tp.local_ranks]
        parts = [ops.tree_linear(xs, ws, tp.leaves_per_rank) for xs, ws in shards]
        y = tree_sum(tp.exchange.gather(parts)) if current_numerics() == "invariant" else tp.exchange.sum(parts)
        if layer.bias is not None:
            y = y + layer.bias.float()
        return y.to(x.dtype)


class ExpertsTensorParallel:
    """FusedExperts with the intermediate dim I sharded: rank r runs every expert's gate
    and up rows of its slice of I and the down projection over that slice (its subtree of
    the leaf tree); the ranks' float32 roots are gathered and finished by the tree."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp

    def __call__(self, experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        inter = experts.intermediate_size
        w13, w2 = experts.gate_up_proj, experts.down_proj
        parts = []
        invariant = current_numerics() == "invariant"
        for r in tp.local_ranks:
            sl = tp.rank_slice(inter, r)
            if tp.sharded:
                w13_r, w2_r = w13, w2
            else:
                w13_r = torch.cat([w13[:, :inter][:, sl], w13[:, inter:][:, sl]], dim=1)
                w2_r = w2[:, :, sl]
            parts.append(experts.compute(x, w13_r, w2_r, ids, tp.leaves_per_rank if invariant else None))
        if invariant:
            return tree_sum(tp.exchange.gather(parts))
        return tp.exchange.sum(parts)


def _check_model(model: nn.Module, size: int, sharded: bool) -> None:
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, Linear):
            if leaf not in COLUMN_PARALLEL + ROW_PARALLEL:
                raise ValueError(f"tensor parallelism does not cover the linear layer {name!r} of "
                                 f"{type(model).__name__} (covered: {COLUMN_PARALLEL + ROW_PARALLEL})")
            if m.fp8:
                raise ValueError("tensor parallelism does not cover FP8 linear layers yet")
            if m.parallel is not None:
                raise ValueError("tensor parallelism is already applied to this model")
            if leaf in COLUMN_PARALLEL and not isinstance(m, FusedLinear):
                raise ValueError(f"{name!r}: a column-parallel layer must be a FusedLinear")
        elif hasattr(m, "cache_spec") and not isinstance(m, Attention):
            raise ValueError(f"tensor parallelism does not cover {type(m).__name__} ({name!r}) yet")
        # in one process a head's rows may fall to two ranks (the bits are the same); a rank
        # holding its own KV heads needs whole heads (kv-head replication is not written yet)
        if sharded and isinstance(m, Attention) and (m.num_heads % size or m.num_kv_heads % size):
            raise ValueError(f"{m.num_heads} q heads / {m.num_kv_heads} kv heads cannot be split over "
                             f"tensor_parallel_size={size}")


def _check_divisible(model: nn.Module, size: int, leaves: int) -> None:
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, Linear) and leaf in ROW_PARALLEL and m.in_features % leaves:
            raise ValueError(f"{name!r}: K={m.in_features} cannot be cut into tp_leaves={leaves} equal leaves")
        if isinstance(m, FusedLinear):
            for sid, (_, n) in m.shard_offsets.items():
                if n % size:
                    raise ValueError(f"{name!r}: shard {sid!r} of {n} rows cannot be split over "
                                     f"tensor_parallel_size={size}")
        if isinstance(m, FusedExperts) and m.intermediate_size % leaves:
            raise ValueError(f"{name!r}: moe intermediate size {m.intermediate_size} cannot be cut into "
                             f"tp_leaves={leaves} equal leaves")


def apply_tensor_parallel(model: nn.Module, size: int | None = None, leaves: int = DEFAULT_LEAVES,
                          group=None) -> nn.Module:
    """Make `model` tensor-parallel, in place; returns the model.

    `size` alone: all ranks in this process (the model keeps every weight; size=1 with
    `leaves` is the tree at TP=1, the bits every size gives). `group` (a torch.distributed
    group): one rank per process, each keeping only its shards (heads, slices of the
    intermediate dims, the matching columns of the row-parallel weights)."""
    if group is not None:
        world = dist.get_world_size(group)
        if size not in (None, world):
            raise ValueError(f"tensor_parallel_size={size} must equal the group size {world}")
        size = world
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    check_leaves(leaves)
    if leaves < size or leaves % size:
        raise ValueError(f"tensor_parallel_size={size} must divide tp_leaves={leaves} (each rank owns a subtree)")
    _check_model(model, size, group is not None)
    _check_divisible(model, size, leaves)
    exchange = ProcessGroupExchange(group) if group is not None else InProcessExchange(size)
    tp = TensorParallel(size, leaves, exchange, sharded=group is not None)
    if tp.sharded:
        _shard_weights(model, tp, dist.get_rank(group))
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, Linear):
            m.parallel = ColumnParallel(tp) if leaf in COLUMN_PARALLEL else RowParallel(tp)
        elif isinstance(m, SparseMoeBlock):
            m.experts.tree_leaves = leaves
            if m.expert_parallel is None:  # with EP the experts stay whole: EP moves their rows
                m.experts.tensor_parallel = ExpertsTensorParallel(tp)
    model.tensor_parallel = tp
    return model


def _take(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data.clone(), requires_grad=param.requires_grad)


def _shard_weights(model: nn.Module, tp: TensorParallel, rank: int) -> None:
    """Keep only rank `rank`'s shards: column layers' rows, row layers' columns, the
    experts' slices of I, and attention's head counts."""
    C = tp.size

    def part(n: int) -> slice:
        return slice(rank * (n // C), (rank + 1) * (n // C))

    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, FusedLinear) and leaf in COLUMN_PARALLEL:
            sids = list(m.shard_offsets)
            m.weight = _take(m.weight, torch.cat([m.shard(m.weight.data, s)[part(m.shard_offsets[s][1])] for s in sids]))
            if m.bias is not None:
                m.bias = _take(m.bias, torch.cat([m.shard(m.bias.data, s)[part(m.shard_offsets[s][1])] for s in sids]))
            offset, offsets = 0, {}
            for s in sids:
                offsets[s] = (offset, m.shard_offsets[s][1] // C)
                offset += offsets[s][1]
            m.shard_offsets = offsets
            m.out_features = offset
        elif isinstance(m, Linear) and leaf in ROW_PARALLEL:
            m.weight = _take(m.weight, m.weight.data[:, part(m.in_features)])
            m.in_features //= C
            # the bias is added once, after the tree: every rank keeps it whole
        elif isinstance(m, FusedExperts) and not _has_expert_parallel(model, m):
            inter = m.intermediate_size
            sl = part(inter)
            w13 = m.gate_up_proj.data
            m.gate_up_proj = _take(m.gate_up_proj, torch.cat([w13[:, :inter][:, sl], w13[:, inter:][:, sl]], dim=1))
            m.down_proj = _take(m.down_proj, m.down_proj.data[:, :, sl])
            m.intermediate_size = inter // C
        elif isinstance(m, Attention):
            m.num_heads //= C
            m.num_kv_heads //= C
        # the attention modules that reshape q/k/v by their own head counts (HF's names)
        for attr in ("num_heads", "num_kv_heads", "q_size", "kv_size"):
            if not isinstance(m, Attention) and isinstance(getattr(m, attr, None), int) and hasattr(m, "attn"):
                setattr(m, attr, getattr(m, attr) // C)


def _has_expert_parallel(model: nn.Module, experts: FusedExperts) -> bool:
    return any(isinstance(b, SparseMoeBlock) and b.experts is experts and b.expert_parallel is not None
               for b in model.modules())
