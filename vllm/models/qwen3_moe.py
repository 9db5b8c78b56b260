"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention (per-head q/k RMSNorm, no qkv
bias) with a sparse MoE block in place of the MLP on every `decoder_sparse_step`-th
layer not listed in `mlp_only_layers` (those keep a dense SwiGLU MLP of
`intermediate_size`).

This file owns what is specific to the architecture: parsing its MoE fields from the
HF config (`Qwen3MoeArgs.from_hf`), the HF-name <-> parameter mapping (per-expert
checkpoint tensors onto the fused expert layout, used by loading, weight sync and
save_pretrained alike), and the layer loop. Like every model it holds no parallelism
and no inference-only state.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Iterable

import torch
from torch import nn

from vllm.config import ModelConfig
from vllm.layers.linear import FusedLinear
from vllm.layers.embedding import LMHead, VocabEmbedding
from vllm.layers.moe import FusedExperts, SparseMoeBlock
from vllm.layers.norm import RMSNorm
from vllm.layers.rotary import RotaryEmbedding
from vllm.models.llama_family import MLP, SelfAttention


@dataclass
class Qwen3MoeArgs:
    """The MoE fields of a Qwen3-MoE config.json (the rest is ModelConfig's)."""
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3MoeArgs":
        # transformers 5 writes `num_local_experts` (its attribute map), hub configs `num_experts`
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                                  ("moe_intermediate_size", hf.get("moe_intermediate_size"))) if v is None]
        if missing:
            raise ValueError(f"Qwen3-MoE config lacks {missing}")
        args = cls(num_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                   moe_intermediate_size=int(hf["moe_intermediate_size"]),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(hf.get("decoder_sparse_step", 1) or 1),
                   mlp_only_layers=[int(i) for i in (hf.get("mlp_only_layers") or [])],
                   router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
        if args.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {args.num_experts}")
        if not 1 <= args.num_experts_per_tok <= args.num_experts:
            raise ValueError(f"num_experts_per_tok={args.num_experts_per_tok} must be in [1, {args.num_experts}]")
        if args.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {args.decoder_sparse_step}")
        if hf.get("use_sliding_window"):
            raise ValueError("Qwen3-MoE with use_sliding_window=true is not supported")
        return args

    def is_sparse(self, layer_idx: int) -> bool:
        """transformers' rule: a MoE block unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


def read_hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


class MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: Qwen3MoeArgs, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_idx, rotary, dtype)
        if moe.is_sparse(layer_idx):
            self.mlp = SparseMoeBlock(moe.num_experts, moe.num_experts_per_tok, cfg.hidden_size,
                                      moe.moe_intermediate_size, moe.norm_topk_prob, dtype=dtype)
        else:
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


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: Qwen3MoeArgs, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(MoeDecoderLayer(cfg, moe, i, self.rotary, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


# HF checkpoint name -> our fused parameter: experts first (their names also contain
# `.gate_proj.` / `.up_proj.`, which elsewhere mean the dense MLP's fused gate_up)
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        # The MoE fields come from the HF config through our own parser (a ModelConfig
        # that already carries them as `moe` is used as is).
        self.moe_args: Qwen3MoeArgs = getattr(cfg, "moe", None) or Qwen3MoeArgs.from_hf(read_hf_config(cfg.path))
        if cfg.qkv_bias:
            raise ValueError("Qwen3-MoE with attention_bias=true is not supported")
        self.model = Qwen3MoeModel(cfg, self.moe_args, dtype)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                              tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token ids [T] and absolute positions [T] of a packed step -> final hidden states [T, H]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- HF names <-> parameters (loading, weight sync, save_pretrained) -------------------
    def resolve_hf_name(self, hf_name: str) -> tuple[str, object]:
        """HF tensor name -> (our parameter name, shard id within a fused parameter or None).
        Expert shards are (expert id, "gate" | "up" | "down")."""
        m = _EXPERT_RE.match(hf_name)
        if m:
            prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
            return f"{prefix}.{'down_proj' if kind == 'down' else 'gate_up_proj'}", (expert, kind)
        for frag, (fused, shard_id) in _PACKED.items():
            if f".{frag}." in hf_name:
                return hf_name.replace(f".{frag}.", f".{fused}."), shard_id
        return hf_name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the set of our parameter names (with shard) filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # derived from the config
            if self.config.tie_word_embeddings and hf_name == "lm_head.weight":
                continue  # tied: the embedding is the single source of truth
            name, shard = self.resolve_hf_name(hf_name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(self).__name__}")
            param = params[name]
            try:
                if shard is None:
                    param.weight_loader(param, tensor.to(param.dtype))
                else:
                    param.weight_loader(param, tensor.to(param.dtype), shard)
            except ValueError as err:
                raise ValueError(f"while loading {hf_name!r}: {err}") from None
            if shard is None and isinstance(self.get_submodule(name.rsplit(".", 1)[0]), FusedExperts):
                loaded.update(f"{name}[{sid}]" for sid in self.get_submodule(name.rsplit(".", 1)[0]).shard_ids(
                    name.rsplit(".", 1)[1]))
            else:
                loaded.add(name if shard is None else f"{name}[{shard}]")
        return loaded

    def expected_weight_keys(self) -> set[str]:
        keys = set()
        for name, p in self.named_parameters():
            mod_name, pname = name.rsplit(".", 1)
            mod = self.get_submodule(mod_name)
            if isinstance(mod, FusedLinear):
                keys.update(f"{name}[{sid}]" for sid in mod.shard_offsets)
            elif isinstance(mod, FusedExperts):
                keys.update(f"{name}[{sid}]" for sid in mod.shard_ids(pname))
            else:
                keys.add(name)
        return keys

    def hf_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Our parameters (or their .grad with grads=True) under HF checkpoint names: fused
        projections split back, one tensor per expert and projection."""
        inverse = {v: k for k, v in _PACKED.items()}
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            src = p.grad if grads else p
            if src is None:
                continue
            src = src.detach()
            mod_name, pname = name.rsplit(".", 1)
            mod = self.get_submodule(mod_name)
            if isinstance(mod, FusedLinear):
                fused = mod_name.rsplit(".", 1)
                for sid, part in mod.split_shards(src).items():
                    out[f"{fused[0]}.{inverse[(fused[1], sid)]}.{pname}"] = part
            elif isinstance(mod, FusedExperts):
                for expert, kind in mod.shard_ids(pname):
                    out[f"{mod_name}.{expert}.{kind}_proj.weight"] = mod.shard_view(src, (expert, kind))
            else:
                out[name] = src
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out

    # ---- execution contract ---------------------------------------------------------------
    def contract_extra(self, numerics: str, device) -> tuple[dict, dict]:
        """(semantic, numerical) entries this architecture adds to the execution contract."""
        from vllm.kernels.moe import moe_numerical_policy
        semantic = asdict(self.moe_args)
        semantic.pop("router_aux_loss_coef")  # a training-loss weight: no logprob depends on it
        return {"moe": semantic}, {"moe": moe_numerical_policy(numerics, device)}
