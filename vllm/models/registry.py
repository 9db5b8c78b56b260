"""Architecture name (config.json's `architectures[0]`) -> model class, imported lazily.

A model class provides what the rest of the engine asks of it (docs/architecture.md,
"Adding a model"): `config_class.from_hf`, `weight_mapping`, `hf_state_dict`,
`forward(ids, positions, activation_checkpointing=False)` and `compute_logits`.
"""
from __future__ import annotations

import importlib

# name -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("vllm.models.llama_family", "LlamaFamilyForCausalLM"),
    "Qwen2ForCausalLM": ("vllm.models.llama_family", "LlamaFamilyForCausalLM"),
    "LlamaForCausalLM": ("vllm.models.llama_family", "LlamaFamilyForCausalLM"),
    "Qwen3MoeForCausalLM": ("vllm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("vllm.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("vllm.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("vllm.models.qwen3_next", "Qwen3NextForCausalLM"),
    "NemotronHForCausalLM": ("vllm.models.nemotron_h", "NemotronHForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(arch: str):
    if arch not in _MODELS:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}")
    module, cls = _MODELS[arch]
    return getattr(importlib.import_module(module), cls)
