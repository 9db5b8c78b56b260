"""One model class for the Llama family: Llama (incl. llama3 rope scaling),
Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm), tied or untied embeddings.

This file declares the family's config, attention, MLP and decoder layer; the decoder
stack, the layer loop and the HF-name mapping are `vllm.models.decoder`'s. It contains
no inference-only state and no parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.layers.activation import SiluAndMul
from vllm.layers.attention import Attention
from vllm.layers.linear import FusedLinear, Linear
from vllm.layers.norm import RMSNorm, pre_norm
from vllm.layers.rope_config import rope_from_hf
from vllm.layers.rotary import RotaryEmbedding
from vllm.models.decoder import DecoderConfig, DecoderForCausalLM

# What distinguishes the members of the family (config.json does not say it).
# "bias_fields": whether config.json's attention_bias (q, k, v and o) and mlp_bias (gate, up
# and down) apply, as in transformers' classes (Qwen2's q, k, v bias is fixed, its o has none).
ARCHITECTURES = {
    "Qwen3ForCausalLM": {"qk_norm": True, "qkv_bias": False, "bias_fields": True},
    "Qwen2ForCausalLM": {"qk_norm": False, "qkv_bias": True, "bias_fields": False},
    "LlamaForCausalLM": {"qk_norm": False, "qkv_bias": False, "bias_fields": True},
}


@dataclass
class LlamaFamilyConfig(DecoderConfig):
    """The fields of config.json this model reads. Every field is part of the execution
    contract's semantic digest, so it holds exactly what decides the model's function."""
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaFamilyConfig":
        """Parse an HF config.json dict; ValueError for what this model does not implement."""
        arch = (hf.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not a member of the Llama family ({', '.join(ARCHITECTURES)})")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        _refuse_sliding_window(hf, arch)
        try:
            heads = hf["num_attention_heads"]
            rope_theta, scaling = rope_from_hf(hf)
            traits = ARCHITECTURES[arch]
            attention_bias = traits["bias_fields"] and bool(hf.get("attention_bias", False))
            return cls(
                architecture=arch,
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_hidden_layers=hf["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads") or heads,   # null: multi-head, as transformers
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                max_position_embeddings=hf.get("max_position_embeddings", 4096),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=traits["qkv_bias"] or attention_bias,
                qk_norm=traits["qk_norm"],
                o_bias=attention_bias,
                mlp_bias=traits["bias_fields"] and bool(hf.get("mlp_bias", False)),
            )
        except KeyError as err:
            raise ValueError(f"config.json of a {arch} lacks {err.args[0]!r}") from None


def _refuse_sliding_window(hf: dict, arch: str) -> None:
    """Sliding-window attention (Qwen2 / Qwen3's use_sliding_window from layer
    max_window_layers on, or layer_types naming it) is not implemented: refused, rather than
    run as full attention with other logits."""
    layers = hf.get("num_hidden_layers", 0)
    types = hf.get("layer_types") or []
    windowed = (bool(hf.get("use_sliding_window")) and (hf.get("max_window_layers") or 0) < layers) \
        or "sliding_attention" in types
    if windowed:
        raise ValueError(f"{arch} with sliding-window attention (use_sliding_window / layer_types) is not supported: "
                         "every layer here attends to the whole context")


class SelfAttention(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
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
    """SwiGLU of `intermediate_size` (default: the config's), gate and up fused."""

    def __init__(self, cfg: LlamaFamilyConfig, dtype: torch.dtype, intermediate_size: int | None = None):
        super().__init__()
        inter = cfg.intermediate_size if intermediate_size is None else intermediate_size
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {0: inter, 1: inter}, bias=bias, dtype=dtype)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=bias, dtype=dtype)
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

    def mix(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer's token mixer (attention here; a hybrid's layer picks its own)."""
        return self.self_attn(positions, x)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        """Pre-norm residual block: norm, token mixer, norm (fused with the residual add), MLP."""
        x, residual = pre_norm(self.input_layernorm, x, residual)
        x = self.mix(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaFamilyForCausalLM(DecoderForCausalLM):
    config_class = LlamaFamilyConfig
    layer_class = DecoderLayer
