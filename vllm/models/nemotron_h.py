"""Nemotron-H (`NemotronHForCausalLM`): a hybrid whose layers each hold one mixer, in the order
the config gives: Mamba-2 (`M`), attention (`*`) or an MLP (`-`).

- Every layer is pre-norm: `norm`, the mixer, the residual add (fused into the next norm here).
- Mamba-2: vllm/layers/mamba2.py (docs/hybrid.md, "Mamba-2").
- Attention: grouped-query attention without positional encoding (no rope), no biases.
- MLP: up_proj, relu^2, down_proj (no gate).
- The MoE layers (`E`) of Nemotron-3 are not implemented: their router (sigmoid scores with a
  correction bias, grouped top-k, a scaling factor), relu^2 experts without a gate and latent
  projections are not vllm/layers/moe.py's block, so a config with one is refused.

Caches are indexed per kind: the attention layers are 0, 1, ... in the attention backend, the
Mamba-2 layers 0, 1, ... in the state backend. HF names are the checkpoints' (`backbone.embeddings`,
`backbone.layers.{i}.norm` / `.mixer.*`, `backbone.norm_f`, `lm_head`, as transformers also saves
them; q/k/v fused here); transformers' in-memory `model.*` spelling loads as an alias, and the
multi-token-prediction layers (`mtp.*`) are not run and not loaded, as in transformers. The
RMSNorms round as Llama's (the normalised row, then the weight product); transformers rounds
Nemotron-H's once, which differs in the last bit in bf16 only. Like every model this file holds
no parallelism and no inference-only state.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from vllm.layers.activation import ReluSquared
from vllm.layers.attention import Attention
from vllm.layers.embedding import LMHead, VocabEmbedding
from vllm.layers.linear import FusedLinear, Linear
from vllm.layers.mamba2 import Mamba2Mixer
from vllm.layers.norm import RMSNorm, pre_norm
from vllm.models.checkpointing import run_layers
from vllm.models.decoder import DecoderForCausalLM
from vllm.models.weights import WeightMapping, WeightSlot

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
# hybrid_override_pattern's letters, and the legacy names layers_block_type may use
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
LEGACY_NAMES = {"mamba": MAMBA, "attention": ATTENTION}
# transformers' defaults for keys a config.json may leave out, and the original checkpoints'
# (trust_remote_code) spelling of some keys (transformers reads all but attention_head_dim)
_DEFAULTS = {"max_position_embeddings": 4096, "layer_norm_epsilon": 1e-5, "head_dim": 128, "n_groups": 8,
             "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True,
             "time_step_limit": (0.0, float("inf")),
             "ssm_state_size": 128, "mamba_num_heads": 128, "mamba_head_dim": 64}
_LEGACY_KEYS = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "chunk_size": "mamba_chunk_size",
                "use_conv_bias": "mamba_conv_bias", "head_dim": "attention_head_dim"}


def _time_step_limit_low(limit) -> float:
    """time_step_limit = [low, high] -> low; the scan clamps below only. transformers writes
    infinity into config.json as {"__float__": "Infinity"}."""
    def number(v) -> float:
        return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)

    try:
        low, high = (number(v) for v in limit)
    except (TypeError, ValueError):
        raise ValueError(f"time_step_limit must be [low, high], got {limit!r}") from None
    if high != float("inf"):
        raise ValueError(f"time_step_limit {list(limit)}: an upper limit on the time step is not implemented "
                         f"(only [low, inf])")
    if not 0.0 <= low < high:
        raise ValueError(f"time_step_limit {list(limit)}: low must be >= 0")
    return low


@dataclass
class NemotronHConfig:
    """The fields of config.json this model reads. Every field enters the execution contract's
    semantic digest, so it holds what decides the model's function (`expand`,
    `time_step_max`, `residual_in_fp32` ... are not kept: transformers' forward does not read
    them either)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # 0: no MLP layer
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    layer_norm_epsilon: float
    tie_word_embeddings: bool
    layer_types: list[str]
    mlp_bias: bool
    use_bias: bool  # the Mamba-2 in_proj / out_proj biases
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    use_conv_bias: bool
    chunk_size: int
    # the time step's lower clamp: time_step_limit[0] (mamba_ssm's dt_limit, as transformers'
    # chunked scan applies it); an upper limit other than inf is refused
    time_step_limit_low: float

    @classmethod
    def from_hf(cls, hf: dict) -> "NemotronHConfig":
        """Parse an HF config.json dict; ValueError for what this model does not implement."""
        arch = (hf.get("architectures") or [None])[0]
        if arch != "NemotronHForCausalLM":
            raise ValueError(f"architecture {arch!r} is not NemotronHForCausalLM")
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if hf.get(key, want) != want:
                raise ValueError(f"{key} {hf[key]!r} is not supported (only {want!r})")

        def get(key: str):
            legacy = _LEGACY_KEYS.get(key)
            if key in hf and hf[key] is not None:
                return hf[key]
            if legacy is not None and hf.get(legacy) is not None:
                return hf[legacy]
            return _DEFAULTS[key]
        layer_types = cls._layer_types(hf)
        try:
            heads = int(hf["num_attention_heads"])
            cfg = cls(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=int(hf["hidden_size"]),
                intermediate_size=int(hf["intermediate_size"]) if MLP in layer_types else 0,
                num_hidden_layers=len(layer_types),
                num_attention_heads=heads,
                num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(get("head_dim")),
                max_position_embeddings=int(get("max_position_embeddings")),
                layer_norm_epsilon=float(get("layer_norm_epsilon")),
                # transformers' NemotronHForCausalLM never ties (its _tied_weights_keys is empty),
                # whatever the config says: the checkpoint's lm_head is its own, and so is ours
                tie_word_embeddings=False,
                layer_types=layer_types,
                mlp_bias=bool(hf.get("mlp_bias", False)),
                use_bias=bool(hf.get("use_bias", False)),
                mamba_num_heads=int(get("mamba_num_heads")),
                mamba_head_dim=int(get("mamba_head_dim")),
                n_groups=int(get("n_groups")),
                ssm_state_size=int(get("ssm_state_size")),
                conv_kernel=int(get("conv_kernel")),
                use_conv_bias=bool(get("use_conv_bias")),
                chunk_size=int(get("chunk_size")),
                time_step_limit_low=_time_step_limit_low(get("time_step_limit")),
            )
        except KeyError as err:
            raise ValueError(f"config.json of a {arch} lacks {err.args[0]!r}") from None
        cfg._validate()
        return cfg

    @staticmethod
    def _layer_types(hf: dict) -> list[str]:
        """`layers_block_type` (or its alias `layer_types`; legacy names "mamba" / "attention"
        accepted, as transformers remaps them), else the legacy `hybrid_override_pattern`."""
        given = hf.get("layers_block_type") or hf.get("layer_types")
        if given is not None:
            return [LEGACY_NAMES.get(t, t) for t in given]
        pattern = hf.get("hybrid_override_pattern")
        if pattern is None:
            raise ValueError("config.json of a NemotronHForCausalLM gives neither layers_block_type nor "
                             "hybrid_override_pattern")
        unknown = sorted(set(pattern) - set(PATTERN))
        if unknown:
            raise ValueError(f"hybrid_override_pattern has letters {unknown}; known: {''.join(PATTERN)}")
        return [PATTERN[c] for c in pattern]

    def _validate(self) -> None:
        unknown = sorted(set(self.layer_types) - {MAMBA, ATTENTION, MLP, MOE})
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported ({MAMBA!r}, {ATTENTION!r}, {MLP!r})")
        if MOE in self.layer_types:
            raise ValueError("Nemotron-H MoE layers ('moe', pattern letter 'E') are not supported: their routing "
                             "(sigmoid scores with a correction bias, grouped top-k) and relu^2 experts are not "
                             "implemented; only Mamba-2 ('M'), attention ('*') and MLP ('-') layers are")
        if not self.layer_types:
            raise ValueError("Nemotron-H config has no layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads={self.mamba_num_heads} is not a multiple of n_groups={self.n_groups}")
        if self.mamba_head_dim % 16 or self.ssm_state_size % 16:
            raise ValueError(f"mamba_head_dim={self.mamba_head_dim} and ssm_state_size={self.ssm_state_size} must be "
                             "multiples of 16 (the scan's tiles)")
        if self.chunk_size < 16 or self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size={self.chunk_size} must be a power of two >= 16")
        if not 2 <= self.conv_kernel <= 4:
            raise ValueError(f"conv_kernel={self.conv_kernel} is not supported (2..4)")

    def kind_index(self, layer_idx: int) -> int:
        """The layer's index among the layers of its own kind (its cache's index in its backend)."""
        return self.layer_types[:layer_idx].count(self.layer_types[layer_idx])


