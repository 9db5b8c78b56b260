"""Tiny, fully local test checkpoints and the project's byte-level BPE tokenizer.

Nothing here touches the network: the tokenizer is trained on the small corpus
shipped in `vllm/testing/data/corpus.txt`, and checkpoints are random-weight
HuggingFace models written with ``save_pretrained``.  Everything is
deterministic: the same arguments give the same files, byte for byte (for a
fixed torch / transformers / tokenizers version).

Public API
----------
``build_tokenizer(save_dir, vocab_size=512)``
    Train (once per process, cached) and write ``tokenizer.json`` +
    ``tokenizer_config.json`` (ChatML chat template) into ``save_dir``.
``make_tiny_checkpoint(path, arch="qwen3", ...)``
    Write a random-weight ``Qwen3ForCausalLM`` / ``Qwen2ForCausalLM`` /
    ``LlamaForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``Qwen3NextForCausalLM`` /
    ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` / ``NemotronHForCausalLM`` checkpoint
    (+ tokenizer, generation config) to ``path`` and return ``path``.
``load_hf_model(path, dtype)``
    Load a checkpoint with transformers (eval mode), as the reference model.
``ARCH_CONFIGS``
    What distinguishes each supported architecture.

Tokenizer conventions
---------------------
* Special tokens come first and have FIXED ids, whatever the vocab size:
  ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2.
* ``eos_token`` is ``<|im_end|>`` (id 2): the models speak ChatML, so a turn
  ends with ``<|im_end|>`` (this mirrors Qwen's instruct checkpoints).
  ``pad_token`` is ``<|endoftext|>`` (id 0).  There is no BOS token added to
  prompts and no UNK token (byte-level BPE can encode any string).
* Pre-tokenization uses Qwen2's split regex (digits are split one by one)
  followed by GPT-2 style byte-level mapping, so ``decode(encode(s)) == s``
  for any string (no normalizer, no cleanup of spaces).

Rope scaling spelling
---------------------
transformers 5.x stores rope settings in ``config.rope_parameters`` (which
also holds ``rope_theta``, e.g. ``{"rope_type": "default", "rope_theta":
10000.0}``); the legacy keys are ``rope_theta`` + ``rope_scaling``.  The
``config.json`` written here carries BOTH spellings (``rope_parameters`` and
legacy ``rope_theta`` / ``rope_scaling``, the latter ``null`` when unscaled),
so readers written against either convention work, and transformers 5.x
loads it back to the same ``rope_parameters``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from vllm.testing.corpus import get_corpus

__all__ = [
    "ARCH_CONFIGS",
    "CHATML_TEMPLATE",
    "DEFAULT_TOKENIZER_VOCAB_SIZE",
    "ENDOFTEXT",
    "EOS_TOKEN",
    "IM_END",
    "IM_START",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "load_hf_model",
    "make_tiny_checkpoint",
    "normalize_rope_scaling",
    "round_up",
    "special_token_ids",
]

# --------------------------------------------------------------------------- #
# Tokenizer                                                                   #
# --------------------------------------------------------------------------- #
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order matters: these get ids 0, 1, 2 in every vocabulary size.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
EOS_TOKEN = IM_END
PAD_TOKEN = ENDOFTEXT

DEFAULT_TOKENIZER_VOCAB_SIZE = 512

# Qwen2 / Qwen3 pre-tokenization regex (GPT-4 style, but single digits).
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, as used by Qwen:  <|im_start|>{role}\n{content}<|im_end|>\n ...
# ``content`` may also be a list of {"type": "text", "text": ...} parts.
# With add_generation_prompt the template ends in "<|im_start|>assistant\n".
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def special_token_ids() -> dict:
    """Ids of the special tokens (fixed for every vocab size)."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE on the repo corpus; return ``tokenizer.json`` text.

    Cached per process (training takes ~0.1 s, but tests call this a lot).
    BPE training in ``tokenizers`` is deterministic (merge ties are broken by
    the pair itself), which we rely on for byte-identical output.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    min_size = len(SPECIAL_TOKENS) + 256  # specials + the 256 byte symbols
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size}, got {vocab_size}")

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None  # keep text exactly as is (round-trip guarantee)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([get_corpus()], trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ValueError(
            f"the corpus only supports a vocabulary of {got} tokens (asked for {vocab_size}); "
            "use a smaller vocab_size or extend vllm/testing/data/corpus.txt"
        )
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok.to_str(pretty=False)


