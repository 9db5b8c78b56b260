"""Architecture name (from config.json) -> model class and its traits."""
from __future__ import annotations

import importlib

# name -> (module, class, traits). Traits are what distinguishes the members of
# one model family; the class itself reads them from ModelConfig.
_MODELS: dict[str, tuple[str, str, dict]] = {
    "Qwen3ForCausalLM": ("vllm.models.llama_family", "LlamaFamilyForCausalLM", {"qk_norm": True, "qkv_bias": False}),
    "Qwen2ForCausalLM": ("vllm.models.llama_family", "LlamaFamilyForCausalLM", {"qk_norm": False, "qkv_bias": True}),
    "LlamaForCausalLM": ("vllm.models.llama_family", "LlamaFamilyForCausalLM", {"qk_norm": False, "qkv_bias": False}),
    # MoE fields are parsed by the model class itself (Qwen3MoeArgs.from_hf)
    "Qwen3MoeForCausalLM": ("vllm.models.qwen3_moe", "Qwen3MoeForCausalLM", {"qk_norm": True, "qkv_bias": False}),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def architecture_traits(arch: str) -> dict:
    if arch not in _MODELS:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}")
    return dict(_MODELS[arch][2])


def model_class(arch: str):
    architecture_traits(arch)
    module, cls, _ = _MODELS[arch]
    return getattr(importlib.import_module(module), cls)