class NemotronHAttention(nn.Module):
    """Grouped-query attention, no rope and no biases (transformers' NemotronHAttention);
    q/k/v fused into one projection."""

    def __init__(self, cfg: NemotronHConfig, attention_idx: int, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                                    dtype=dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, dtype=dtype)
        self.attn = Attention(attention_idx, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attn(q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim),
                        v.reshape(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(out.reshape(-1, self.q_size))


class NemotronHMLP(nn.Module):
    """down_proj(relu(up_proj(x))^2), no gate."""

    def __init__(self, cfg: NemotronHConfig, dtype: torch.dtype):
        super().__init__()
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)
        self.act = ReluSquared()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHBlock(nn.Module):
    """Pre-norm residual layer around one mixer; the residual add is fused into the next norm."""

    def __init__(self, cfg: NemotronHConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.block_type = cfg.layer_types[layer_idx]
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype=dtype)
        if self.block_type == MAMBA:
            self.mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups,
                                     cfg.ssm_state_size, cfg.conv_kernel, cfg.chunk_size, cfg.time_step_limit_low,
                                     cfg.layer_norm_epsilon, state_idx=cfg.kind_index(layer_idx),
                                     use_bias=cfg.use_bias, use_conv_bias=cfg.use_conv_bias, dtype=dtype)
        elif self.block_type == ATTENTION:
            self.mixer = NemotronHAttention(cfg, cfg.kind_index(layer_idx), dtype)
        else:
            self.mixer = NemotronHMLP(cfg, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        x, residual = pre_norm(self.norm, x, residual)
        return self.mixer(x), residual


class NemotronHStack(nn.Module):
    """`model.*` of transformers' NemotronHForCausalLM: embeddings, layers.{i}, norm_f."""

    def __init__(self, cfg: NemotronHConfig, dtype: torch.dtype):
        super().__init__()
        self.embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                activation_checkpointing: bool = False) -> torch.Tensor:
        x, residual = run_layers(self.layers, positions, self.embeddings(input_ids), activation_checkpointing)
        x, _ = self.norm_f(x, residual)
        return x


