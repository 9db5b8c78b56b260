"""One model class for the Llama family: Llama (incl. llama3 rope scaling),
Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm), tied or untied embeddings.

The same class runs rollout (the worker sets a paged-KV attention backend in
the forward context) and training (the trainer sets a packed-sequence one):
it contains no inference-only state and no parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from vllm.layers.activation import SiluAndMul
from vllm.layers.attention import Attention
from vllm.layers.embedding import LMHead, VocabEmbedding
from vllm.layers.linear import FusedLinear, Linear
from vllm.layers.norm import RMSNorm
from vllm.layers.rotary import RopeScaling, RotaryEmbedding, rope_from_hf
from vllm.models.checkpointing import checkpointed
from vllm.models.weights import WeightMapping, WeightSlot

# What distinguishes the members of the family (config.json does not say it).
ARCHITECTURES = {
    "Qwen3ForCausalLM": {"qk_norm": True, "qkv_bias": False},
    "Qwen2ForCausalLM": {"qk_norm": False, "qkv_bias": True},
    "LlamaForCausalLM": {"qk_norm": False, "qkv_bias": False},
}


@dataclass
class LlamaFamilyConfig:
    """The fields of config.json this model reads. Every field is part of the execution
    contract's semantic digest, so it holds exactly what decides the model's function."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaFamilyConfig":
        """Parse an HF config.json dict; ValueError for what this model does not implement."""
        arch = (hf.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not a member of the Llama family ({', '.join(ARCHITECTURES)})")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        try:
            heads = hf["num_attention_heads"]
            rope_theta, scaling = rope_from_hf(hf)
            traits = ARCHITECTURES[arch]
            return cls(
                architecture=arch,
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_hidden_layers=hf["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads", heads),
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                max_position_embeddings=hf.get("max_position_embeddings", 4096),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=traits["qkv_bias"] or bool(hf.get("attention_bias", False)),
                qk_norm=traits["qk_norm"],
            )
        except KeyError as err:
            raise ValueError(f"config.json of a {arch} lacks {err.args[0]!r}") from None


class SelfAttention(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        out = self.attn(q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {0: cfg.intermediate_size, 1: cfg.intermediate_size}, dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_idx, rotary, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary, dtype) for i in range(cfg.num_hidden_layers))
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


class LlamaFamilyForCausalLM(nn.Module):
    config_class = LlamaFamilyConfig
    # HF projection -> (our fused projection, shard id)
    hf_fused = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: LlamaFamilyConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, dtype)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, activation_checkpointing: bool = False) -> torch.Tensor:
        """Token ids [T] and absolute positions [T] of a packed step -> final hidden states [T, H].
        `activation_checkpointing`: under autograd, recompute each decoder layer in backward
        (same bits, less memory)."""
        return self.model(input_ids, positions, activation_checkpointing)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- checkpoint names -------------------------------------------------------------
    def weight_mapping(self) -> WeightMapping:
        """Every HF tensor name of this architecture -> the parameter (shard) it fills."""
        to_hf = {ours: hf for hf, ours in self.hf_fused.items()}
        slots: dict[str, WeightSlot] = {}
        for name, _ in self.named_parameters():
            module_name, kind = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if isinstance(module, FusedLinear):
                parent, fused = module_name.rsplit(".", 1)
                for sid in module.shard_offsets:
                    slots[f"{parent}.{to_hf[(fused, sid)]}.{kind}"] = WeightSlot(name, sid, partial(module.shard, shard_id=sid))
            else:
                slots[name] = WeightSlot(name)
        # tied: one tensor, the embedding; a checkpoint's lm_head.weight must equal it
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}
        return WeightMapping(self, slots, aliases=tied, derived=("rotary_emb.inv_freq",))

    def hf_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Our parameters (or their .grad with grads=True) under HF names, fused
        projections split back: for save_pretrained and for comparing with transformers."""
        return self.weight_mapping().state_dict(grads)
