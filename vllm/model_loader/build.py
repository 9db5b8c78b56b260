"""The one path from a checkpoint directory to a ready model, shared by the engine
(`LLM` -> `LLMEngine` -> `ModelRunner`) and the trainer (`Policy.from_pretrained`):
config.json -> `ModelConfig` + the model class's own config -> dtype -> model
class -> weights -> (invariant numerics) the kernels' support check and self-check.
"""
from __future__ import annotations

import logging
import time

import torch

from vllm.config import KernelConfig, ModelConfig, ParallelConfig, resolve_dtype
from vllm.model_loader.loader import checkpoint_files, init_dummy_weights, iterate_weights, load_weights
from vllm.models.registry import model_class

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("safetensors", "dummy")


def parse_model_config(model_config: ModelConfig):
    """The model class's own config (e.g. `LlamaFamilyConfig`) parsed from config.json;
    ValueError for an unsupported architecture or option."""
    return model_class(model_config.architecture).config_class.from_hf(model_config.hf_config)


def resolve_model(path: str, *, dtype: str | torch.dtype | None, device: str | torch.device,
                  max_model_len: int | None = None) -> tuple[ModelConfig, torch.dtype]:
    """Read and validate a checkpoint's config (architecture-specific fields included, so an
    unsupported model fails here, before anything is loaded) and resolve the dtype."""
    mc = ModelConfig.from_pretrained(path, max_model_len=max_model_len)
    parse_model_config(mc)
    return mc, resolve_dtype(dtype, torch.device(device).type, mc.torch_dtype)


def build_model(model_config: ModelConfig, dtype: torch.dtype, device: str | torch.device, *, numerics: str,
                load_format: str = "safetensors", self_check_tokens: int | None = None,
                kernels: KernelConfig | None = None, quantization: str | None = None,
                keep_master_weights: bool = True, parallel: ParallelConfig | None = None) -> tuple[torch.nn.Module, dict | None]:
    """Instantiate the model class on `device`, fill its weights, and in numerics="invariant"
    refuse unverified devices; then run the start-up check the mode needs on this device
    (vllm.kernels.selfcheck.start_up_check: the GEMM self-check in invariant mode on CUDA,
    with the kernel options `kernels`; `self_check_tokens`: the largest step the caller
    runs). Returns (model in eval mode, self-check report or None)."""
    device = torch.device(device)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if numerics == "invariant":
        from vllm.kernels.selfcheck import check_supported
        check_supported(device, dtype)
    cls = model_class(model_config.architecture)
    arch_config = cls.config_class.from_hf(model_config.hf_config)
    with torch.device(device):
        model = cls(arch_config, dtype=dtype)
    reader = None
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        from vllm.model_loader.fp8_checkpoint import FP8CheckpointReader, checkpoint_quantization
        files = checkpoint_files(model_config.path)
        try:
            ckpt_quant = checkpoint_quantization(model_config.hf_config)
            reader = FP8CheckpointReader(iterate_weights(files)) if ckpt_quant else None
            load_weights(model, reader if reader is not None else iterate_weights(files))
        except ValueError as err:
            raise ValueError(f"checkpoint {model_config.path!r}: {err}") from None
    if quantization is not None:
        from vllm.layers.linear import enable_fp8
        n = enable_fp8(model)  # quantized from the master weights at load ...
        if load_format != "dummy" and reader is not None:
            taken = reader.apply(model)  # ... or the FP8 checkpoint's own bits where they line up
            logger.info("fp8 linear layers: %d, %d weight tensors taken from the fp8 checkpoint as they are", n, taken)
        if not keep_master_weights:
            from vllm.layers.linear import drop_master_weights
            logger.info("fp8 linear layers without master weights: %d", drop_master_weights(model))
    model.eval()
    from vllm.kernels.selfcheck import start_up_check
    t0 = time.perf_counter()
    report = start_up_check(model, numerics, device, dtype, max_tokens=self_check_tokens, kernels=kernels)
    if report is not None:
        logger.info("%s numerics self-check passed in %.2f s", numerics, time.perf_counter() - t0)
    if parallel is not None and parallel.leaves is not None:
        # tensor parallelism in this process (all ranks on this device), or the K-leaf tree at TP=1
        from vllm.parallel.tensor_parallel import apply_tensor_parallel
        apply_tensor_parallel(model, parallel.tensor_parallel_size, leaves=parallel.leaves)
    return model, report