class NemotronHForCausalLM(DecoderForCausalLM):
    """The decoder's interface (forward, compute_logits, hf_state_dict) around Nemotron-H's own
    stack and names."""
    config_class = NemotronHConfig
    # the multi-token-prediction layers, which transformers does not load either
    skipped_hf_names = ("mtp.",)

    def __init__(self, cfg: NemotronHConfig, dtype: torch.dtype = torch.float32):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = NemotronHStack(cfg, dtype)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                              tied_to=self.model.embeddings if cfg.tie_word_embeddings else None)

    def weight_mapping(self) -> WeightMapping:
        """The checkpoints' names (the original `backbone.*`, which transformers also writes):
        every parameter under its own name, the fused q/k/v projection split into q_proj /
        k_proj / v_proj. transformers' in-memory `model.*` spelling of each is accepted on input
        as an alias (given both, they must hold the same bits), and a tied lm_head as the
        embedding."""
        slots: dict[str, WeightSlot] = {}
        for name, _ in self.named_parameters():
            module_name, kind = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            hf_module = "backbone." + module_name.removeprefix("model.") if module_name.startswith("model.") \
                else module_name
            if isinstance(module, FusedLinear):
                parent = hf_module.rsplit(".", 1)[0]
                for sid in module.shard_offsets:
                    slots[f"{parent}.{sid}_proj.{kind}"] = WeightSlot(name, sid, partial(module.shard, shard_id=sid))
            else:
                slots[f"{hf_module}.{kind}"] = WeightSlot(name)
        aliases = {"model." + name.removeprefix("backbone."): name for name in slots if name.startswith("backbone.")}
        if self.config.tie_word_embeddings:
            aliases["lm_head.weight"] = "backbone.embeddings.weight"
        return WeightMapping(self, slots, aliases=aliases, derived=self.skipped_hf_names)
