"""Expert parallelism for MoE models, applied after build.

Experts are cut into `P` partitions of contiguous expert ids (E / P each); attention
and everything else stays whole on every rank (TP=1). Each MoE block then:

1. routes its tokens as usual (the router is replicated);
2. dispatches every (token, slot) pair to the partition owning its expert, pairs in
   ascending pair order within a partition (a stable sort by owner);
3. each partition computes its received rows with the ordinary expert kernels (one
   expert per row, k=1), whose per-row bits do not depend on which other rows came along;
4. the rows go back to the token's rank in the order they were sent, are put back in
   (token, slot) order, and are merged there by the same fixed-slot float32 merge as
   without EP.

So EP=1 and EP=P give the same bits. Two exchanges implement step 2/4:
`InProcessExchange` (all partitions in this process: the two-partition mode for one
GPU) and `ProcessGroupExchange` (one partition per rank of a torch.distributed group,
all_to_all; gloo on CPU, NCCL on GPUs). Both run the same dispatch and merge code.

Dispatch reads the per-partition counts on the host: EP steps run eagerly (no CUDA graph
capture), and the process-group exchange is forward-only (rollout, logprob scoring).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from vllm.kernels import ops
from vllm.layers.moe import SparseMoeBlock


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A same-size integer view for transport: collectives move bits, whatever dtypes
    the backend knows (gloo has no bfloat16)."""
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class InProcessExchange:
    """All partitions live in this process: partition p computes rows sent to it with
    views of its experts' weights (the layer keeps every expert)."""

    def __init__(self, num_partitions: int):
        self.num_partitions = num_partitions

    def run(self, block: SparseMoeBlock, send_x: torch.Tensor, send_ids: torch.Tensor, counts: list[int]) -> torch.Tensor:
        per = block.num_experts // self.num_partitions
        experts = block.experts
        outs, start = [], 0
        for p, c in enumerate(counts):
            lo = p * per
            ids = send_ids[start:start + c, None]
            y = experts.compute(send_x[start:start + c], experts.gate_up_proj[lo:lo + per],
                                experts.down_proj[lo:lo + per], ids)
            outs.append(y.reshape(c, y.shape[-1]))
            start += c
        return torch.cat(outs, 0)


class ProcessGroupExchange:
    """Rank r of `group` holds partition r (its FusedExperts were cut to those experts)."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)

    def run(self, block: SparseMoeBlock, send_x: torch.Tensor, send_ids: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if torch.is_grad_enabled() and (send_x.requires_grad or any(p.requires_grad for p in block.parameters())):
            raise ValueError("expert parallelism over a process group is forward-only: run it under torch.no_grad()")
        dev = send_x.device
        send_counts = torch.tensor(counts, dtype=torch.long, device=dev)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        recv = recv_counts.tolist()
        H = send_x.shape[1]
        recv_x = torch.empty((sum(recv), H), dtype=send_x.dtype, device=dev)
        dist.all_to_all_single(_wire(recv_x), _wire(send_x), recv, counts, group=self.group)
        recv_ids = torch.empty(sum(recv), dtype=torch.long, device=dev)
        dist.all_to_all_single(recv_ids, send_ids.contiguous(), recv, counts, group=self.group)
        y_local = block.experts(recv_x, recv_ids[:, None])
        y_local = y_local.reshape(sum(recv), y_local.shape[-1]).contiguous()
        back = torch.empty((sum(counts), y_local.shape[1]), dtype=y_local.dtype, device=dev)
        dist.all_to_all_single(_wire(back), _wire(y_local), counts, recv, group=self.group)
        return back


class ExpertParallel:
    """What a SparseMoeBlock calls instead of its local experts (block.expert_parallel)."""

    def __init__(self, num_partitions: int, exchange):
        self.num_partitions = num_partitions
        self.exchange = exchange

    def __call__(self, block: SparseMoeBlock, x: torch.Tensor, routing) -> torch.Tensor:
        T, k = routing.ids.shape
        per = block.num_experts // self.num_partitions
        flat = routing.ids.reshape(-1)
        owner = torch.div(flat, per, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)  # grouped by partition, ascending pair index inside
        counts = torch.bincount(owner, minlength=self.num_partitions).tolist()
        send_x = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
        send_ids = (flat - owner * per).index_select(0, order)
        y_sorted = self.exchange.run(block, send_x, send_ids, counts)
        y = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted)  # back to (token, slot) order
        return ops.moe_merge(y.view(T, k, y.shape[-1]), routing.weights, x.dtype)


def _moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no MoE layer to apply expert parallelism to")
    return blocks


def apply_expert_parallel(model: nn.Module, num_partitions: int | None = None, group=None) -> nn.Module:
    """Make every MoE block of `model` expert-parallel, in place; returns the model.

    `num_partitions` alone: all partitions in this process (the model keeps all experts).
    `group` (a torch.distributed group, e.g. dist.group.WORLD): one partition per rank;
    each rank keeps only its own experts' weights (copies of its slice)."""
    blocks = _moe_blocks(model)
    if group is not None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if num_partitions not in (None, world):
            raise ValueError(f"num_partitions={num_partitions} must equal the group size {world}")
        num_partitions = world
    if num_partitions is None or isinstance(num_partitions, bool) or not isinstance(num_partitions, int) \
            or num_partitions < 1:
        raise ValueError(f"give an integer num_partitions >= 1 or a process group, got {num_partitions!r}")
    for block in blocks:
        if block.num_experts % num_partitions:
            raise ValueError(f"{block.num_experts} experts cannot be split into {num_partitions} equal partitions")
        if block.expert_parallel is not None:
            raise ValueError("expert parallelism is already applied to this model")
        if block.experts.tensor_parallel is not None:
            raise ValueError("apply expert parallelism before tensor parallelism (docs/parallelism.md)")
    for block in blocks:
        if group is None:
            block.expert_parallel = ExpertParallel(num_partitions, InProcessExchange(num_partitions))
            continue
        per = block.num_experts // num_partitions
        experts = block.experts
        lo = rank * per
        for pname in ("gate_up_proj", "down_proj"):
            old = getattr(experts, pname)
            new = nn.Parameter(old.data[lo:lo + per].clone(), requires_grad=old.requires_grad)
            setattr(experts, pname, new)
        experts.num_experts = per
        experts.first_expert = lo
        block.expert_parallel = ExpertParallel(num_partitions, ProcessGroupExchange(group))
    return model
