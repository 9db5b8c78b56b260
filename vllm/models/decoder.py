"""The decoder every model file composes: embedding, rotary, one layer per index, final norm
and LM head; the layer loop (with activation checkpointing) and the HF-name mapping.

A model file declares what differs: its config class (`config_class`, with `from_hf`), its
decoder layer (`layer_class(cfg, layer_idx, rotary, dtype)`, a module with
`forward(positions, x, residual) -> (x, residual)`), the HF names of its fused projections
(`hf_fused`) and, through `weight_slots`, the HF names of any parameter kind the generic
mapping does not know (e.g. one expert of a stacked expert weight). Where they differ from
Llama's, also the final norm's class (`norm_class`), how many dims of a head the rope
rotates (`rotary_dim`) and the checkpoint tensors it does not take (`skipped_hf_names`).

The same class runs rollout (the worker sets a paged-KV attention backend in the forward
context) and training (the trainer sets a packed-sequence one): it contains no
inference-only state and no parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from vllm.layers.embedding import LMHead, VocabEmbedding
from vllm.layers.linear import FusedLinear
from vllm.layers.norm import RMSNorm
from vllm.layers.rope_config import RopeScaling, positions_covered
from vllm.layers.rotary import RotaryEmbedding
from vllm.models.checkpointing import run_layers
from vllm.models.weights import WeightMapping, WeightSlot


@dataclass
class DecoderConfig:
    """The config.json fields every decoder here reads; a model's config class adds its own.
    Every field enters the execution contract's semantic digest."""
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

    @property
    def max_positions(self) -> int:
        """The longest context the rope covers (linear scaling stretches max_position_embeddings)."""
        return positions_covered(self.max_position_embeddings, self.rope_scaling)


class DecoderStack(nn.Module):
    """`model.*` of an HF causal LM: embed_tokens, layers.{i}, norm (and the shared rotary)."""

    def __init__(self, cfg, dtype: torch.dtype, layer_class, norm_class: type = RMSNorm, rotary_dim: int | None = None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling, rotary_dim)
        self.layers = nn.ModuleList(layer_class(cfg, i, self.rotary, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = norm_class(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, activation_checkpointing: bool = False) -> torch.Tensor:
        x, residual = run_layers(self.layers, positions, self.embed_tokens(input_ids), activation_checkpointing)
        x, _ = self.norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    config_class: type
    layer_class: type
    # HF projection -> (our fused projection, shard id)
    hf_fused = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # the final norm (the layers choose their own)
    norm_class: type = RMSNorm
    # name fragments of checkpoint tensors the model does not take (rope frequencies: computed
    # from the config)
    skipped_hf_names: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __init__(self, cfg, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg, dtype, self.layer_class, self.norm_class, self.rotary_dim(cfg))
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                              tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, activation_checkpointing: bool = False) -> torch.Tensor:
        """Token ids [T] and absolute positions [T] of a packed step -> final hidden states [T, H].
        `activation_checkpointing`: under autograd, recompute each decoder layer in backward
        (same bits, less memory)."""
        return self.model(input_ids, positions, activation_checkpointing)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @staticmethod
    def rotary_dim(cfg) -> int | None:
        """How many leading dims of each head the rope rotates (None: the whole head)."""
        return None

    # ---- checkpoint names -------------------------------------------------------------
    def weight_slots(self, name: str, module_name: str, kind: str, module: nn.Module) -> dict[str, WeightSlot] | None:
        """HF names -> slots for parameter `name` (`kind` of `module`) when the model knows
        them better than the generic mapping; None: the generic mapping (fused projections
        split by `hf_fused`, everything else under its own name)."""
        return None

    def weight_mapping(self) -> WeightMapping:
        """Every HF tensor name of this architecture -> the parameter (shard) it fills."""
        to_hf = {ours: hf for hf, ours in self.hf_fused.items()}
        slots: dict[str, WeightSlot] = {}
        for name, _ in self.named_parameters():
            module_name, kind = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            own = self.weight_slots(name, module_name, kind, module)
            if own is not None:
                slots.update(own)
            elif isinstance(module, FusedLinear):
                parent, fused = module_name.rsplit(".", 1)
                for sid in module.shard_offsets:
                    slots[f"{parent}.{to_hf[(fused, sid)]}.{kind}"] = WeightSlot(name, sid, partial(module.shard, shard_id=sid))
            else:
                slots[name] = WeightSlot(name)
        # tied: one tensor, the embedding; a checkpoint's lm_head.weight must equal it
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}
        return WeightMapping(self, slots, aliases=tied, derived=self.skipped_hf_names)

    def hf_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Our parameters (or their .grad with grads=True) under HF names, fused projections
        split back: for save_pretrained and for comparing with transformers."""
        return self.weight_mapping().state_dict(grads)
