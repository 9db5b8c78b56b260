"""Mixture-of-experts layer: a router and a set of fused experts.

`SparseMoeBlock(x)`: router logits in float32, top-k routing, every chosen expert's
SwiGLU MLP, and the fixed-slot float32 merge (all in `kernels/moe.py`). The block holds
no parallelism: expert parallelism is applied after build (`vllm/parallel/expert_parallel.py`)
by attaching a dispatcher that replaces the local expert computation.

Expert weights live in two stacked parameters (transformers' in-memory layout):
`gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and `down_proj`
[E, H, I]. HF checkpoints store one tensor per expert and projection
(`experts.{e}.gate_proj.weight`, ...): `FusedExperts.shard` is the one definition of
where each lives, read by the model's HF-name mapping (`vllm.models.weights`).

The block's kernels are not in the op shim's table, so the block names them itself:
`kernel_policy` (the execution contract's numerical entries) and `invariant_self_check`
(the GPU start-up check), both asked generically of any layer that defines them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from vllm.forward_context import current_numerics, recomputing
from vllm.kernels import moe as moe_ops
from vllm.kernels import ops

# shard ids of FusedExperts parameters: (expert id, projection)
EXPERT_PROJECTIONS = ("gate", "up", "down")


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        # global id of local expert 0 (non-zero only after expert-parallel sharding)
        self.first_expert = 0
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)
        # set by vllm.parallel.tensor_parallel after build: the K leaves of the down projection
        # (None: one accumulation over all of I) and the hook that shards I over ranks
        self.tree_leaves = None
        self.tensor_parallel = None

    def shard_ids(self, param_name: str) -> list[tuple[int, str]]:
        """The shards parameter `param_name` ("gate_up_proj" or "down_proj") is made of, as
        (global expert id, projection): one HF checkpoint tensor each."""
        kinds = ("gate", "up") if param_name == "gate_up_proj" else ("down",)
        return [(self.first_expert + e, kind) for e in range(self.num_experts) for kind in kinds]

    def shard(self, tensor: torch.Tensor, shard_id: tuple[int, str]) -> torch.Tensor:
        """The slice of `tensor` (one of our parameters, its data or its gradient) holding
        shard `shard_id` = (global expert id, "gate" | "up" | "down"): a view, so writing
        into it writes the parameter."""
        expert, kind = shard_id
        local = expert - self.first_expert
        if kind not in EXPERT_PROJECTIONS:
            raise ValueError(f"unknown expert projection {kind!r}; expected one of {EXPERT_PROJECTIONS}")
        if not 0 <= local < self.num_experts:
            raise ValueError(f"expert {expert} is not held here (experts {self.first_expert}.."
                             f"{self.first_expert + self.num_experts - 1})")
        inter = self.intermediate_size
        if kind == "gate":
            return tensor[local, :inter]
        if kind == "up":
            return tensor[local, inter:]
        return tensor[local]

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T, k] (local expert ids) -> y [T, k, H], unweighted."""
        if self.tensor_parallel is not None:
            return self.tensor_parallel(self, x, ids)
        return self.compute(x, self.gate_up_proj, self.down_proj, ids)

    def compute(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                leaves: int | None = None) -> torch.Tensor:
        """The expert MLPs on weights `w13` / `w2` (these experts' or views of them), the down
        projection a tree of `leaves` (default: `tree_leaves`) in invariant mode."""
        leaves = self.tree_leaves if leaves is None else leaves
        if leaves is None or current_numerics() != "invariant":
            return ops.moe_experts(x, w13, w2, ids)
        from vllm.kernels.moe_leaf_tree import moe_experts_tree
        return moe_experts_tree(x, w13, w2, ids, leaves)


class Router(nn.Module):
    """Router logits in float32 (the lm_head's float32-output GEMM): routing never sees
    logits rounded to the model dtype."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.logits(x, self.weight)


# ---- router statistics for the load-balancing loss ---------------------------------------
@dataclass
class RouterStats:
    """Per MoE layer call: (router probabilities [T, E], chosen experts [T, k])."""
    calls: list = field(default_factory=list)

    def load_balancing_loss(self) -> torch.Tensor:
        """Switch-Transformer auxiliary loss, as transformers computes it for Qwen3-MoE:
        E * sum_e f_e * P_e over all recorded calls, f_e = top-k assignments to e per token,
        P_e = mean router probability of e. Differentiable w.r.t. the router."""
        if not self.calls:
            raise ValueError("no MoE layer ran while router statistics were collected")
        num_experts = self.calls[0][0].shape[-1]
        counts = torch.zeros(num_experts, dtype=torch.float32, device=self.calls[0][0].device)
        prob_sum = torch.zeros_like(counts)
        rows = 0
        for probs, ids in self.calls:
            counts = counts + torch.zeros_like(counts).scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), device=ids.device))
            prob_sum = prob_sum + probs.float().sum(0)
            rows += probs.shape[0]
        return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


_STATS: list[RouterStats] = []


@contextlib.contextmanager
def collect_router_stats() -> Iterator[RouterStats]:
    """Record every MoE layer's routing inside the block (training: the optional
    load-balancing loss). Off by default: nothing is kept between steps."""
    stats = RouterStats()
    _STATS.append(stats)
    try:
        yield stats
    finally:
        _STATS.remove(stats)


class SparseMoeBlock(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, norm_topk_prob: bool,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = Router(num_experts, hidden_size, dtype=dtype)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, dtype=dtype)
        # set by vllm.parallel.expert_parallel after build; a plain attribute, not a submodule
        self.expert_parallel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = ops.moe_route(self.gate(x), self.top_k, self.norm_topk_prob)
        if not recomputing():   # activation checkpointing's second pass: recorded already
            for stats in _STATS:
                stats.calls.append((routing.probs, routing.ids))
        if self.expert_parallel is not None:
            return self.expert_parallel(self, x, routing)
        return ops.moe_merge(self.experts(x, routing.ids), routing.weights, x.dtype)

    # ---- what the generic code asks of a layer with kernels of its own -------------------
    @staticmethod
    def kernel_policy(numerics: str, device) -> dict:
        """Entries for the execution contract's numerical part (`vllm.contract`): routing,
        the grouped expert GEMM and the merge, as `numerics` runs them on `device`."""
        return {"moe": moe_ops.moe_numerical_policy(numerics, device)}

    @staticmethod
    def invariant_self_check(blocks: list, device: torch.device, dtype: torch.dtype,
                             max_tokens: int | None = None, kernels=None) -> dict:
        """The start-up check of these kernels on this machine (`vllm.kernels.selfcheck`),
        for the model's (name, block) pairs, with the engine's kernel options; raises
        SelfCheckError."""
        from vllm.kernels.moe_selfcheck import moe_self_check
        from vllm.kernels.numerics_table import kernel_for
        return moe_self_check(blocks, device, dtype, max_tokens, act=ops.silu_and_mul,
                              router_gemm=kernel_for("logits", "invariant", device, kernels))
