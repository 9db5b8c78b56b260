"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention (per-head q/k RMSNorm, no qkv
bias) with a sparse MoE block in place of the MLP on every `decoder_sparse_step`-th
layer not listed in `mlp_only_layers` (those keep a dense SwiGLU MLP of
`intermediate_size`).

This file owns what is specific to the architecture: its config (`Qwen3MoeConfig.from_hf`:
Qwen3's fields plus the MoE ones), the HF-name -> parameter mapping (per-expert
checkpoint tensors onto slices of the stacked expert weights; loading, weight sync and
`hf_state_dict` all read it), and the layer loop. Like every model it holds no
parallelism and no inference-only state.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial

import torch
from torch import nn

from vllm.layers.embedding import LMHead, VocabEmbedding
from vllm.layers.linear import FusedLinear
from vllm.layers.moe import FusedExperts, SparseMoeBlock
from vllm.layers.norm import RMSNorm
from vllm.layers.rotary import RotaryEmbedding
from vllm.models.checkpointing import checkpointed
from vllm.models.llama_family import MLP, DecoderLayer, LlamaFamilyConfig, LlamaFamilyForCausalLM, SelfAttention
from vllm.models.weights import WeightMapping, WeightSlot

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
                  decoder_sparse_step=int(hf.get("decoder_sparse_step", 1) or 1),
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
    forward = DecoderLayer.forward


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(MoeDecoderLayer(cfg, i, self.rotary, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, activation_checkpointing: bool = False) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            if activation_checkpointing:
                x, residual = checkpointed(layer, positions, x, residual)
            else:
                x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class Qwen3MoeForCausalLM(nn.Module):
    config_class = Qwen3MoeConfig
    # HF projection of the attention and the dense MLPs -> (our fused projection, shard id)
    hf_fused = LlamaFamilyForCausalLM.hf_fused

    def __init__(self, cfg: Qwen3MoeConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.model = Qwen3MoeModel(cfg, dtype)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                              tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, activation_checkpointing: bool = False) -> torch.Tensor:
        """Token ids [T] and absolute positions [T] of a packed step -> final hidden states [T, H].
        `activation_checkpointing`: under autograd, recompute each decoder layer in backward
        (same bits, less memory)."""
        return self.model(input_ids, positions, activation_checkpointing)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- checkpoint names -------------------------------------------------------------
    def weight_mapping(self) -> WeightMapping:
        """Every HF tensor name of this architecture -> the parameter (shard) it fills:
        `...mlp.experts.{e}.{gate,up,down}_proj.weight` -> expert e's slice of the stacked
        `...mlp.experts.gate_up_proj` / `down_proj` (shard (e, projection)); q/k/v and the
        dense MLPs' gate/up -> rows of their fused projections. The stacked expert tensors
        may also be given whole under their own (transformers' in-memory) names. Built from
        the experts each layer holds, so a model cut by expert parallelism maps its own."""
        to_hf = {ours: hf for hf, ours in self.hf_fused.items()}
        slots: dict[str, WeightSlot] = {}
        for name, _ in self.named_parameters():
            module_name, kind = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if isinstance(module, FusedExperts):
                for shard in module.shard_ids(kind):
                    expert, proj = shard
                    slots[f"{module_name}.{expert}.{proj}_proj.weight"] = WeightSlot(
                        name, shard, partial(module.shard, shard_id=shard))
            elif isinstance(module, FusedLinear):
                parent, fused = module_name.rsplit(".", 1)
                for sid in module.shard_offsets:
                    slots[f"{parent}.{to_hf[(fused, sid)]}.{kind}"] = WeightSlot(name, sid, partial(module.shard, shard_id=sid))
            else:
                slots[name] = WeightSlot(name)
        # tied: one tensor, the embedding; a checkpoint's lm_head.weight must equal it
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}
        return WeightMapping(self, slots, aliases=tied, derived=("rotary_emb.inv_freq",))

    def hf_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Our parameters (or their .grad with grads=True) under HF names: fused projections
        split back, one tensor per expert and projection (the hub layout)."""
        return self.weight_mapping().state_dict(grads)