def _tokenizer_config(model_max_length: int) -> dict:
    """Contents of ``tokenizer_config.json`` (transformers' fast-tokenizer wrapper)."""
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
    }


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def build_tokenizer(
    save_dir: Union[str, os.PathLike],
    vocab_size: int = DEFAULT_TOKENIZER_VOCAB_SIZE,
    *,
    model_max_length: int = 1024,
) -> None:
    """Write the project's byte-level BPE tokenizer into ``save_dir``.

    Produces ``tokenizer.json`` (the ``tokenizers`` model) and
    ``tokenizer_config.json`` (class ``PreTrainedTokenizerFast``, ChatML chat
    template, eos ``<|im_end|>``, pad ``<|endoftext|>``).  Loadable offline with
    ``transformers.AutoTokenizer.from_pretrained(save_dir)``.  Deterministic.
    """
    save_dir = os.fspath(save_dir)
    os.makedirs(save_dir, exist_ok=True)
    with open(os.path.join(save_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(_trained_tokenizer_json(int(vocab_size)))
    _write_json(os.path.join(save_dir, "tokenizer_config.json"), _tokenizer_config(model_max_length))


# --------------------------------------------------------------------------- #
# Architectures                                                               #
# --------------------------------------------------------------------------- #
# What distinguishes each architecture (all three: pre-norm RMSNorm decoder,
# SwiGLU MLP with gate/up/down projections, rotary embeddings, GQA).
#   hf_class / config_class : transformers class names
#   qkv_bias                : q/k/v projections carry a bias (o_proj never does)
#   qk_norm                 : per-head RMSNorm on q and k before rope
#                             (weights `self_attn.q_norm.weight`, `k_norm`, size head_dim)
#   free_head_dim           : head_dim may differ from hidden_size // num_heads
#   zero_centred_norms      : the decoder's RMSNorms scale by (1 + w) (weights drawn near 0)
#   config_extra            : extra kwargs passed to the config class
# the hybrids' layer plan and Gated DeltaNet dims (Qwen3-Next, Qwen3.5), and their MoE with a shared expert
_HYBRID_EXTRA = {"attention_bias": False, "full_attention_interval": 4, "partial_rotary_factor": 0.25,
                 "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                 "linear_num_key_heads": 2, "linear_num_value_heads": 4}
_SHARED_EXPERT_MOE_EXTRA = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                            "shared_expert_intermediate_size": 48, "norm_topk_prob": True}

ARCH_CONFIGS: dict = {
    "qwen3": {
        "model_type": "qwen3",
        "hf_class": "Qwen3ForCausalLM",
        "config_class": "Qwen3Config",
        "qkv_bias": False,
        "qk_norm": True,
        "free_head_dim": True,
        "config_extra": {"attention_bias": False, "use_sliding_window": False},
        "notes": "Qwen3 dense: no qkv bias, RMSNorm on q/k per head; head_dim is an explicit "
        "config field (Qwen3-0.6B: hidden 1024, 16 heads, head_dim 128).",
    },
    "qwen2": {
        "model_type": "qwen2",
        "hf_class": "Qwen2ForCausalLM",
        "config_class": "Qwen2Config",
        "qkv_bias": True,
        "qk_norm": False,
        "free_head_dim": False,
        "config_extra": {"use_sliding_window": False},
        "notes": "Qwen2 / Qwen2.5: bias on q_proj/k_proj/v_proj (not o_proj), no q/k norm; "
        "head_dim = hidden_size // num_attention_heads.",
    },
    "llama": {
        "model_type": "llama",
        "hf_class": "LlamaForCausalLM",
        "config_class": "LlamaConfig",
        "qkv_bias": False,
        "qk_norm": False,
        "free_head_dim": True,
        "config_extra": {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
        "notes": "Llama 2/3: no biases, no q/k norm; optional 'llama3' rope scaling "
        "(factor, low/high_freq_factor, original_max_position_embeddings).",
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hf_class": "Qwen3MoeForCausalLM",
        "config_class": "Qwen3MoeConfig",
        "qkv_bias": False,
        "qk_norm": True,
        "free_head_dim": True,
        # MoE defaults of the tiny checkpoints; override with make_tiny_checkpoint(config_overrides=...)
        "config_extra": {"attention_bias": False, "use_sliding_window": False, "num_experts": 8,
                         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                         "decoder_sparse_step": 1, "mlp_only_layers": []},
        "notes": "Qwen3-MoE: Qwen3 attention; a router + experts block (experts.{e}.gate/up/down_proj "
        "in the checkpoint) on every decoder_sparse_step-th layer not in mlp_only_layers, which keep a "
        "dense MLP of intermediate_size (Qwen3-30B-A3B: 128 experts, top 8, moe_intermediate_size 768).",
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        # every 4th layer full attention (layers 0-2 Gated DeltaNet, 3 attention with 4 layers);
        # override layer_types / full_attention_interval to change the plan
        "config_extra": {**_HYBRID_EXTRA, **_SHARED_EXPERT_MOE_EXTRA, "decoder_sparse_step": 1, "mlp_only_layers": []},
        "hf_class": "Qwen3NextForCausalLM",
        "config_class": "Qwen3NextConfig",
        "qkv_bias": False,
        "qk_norm": True,
        "free_head_dim": True,
        "zero_centred_norms": True,
        "notes": "Qwen3-Next: Gated DeltaNet layers (linear_attn.in_proj_qkvz / in_proj_ba / conv1d / A_log / "
        "dt_bias / norm / out_proj) and gated full attention (q_proj 2x wide: [q | gate] per head, partial "
        "rope) in the order of layer_types; zero-centred RMSNorms; MoE blocks with a shared expert "
        "(Qwen3-Next-80B-A3B: 48 layers, 512 experts top 10, head_dim 256, partial_rotary_factor 0.25).",
    },
    "qwen3_5": {
        "model_type": "qwen3_5_text",
        "hf_class": "Qwen3_5ForCausalLM",
        "config_class": "Qwen3_5TextConfig",
        "qkv_bias": False,
        "qk_norm": True,
        "free_head_dim": True,
        "zero_centred_norms": True,
        "config_extra": dict(_HYBRID_EXTRA),
        "notes": "Qwen3.5's text model: Qwen3-Next's layers with four Gated DeltaNet input projections "
        "(in_proj_qkv / in_proj_z / in_proj_b / in_proj_a) and dense MLPs; its multimodal rope is the "
        "plain rope on text positions.",
    },
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe_text",
        "hf_class": "Qwen3_5MoeForCausalLM",
        "config_class": "Qwen3_5MoeTextConfig",
        "qkv_bias": False,
        "qk_norm": True,
        "free_head_dim": True,
        "zero_centred_norms": True,
        "config_extra": {**_HYBRID_EXTRA, **_SHARED_EXPERT_MOE_EXTRA},
        "notes": "Qwen3.5-MoE's text model: Qwen3.5's layers with Qwen3-Next's MoE block (shared expert) on "
        "every layer, top-k weights always normalised.",
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        "hf_class": "NemotronHForCausalLM",
        "config_class": "NemotronHConfig",
        "qkv_bias": False,
        "qk_norm": False,
        "free_head_dim": True,
        # Mamba-2 with 4 heads of 16, 2 groups, d_state 16, chunk 16; override layers_block_type
        # (and num_hidden_layers to its length) to change the plan
        "config_extra": {"layers_block_type": ["mamba", "attention", "mlp", "mamba", "mlp"], "mamba_num_heads": 4,
                         "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4,
                         "chunk_size": 16, "use_conv_bias": True, "mlp_hidden_act": "relu2",
                         "layer_norm_epsilon": 1e-5},
        "notes": "Nemotron-H: one mixer per layer in the order of layers_block_type: Mamba-2 (mixer.in_proj / "
        "conv1d / dt_bias / A_log / D / norm / out_proj), attention without rope, relu^2 MLP (up/down); "
        "model.embeddings, model.norm_f (Nemotron-H-8B: 52 layers, 128 Mamba heads of 64, d_state 128).",
    },
}


def normalize_rope_scaling(rope_scaling: Optional[Mapping[str, Any]]) -> Optional[dict]:
    """Canonical rope-scaling dict: key ``rope_type`` (legacy ``type`` accepted), no ``rope_theta``.

    Returns None for no scaling (None, {} or rope_type "default").
    """
    if not rope_scaling:
        return None
    rs = dict(rope_scaling)
    if "type" in rs:
        legacy = rs.pop("type")
        rs.setdefault("rope_type", legacy)
    rs.pop("rope_theta", None)
    if rs.get("rope_type", "default") == "default":
        return None
    return rs


def _build_config(arch: str, overrides: Optional[Mapping[str, Any]] = None, **kw):
    import transformers

    spec = ARCH_CONFIGS[arch]
    cls = getattr(transformers, spec["config_class"])
    return cls(**{**spec["config_extra"], **(overrides or {})}, **kw)


# zero-centred RMSNorm weights (scale 1 + w) of the decoder: per layer, per head, final
_ZERO_CENTRED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
                       "model.norm.weight")


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int, init_std: float, zero_centred_norms: bool = False) -> None:
    """Deterministic, non-degenerate init, independent of transformers' own init.

    * matrices (linear / embedding weights): N(0, init_std)
    * 1-D weights (every RMSNorm, incl. q_norm/k_norm): 1 + 0.1 * N(0, 1), so a
      loader that drops them (leaving 1.0) or swaps them is caught; with
      `zero_centred_norms` the decoder's norms, which scale by 1 + w, get 0.1 * N(0, 1)
    * biases: N(0, 5 * init_std) (= 0.1 by default), clearly non-zero
    * Gated DeltaNet: `A_log` = log(U(0.01, 16)) and `dt_bias` near 1 as transformers
      draws them; `conv1d.weight` N(0, 1 / sqrt(kernel)) so the conv keeps its input's scale
    * Mamba-2 (`mixer.dt_bias`): softplus^-1 of a time step log-uniform in [0.001, 0.1], as
      transformers draws it (a long memory: states carry across chunks)
    Values are drawn in float32 from one generator, in named_parameters order
    (tied weights appear once), then cast to the parameter's dtype.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith(".bias"):
            value = noise * (5.0 * init_std)
        elif name.endswith("mixer.dt_bias"):
            dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * torch.rand(shape, generator=gen))
            value = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith("A_log"):
            value = torch.log(0.01 + (16.0 - 0.01) * torch.rand(shape, generator=gen, dtype=torch.float32))
        elif name.endswith("conv1d.weight"):
            value = noise / shape[-1] ** 0.5
        elif zero_centred_norms and name.endswith(_ZERO_CENTRED_NORMS):
            value = 0.1 * noise
        elif param.dim() == 1:
            value = 1.0 + 0.1 * noise
        else:
            value = noise * init_std
        param.copy_(value.to(param.dtype))


@contextlib.contextmanager
def _no_progress_bars():
    """Silence transformers' "Writing model shards" / "Loading weights" bars (restored after)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _cleanup_old_weights(path: str) -> None:
    """Remove weights left by a previous checkpoint in ``path`` (stale shards would confuse loaders)."""
    for fn in os.listdir(path):
        if fn.startswith("model") and (fn.endswith(".safetensors") or fn.endswith(".safetensors.index.json")):
            os.remove(os.path.join(path, fn))
        elif fn.startswith("pytorch_model") and (fn.endswith(".bin") or fn.endswith(".bin.index.json")):
            os.remove(os.path.join(path, fn))


