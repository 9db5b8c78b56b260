"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention (per-head q/k RMSNorm, no qkv
bias) with a sparse MoE block in place of the MLP on every `decoder_sparse_step`-th
layer not listed in `mlp_only_layers` (those keep a dense SwiGLU MLP of
`intermediate_size`).

This file owns what is specific to the architecture: its config (`Qwen3MoeConfig.from_hf`:
Qwen3's fields plus the MoE ones), the HF-name -> parameter mapping (per-expert
checkpoint tensors onto slices of the stacked expert weights; loading, weight sync and
`hf_state_dict` all read it) and its decoder layer; the stack and the layer loop are
`vllm.models.decoder`'s. Like every model it holds no parallelism and no inference-only state.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial

import torch
from torch import nn

from vllm.layers.moe import FusedExperts, SparseMoeBlock
from vllm.layers.norm import RMSNorm
from vllm.layers.rotary import RotaryEmbedding
from vllm.models.decoder import DecoderForCausalLM
from vllm.models.llama_family import MLP, DecoderLayer, LlamaFamilyConfig, SelfAttention
from vllm.models.weights import WeightSlot

ARCHITECTURE = "Qwen3MoeForCausalLM"
# its attention, norms, rope and dense MLPs are Qwen3's, and so are those fields of config.json
_DENSE_ARCHITECTURE = "Qwen3ForCausalLM"


@dataclass
class Qwen3MoeConfig(LlamaFamilyConfig):
    """Qwen3's fields (read by Qwen3's parser) and the MoE fields. Every field enters the
    execution contract's semantic digest. (`router_aux_loss_coef` is not kept: it weights a
    training loss the trainer chooses, and no logprob depends on it.)"""
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: list[int]

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3MoeConfig":
        """Parse an HF config.json dict; ValueError for what this model does not implement."""
        arch = (hf.get("architectures") or [None])[0]
        if arch != ARCHITECTURE:
            raise ValueError(f"architecture {arch!r} is not {ARCHITECTURE}")
        if hf.get("attention_bias"):
            raise ValueError("Qwen3-MoE with attention_bias=true is not supported")
        if hf.get("use_sliding_window"):
            raise ValueError("Qwen3-MoE with use_sliding_window=true is not supported")
        try:
            dense = LlamaFamilyConfig.from_hf({**hf, "architectures": [_DENSE_ARCHITECTURE]})
        except ValueError as err:
            raise ValueError(str(err).replace(_DENSE_ARCHITECTURE, ARCHITECTURE)) from None
        # transformers 5 writes `num_local_experts` (its attribute map), hub configs `num_experts`
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                                  ("moe_intermediate_size", hf.get("moe_intermediate_size"))) if v is None]
        if missing:
            raise ValueError(f"Qwen3-MoE config lacks {missing}")
        qwen3_fields = {f.name: getattr(dense, f.name) for f in fields(dense)}
        cfg = cls(**{**qwen3_fields, "architecture": arch},
                  num_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                  moe_intermediate_size=int(hf["moe_intermediate_size"]),
                  norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                  # null means the default; 0 is refused below (transformers would divide by it)
                  decoder_sparse_step=int(1 if hf.get("decoder_sparse_step") is None else hf["decoder_sparse_step"]),
                  mlp_only_layers=[int(i) for i in (hf.get("mlp_only_layers") or [])])
        if cfg.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {cfg.num_experts}")
        if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in [1, {cfg.num_experts}]")
        if cfg.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {cfg.decoder_sparse_step}")
        return cfg

    def is_sparse(self, layer_idx: int) -> bool:
        """transformers' rule: a MoE block unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


class MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_idx, rotary, dtype)
        if cfg.is_sparse(layer_idx):
            self.mlp = SparseMoeBlock(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                      cfg.moe_intermediate_size, cfg.norm_topk_prob, dtype=dtype)
        else:
            self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    # Qwen3's pre-norm residual layout; only the module behind `self.mlp` differs
    mix, forward = DecoderLayer.mix, DecoderLayer.forward


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    config_class = Qwen3MoeConfig
    layer_class = MoeDecoderLayer

    def weight_slots(self, name: str, module_name: str, kind: str, module: nn.Module) -> dict[str, WeightSlot] | None:
        """`...mlp.experts.{e}.{gate,up,down}_proj.weight` -> expert e's slice of the stacked
        `...mlp.experts.gate_up_proj` / `down_proj` (shard (e, projection)); the rest (q/k/v
        and the dense MLPs' gate/up into their fused projections) as for every decoder. The
        stacked expert tensors may also be given whole under their own (transformers'
        in-memory) names. Built from the experts each layer holds, so a model cut by expert
        parallelism maps its own."""
        if not isinstance(module, FusedExperts):
            return None
        return {f"{module_name}.{expert}.{proj}_proj.weight": WeightSlot(name, (expert, proj),
                                                                          partial(module.shard, shard_id=(expert, proj)))
                for expert, proj in module.shard_ids(kind)}
