"""One model class for the Llama family: Llama (incl. llama3 rope scaling),
Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm), tied or untied embeddings.

The same class runs rollout (the worker sets a paged-KV attention backend in
the forward context) and training (the trainer sets a packed-sequence one):
it contains no inference-only state and no parallelism.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from vllm.config import ModelConfig
from vllm.layers.activation import SiluAndMul
from vllm.layers.attention import Attention
from vllm.layers.embedding import LMHead, VocabEmbedding
from vllm.layers.linear import FusedLinear, Linear
from vllm.layers.norm import RMSNorm
from vllm.layers.rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype):
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
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {0: cfg.intermediate_size, 1: cfg.intermediate_size}, dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype):
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
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaFamilyForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, dtype)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token ids [T] and absolute positions [T] of a packed step -> final hidden states [T, H]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- checkpoint names -------------------------------------------------------------
    def resolve_hf_name(self, hf_name: str) -> tuple[str, object]:
        """HF tensor name -> (our parameter name, shard id within a fused parameter or None)."""
        for frag, (fused, shard_id) in self.packed_modules.items():
            if f".{frag}." in hf_name:
                return hf_name.replace(f".{frag}.", f".{fused}."), shard_id
        return hf_name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the set of our parameter names that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # derived from the config
            if self.config.tie_word_embeddings and hf_name == "lm_head.weight":
                continue  # tied: the embedding is the single source of truth
            name, shard = self.resolve_hf_name(hf_name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(self).__name__} ({self.config.architecture})")
            param = params[name]
            try:
                if shard is None:
                    param.weight_loader(param, tensor.to(param.dtype))
                else:
                    param.weight_loader(param, tensor.to(param.dtype), shard)
            except ValueError as err:
                raise ValueError(f"while loading {hf_name!r}: {err}") from None
            loaded.add(name if shard is None else f"{name}[{shard}]")
        return loaded

    def expected_weight_keys(self) -> set[str]:
        keys = set()
        for name, module in self.named_modules():
            if isinstance(module, FusedLinear):
                for sid in module.shard_offsets:
                    keys.add(f"{name}.weight[{sid}]")
                    if module.bias is not None:
                        keys.add(f"{name}.bias[{sid}]")
        for name, _ in self.named_parameters():
            mod = name.rsplit(".", 1)[0]
            if isinstance(self.get_submodule(mod), FusedLinear):
                continue
            keys.add(name)
        return keys

    def hf_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Our parameters (or their .grad with grads=True) under HF names, fused
        projections split back: for save_pretrained and for comparing with transformers."""
        out: dict[str, torch.Tensor] = {}
        inverse = {}
        for frag, (fused, sid) in self.packed_modules.items():
            inverse[(fused, sid)] = frag
        for name, module in self.named_modules():
            if isinstance(module, FusedLinear):
                fused = name.rsplit(".", 1)[-1]
                for pname in ("weight", "bias"):
                    p = getattr(module, pname)
                    if p is None or (grads and p.grad is None):
                        continue
                    for sid, part in module.split_shards((p.grad if grads else p).detach()).items():
                        out[f"{name.rsplit('.', 1)[0]}.{inverse[(fused, sid)]}.{pname}"] = part
        for name, p in self.named_parameters():
            mod = name.rsplit(".", 1)[0]
            if isinstance(self.get_submodule(mod), FusedLinear):
                continue
            if grads and p.grad is None:
                continue
            out[name] = (p.grad if grads else p).detach()
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out