def make_tiny_checkpoint(
    path: Union[str, os.PathLike],
    arch: str = "qwen3",
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: Optional[int] = None,
    intermediate_size: int = 128,
    vocab_size: Optional[int] = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    rope_scaling: Optional[Mapping[str, Any]] = None,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.02,
    max_shard_size: Optional[Union[int, str]] = None,
    with_tokenizer: bool = True,
    tokenizer_vocab_size: int = DEFAULT_TOKENIZER_VOCAB_SIZE,
    eos_token_id: Optional[Union[int, Sequence[int]]] = None,
    config_overrides: Optional[Mapping[str, Any]] = None,
) -> str:
    """Write a random-weight HF checkpoint of architecture ``arch`` to ``path``; return ``path``.

    ``arch``: "qwen3" | "qwen2" | "llama" | "qwen3_moe" | "qwen3_next" | "qwen3_5" | "qwen3_5_moe" |
    "nemotron_h"
    (see ``ARCH_CONFIGS``).
    ``head_dim``: None => hidden_size // num_attention_heads (qwen2 allows nothing else).
    ``vocab_size``: None => tokenizer size rounded up to a multiple of 64 (512 -> 512).
    ``rope_scaling``: e.g. ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 256}`` (legacy key
    ``type`` accepted); written as both ``rope_parameters`` and legacy ``rope_scaling``.
    ``dtype``: dtype of the stored weights (drawn in fp32 then cast, so a bf16 checkpoint is
    the rounding of the fp32 one with the same seed).
    ``max_shard_size``: passed to ``save_pretrained`` (e.g. "100KB" => several
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``).
    ``eos_token_id``: None => id of ``<|im_end|>`` (2).  bos/pad ids are ``<|endoftext|>`` (0)
    in config.json, as Qwen does; the tokenizer itself never adds a BOS.
    ``config_overrides``: values replacing the architecture's ``config_extra`` (e.g. for
    "qwen3_moe": ``{"num_experts": 4, "mlp_only_layers": [1], "norm_topk_prob": False}``; for
    "qwen3_next": ``{"layer_types": ["full_attention"] * 3}``).
    Also writes ``generation_config.json`` and (``with_tokenizer``) the tokenizer files.
    """
    import transformers
    from transformers import GenerationConfig

    if arch not in ARCH_CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCH_CONFIGS)}")
    spec = ARCH_CONFIGS[arch]
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    _cleanup_old_weights(path)

    if head_dim is None:
        head_dim = hidden_size // num_attention_heads
    if not spec["free_head_dim"] and head_dim * num_attention_heads != hidden_size:
        raise ValueError(f"{arch}: head_dim must equal hidden_size // num_attention_heads")

    ids = special_token_ids()
    if vocab_size is None:
        vocab_size = round_up(tokenizer_vocab_size, 64)
    if with_tokenizer and vocab_size < tokenizer_vocab_size:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {tokenizer_vocab_size}")
    if eos_token_id is None:
        eos_token_id = ids[IM_END]
    elif not isinstance(eos_token_id, int):
        eos_token_id = [int(i) for i in eos_token_id]

    scaling = normalize_rope_scaling(rope_scaling)
    if rope_scaling and "rope_theta" in rope_scaling:
        rope_theta = float(rope_scaling["rope_theta"])
    rope_parameters = {"rope_type": "default"} if scaling is None else copy.deepcopy(scaling)
    rope_parameters["rope_theta"] = float(rope_theta)

    config_kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        rms_norm_eps=rms_norm_eps,
        use_cache=True,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope_parameters,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=eos_token_id,
        pad_token_id=ids[PAD_TOKEN],
        attention_dropout=0.0,
    )
    if spec["free_head_dim"]:
        config_kwargs["head_dim"] = head_dim
    config = _build_config(arch, config_overrides, **config_kwargs)
    config.architectures = [spec["hf_class"]]

    # Build in fp32 (the generator draws fp32 values), then cast.  transformers'
    # own init uses the global RNG: seed it, but inside fork_rng so the caller's
    # RNG state is left untouched.  Our _init_weights then overwrites every
    # parameter from its own seeded generator.
    model_cls = getattr(transformers, spec["hf_class"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    _init_weights(model, seed, init_std, spec.get("zero_centred_norms", False))
    model = model.to(dtype).eval()
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=eos_token_id,
        pad_token_id=ids[PAD_TOKEN],
    )

    save_kwargs = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    with _no_progress_bars():
        model.save_pretrained(path, **save_kwargs)
    _add_legacy_config_keys(os.path.join(path, "config.json"), rope_theta, scaling, dtype)

    if with_tokenizer:
        build_tokenizer(path, tokenizer_vocab_size, model_max_length=max_position_embeddings)
    return path


def _add_legacy_config_keys(config_path: str, rope_theta: float, scaling: Optional[dict], dtype) -> None:
    """Add legacy (transformers 4.x / vLLM-style) keys next to the 5.x ones in config.json.

    ``rope_theta`` + ``rope_scaling`` mirror ``rope_parameters``; ``torch_dtype`` mirrors
    ``dtype``.  transformers 5.x reads ``rope_parameters`` and ignores the duplicates.
    """
    with open(config_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["rope_theta"] = float(rope_theta)
    cfg["rope_scaling"] = copy.deepcopy(scaling)
    dtype_name = str(dtype).replace("torch.", "")
    cfg["dtype"] = dtype_name
    cfg["torch_dtype"] = dtype_name
    _write_json(config_path, cfg)


def load_hf_model(
    path: Union[str, os.PathLike],
    dtype: torch.dtype = torch.float32,
    *,
    attn_implementation: str = "eager",
    device: Union[str, torch.device] = "cpu",
    **from_pretrained_kwargs: Any,
):
    """Load ``path`` with transformers' ``AutoModelForCausalLM`` (eval mode): the reference model.
    ``from_pretrained_kwargs`` go to ``from_pretrained`` (e.g. ``experts_implementation``)."""
    from transformers import AutoModelForCausalLM

    with _no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(
            os.fspath(path),
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
            **from_pretrained_kwargs,
        )
    return model.to(device).eval()


def compare_grads(ours: Mapping[str, torch.Tensor], hf_model: torch.nn.Module, tol: float = 1e-4,
                  tolerances: Mapping[str, float] | None = None) -> set:
    """Our gradients (HF names -> tensors) against the transformers model's `.grad` after its
    backward: each relative error below `tol`, or `tolerances[suffix]` for names ending in a
    suffix given there (AssertionError naming the first that is not). Returns the names
    compared (parameters whose reference gradient is nonzero)."""
    checked = set()
    for name, p in hf_model.named_parameters():
        if p.grad is None or p.grad.norm() == 0:
            continue
        err = ((ours[name].double() - p.grad).norm() / p.grad.norm()).item()
        limit = next((t for suffix, t in (tolerances or {}).items() if name.endswith(suffix)), tol)
        assert err < limit, f"{name}: relative gradient error {err:.2e}"
        checked.add(name)
    return checked
