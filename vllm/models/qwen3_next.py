"""Qwen3-Next (`Qwen3NextForCausalLM`) and the text models of Qwen3.5 (`Qwen3_5ForCausalLM`,
`Qwen3_5MoeForCausalLM`): a hybrid of Gated DeltaNet layers (`linear_attention`) and gated
full-attention layers (`full_attention`), in the order `layer_types` gives.

- Gated attention: q_proj is twice as wide, each head's rows [q | gate]; per-head q/k norms;
  a partial rope (the first `head_dim * partial_rotary_factor` dims of each head rotate);
  the attention output times sigmoid(gate) before o_proj.
- Every norm is zero-centred: (x * rstd) * (1 + w), rounded once.
- MLP: a sparse MoE block (router, experts, plus a shared expert scaled by
  sigmoid(shared_expert_gate(x))) on every `decoder_sparse_step`-th layer not in
  `mlp_only_layers` when `num_experts` > 0, else a dense SwiGLU.
- Qwen3.5 differs in its Gated DeltaNet's input projections (four instead of two grouped
  ones) and its MLPs (dense everywhere; or, for the MoE model, sparse everywhere with
  normalised top-k); its multimodal rope is the plain rope on text positions.

Caches are indexed per kind: the attention layers are 0, 1, ... in the attention backend,
the Gated DeltaNet layers 0, 1, ... in the state backend. HF names are transformers' own
(q/k/v and gate/up fused here, experts stacked; `weight_slots` maps per-expert tensors); the
multi-token-prediction head (`mtp.*`) of the checkpoints is not run and not loaded, as in
transformers. Like every model this file holds no parallelism and no inference-only state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.layers.activation import SigmoidGate
from vllm.layers.attention import Attention
from vllm.layers.gated_deltanet import GatedDeltaNet
from vllm.layers.linear import FusedLinear, Linear
from vllm.layers.moe import SparseMoeBlock
from vllm.layers.norm import ZeroCentredRMSNorm
from vllm.layers.rope_config import rope_from_hf
from vllm.layers.rotary import RotaryEmbedding
from vllm.models.decoder import DecoderConfig, DecoderForCausalLM
from vllm.models.llama_family import MLP, DecoderLayer
from vllm.models.qwen3_moe import Qwen3MoeForCausalLM

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"

# What config.json does not say about each architecture: the Gated DeltaNet's projection
# layout and which MLPs its layers have.
ARCHITECTURES = {
    "Qwen3NextForCausalLM": {"split_projections": False, "mlp": "sparse_step"},
    "Qwen3_5ForCausalLM": {"split_projections": True, "mlp": "dense"},
    "Qwen3_5MoeForCausalLM": {"split_projections": True, "mlp": "sparse"},
}

# transformers' defaults for keys a config.json may leave out (the dims are required)
_DEFAULTS = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.25,
             "full_attention_interval": 4, "decoder_sparse_step": 1, "norm_topk_prob": True}


@dataclass
class Qwen3NextConfig(DecoderConfig):
    """The fields of config.json this model reads (the decoder's, `intermediate_size` 0 when no
    layer has a dense MLP, and those below). Every field enters the execution contract's
    semantic digest, so it holds what decides the model's function (`router_aux_loss_coef`
    is not kept: it weights a training loss, not a logprob)."""
    partial_rotary_factor: float
    layer_types: list[str]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    split_projections: bool  # Qwen3.5's in_proj_qkv / z / b / a instead of in_proj_qkvz / ba
    num_experts: int  # 0: dense MLPs only
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: list[int]

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3NextConfig":
        """Parse an HF config.json dict; ValueError for what this model does not implement."""
        arch = (hf.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not one of {', '.join(ARCHITECTURES)}")
        traits = ARCHITECTURES[arch]
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        if hf.get("attention_bias"):
            raise ValueError(f"{arch} with attention_bias=true is not supported")
        rope_theta, scaling = rope_from_hf(hf)
        if scaling.rope_type != "default":
            raise ValueError(f"{arch}: rope type {scaling.rope_type!r} is not supported (only 'default')")
        params = hf.get("rope_parameters") or {}
        factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                                  _DEFAULTS["partial_rotary_factor"])))

        def get(key: str):
            return hf.get(key, _DEFAULTS[key])
        try:
            layers = int(hf["num_hidden_layers"])
            layer_types = hf.get("layer_types")
            if layer_types is None:
                interval = int(get("full_attention_interval"))
                if interval < 1:
                    raise ValueError(f"full_attention_interval must be >= 1, got {interval}")
                layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
            experts = 0 if traits["mlp"] == "dense" else int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0)
            # Qwen3-Next places its MoE blocks by decoder_sparse_step / mlp_only_layers and reads
            # norm_topk_prob; Qwen3.5-MoE has a block on every layer and always normalises
            by_step = traits["mlp"] == "sparse_step"
            cfg = cls(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=int(hf["hidden_size"]),
                intermediate_size=0,
                num_hidden_layers=layers,
                num_attention_heads=int(hf["num_attention_heads"]),
                num_key_value_heads=int(hf["num_key_value_heads"]),
                head_dim=int(hf["head_dim"]),
                max_position_embeddings=int(get("max_position_embeddings")),
                rms_norm_eps=float(get("rms_norm_eps")),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                partial_rotary_factor=factor,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                layer_types=list(layer_types),
                linear_conv_kernel_dim=int(hf["linear_conv_kernel_dim"]),
                linear_key_head_dim=int(hf["linear_key_head_dim"]),
                linear_value_head_dim=int(hf["linear_value_head_dim"]),
                linear_num_key_heads=int(hf["linear_num_key_heads"]),
                linear_num_value_heads=int(hf["linear_num_value_heads"]),
                split_projections=traits["split_projections"],
                num_experts=experts,
                num_experts_per_tok=int(hf["num_experts_per_tok"]) if experts else 0,
                moe_intermediate_size=int(hf["moe_intermediate_size"]) if experts else 0,
                shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]) if experts else 0,
                norm_topk_prob=bool(get("norm_topk_prob")) if by_step else True,
                decoder_sparse_step=(1 if get("decoder_sparse_step") is None else int(get("decoder_sparse_step")))
                if by_step else 1,
                mlp_only_layers=[int(i) for i in (hf.get("mlp_only_layers") or [])] if by_step else [],
            )
            if cfg.decoder_sparse_step < 1:   # is_sparse divides by it
                raise ValueError(f"decoder_sparse_step must be >= 1, got {cfg.decoder_sparse_step}")
            # the dense MLPs' size, where a layer has one
            if not all(cfg.is_sparse(i) for i in range(layers)):
                cfg.intermediate_size = int(hf["intermediate_size"])
        except KeyError as err:
            raise ValueError(f"config.json of a {arch} lacks {err.args[0]!r}") from None
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported ({LINEAR_ATTENTION!r}, {FULL_ATTENTION!r})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}")
        rotary = self.rotary_dim
        if rotary < 2 or rotary % 2 or rotary > self.head_dim:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives {rotary} rotary dims of "
                             f"head_dim={self.head_dim}: an even number in [2, head_dim] is needed")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts}]")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        # what the Gated DeltaNet kernels cover (vllm/kernels/gdn_ops.py, chunk_scan.check_grid)
        if not 2 <= self.linear_conv_kernel_dim <= 4:
            raise ValueError(f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} is not supported (2..4)")
        if self.linear_key_head_dim % 16 or self.linear_value_head_dim % 16 or not self.linear_key_head_dim \
                or not self.linear_value_head_dim:
            raise ValueError(f"linear_key_head_dim={self.linear_key_head_dim} and linear_value_head_dim="
                             f"{self.linear_value_head_dim} must be positive multiples of 16 (the kernels' tiles)")

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head the rope rotates (transformers: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sparse(self, layer_idx: int) -> bool:
        """transformers' rule: a MoE block when there are experts, unless listed in
        mlp_only_layers, on every decoder_sparse_step-th layer."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def kind_index(self, layer_idx: int) -> int:
        """The layer's index among the layers of its own kind (its cache's index in its backend)."""
        return self.layer_types[:layer_idx].count(self.layer_types[layer_idx])


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj gives each head [q | gate] (transformers'
    view(T, H, 2D) then chunk), fused here with k and v into one projection; zero-centred
    q/k norms, partial rope, attention, out * sigmoid(gate), o_proj."""

    def __init__(self, cfg: Qwen3NextConfig, attention_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": 2 * self.q_size, "k": self.kv_size, "v": self.kv_size},
                                    dtype=dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, dtype=dtype)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer
        self.attn = Attention(attention_idx, self.num_heads, self.num_kv_heads, self.head_dim)
        self.output_gate = SigmoidGate()

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_gate = q_gate.reshape(-1, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate[..., :self.head_dim], q_gate[..., self.head_dim:]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        out = self.attn(q, k, v).reshape(-1, self.num_heads, self.head_dim)
        out = self.output_gate(out, gate)
        return self.o_proj(out.reshape(-1, self.q_size))


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts (router, fused experts, fixed-slot merge: SparseMoeBlock) plus a
    shared SwiGLU expert scaled by sigmoid(shared_expert_gate(x)), summed in the model dtype
    as transformers' Qwen3NextSparseMoeBlock does."""

    def __init__(self, cfg: Qwen3NextConfig, dtype: torch.dtype):
        super().__init__(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                         cfg.norm_topk_prob, dtype=dtype)
        self.shared_expert = MLP(cfg, dtype, intermediate_size=cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype=dtype)
        self.sigmoid_gate = SigmoidGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.sigmoid_gate(self.shared_expert(x), self.shared_expert_gate(x))
        return super().forward(x) + shared


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm residual layer: a Gated DeltaNet (`linear_attn`) or gated attention
    (`self_attn`), then the MLP; the residual adds are fused into the next norm."""

    def __init__(self, cfg: Qwen3NextConfig, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        if self.layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                             cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                             cfg.linear_conv_kernel_dim, cfg.rms_norm_eps,
                                             state_idx=cfg.kind_index(layer_idx),
                                             split_projections=cfg.split_projections, dtype=dtype)
        else:
            self.self_attn = GatedAttention(cfg, cfg.kind_index(layer_idx), rotary, dtype)
        self.mlp = SharedExpertMoeBlock(cfg, dtype) if cfg.is_sparse(layer_idx) else MLP(cfg, dtype)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def mix(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.layer_type == LINEAR_ATTENTION:
            return self.linear_attn(x)
        return self.self_attn(positions, x)

    # Qwen3's pre-norm residual layout around the token mixer above
    forward = DecoderLayer.forward


class Qwen3NextForCausalLM(DecoderForCausalLM):
    config_class = Qwen3NextConfig
    layer_class = Qwen3NextDecoderLayer
    norm_class = ZeroCentredRMSNorm
    # the checkpoints' multi-token-prediction head, which transformers does not load either
    skipped_hf_names = DecoderForCausalLM.skipped_hf_names + ("mtp.",)

    @staticmethod
    def rotary_dim(cfg: Qwen3NextConfig) -> int:
        return cfg.rotary_dim

    # `...mlp.experts.{e}.{gate,up,down}_proj.weight` -> expert e's slice of the stacked expert
    # weights, as Qwen3-MoE maps them (the stacked tensors may also come whole under
    # transformers' in-memory names); the rest through the generic mapping (q/k/v into
    # qkv_proj, its q shard holding q_proj's interleaved [q | gate] rows as they are)
    weight_slots = Qwen3MoeForCausalLM.weight_slots
