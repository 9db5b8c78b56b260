"""The one path from a checkpoint directory to a ready model, shared by the engine
(`LLM` -> `LLMEngine` -> `ModelRunner`) and the trainer (`Policy.from_pretrained`):
config.json -> `ModelConfig` + the model class's own config -> `NumericsSpec` (dtype,
numerics, kernel options, KV cache dtype, quantization, parallelism) -> model class ->
weights -> (invariant numerics) the kernels' support check and self-check.
"""
from __future__ import annotations

import logging
import time

import torch

from vllm.config import KernelConfig, ModelConfig, NumericsSpec, ParallelConfig, resolve_dtype
from vllm.model_loader.loader import checkpoint_files, init_dummy_weights, iterate_weights, load_weights
from vllm.models.registry import model_class

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("safetensors", "dummy")


def parse_model_config(model_config: ModelConfig):
    """The model class's own config (e.g. `LlamaFamilyConfig`) parsed from config.json;
    ValueError for an unsupported architecture or option."""
    return model_class(model_config.architecture).config_class.from_hf(model_config.hf_config)


def read_model_config(path: str, max_model_len: int | None = None) -> ModelConfig:
    """Read and validate a checkpoint's config (architecture-specific fields included, so an
    unsupported model fails here, before anything is loaded)."""
    mc = ModelConfig.from_pretrained(path)
    # the model class knows the positions it covers (a linear rope scaling stretches them)
    mc.limit_context(max_model_len, getattr(parse_model_config(mc), "max_positions", None))
    return mc


def resolve_model(path: str, *, dtype: str | torch.dtype | None, device: str | torch.device,
                  max_model_len: int | None = None) -> tuple[ModelConfig, torch.dtype]:
    """The checkpoint's validated config and the model dtype `dtype` resolves to on `device`."""
    mc = read_model_config(path, max_model_len)
    return mc, resolve_dtype(dtype, torch.device(device).type, mc.torch_dtype)


def resolve_numerics(model_config: ModelConfig, device: str | torch.device, *, dtype: str | torch.dtype | None = "auto",
                     numerics: str = "invariant", kernels: KernelConfig | None = None, kv_cache_dtype: str = "auto",
                     quantization: str | None = None, tensor_parallel_size: int = 1,
                     tp_leaves: int | None = None) -> NumericsSpec:
    """The user's numerics options against this checkpoint, as one NumericsSpec: dtype "auto"
    -> the checkpoint's (float32 on CPU), no quantization asked -> the checkpoint's own (an
    FP8 checkpoint runs FP8). ValueError for an option out of range."""
    from vllm.model_loader.fp8_checkpoint import checkpoint_quantization
    return NumericsSpec(dtype=resolve_dtype(dtype, torch.device(device).type, model_config.torch_dtype),
                        numerics=numerics, kernels=kernels or KernelConfig(), kv_cache_dtype=kv_cache_dtype,
                        quantization=quantization or checkpoint_quantization(model_config.hf_config),
                        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size, tp_leaves=tp_leaves))


def build_model(model_config: ModelConfig, spec: NumericsSpec, device: str | torch.device, *,
                load_format: str = "safetensors", self_check_tokens: int | None = None,
                keep_master_weights: bool = True) -> tuple[torch.nn.Module, dict | None]:
    """Instantiate the model class on `device` in `spec.dtype`, fill its weights, quantize
    its linear layers as `spec.quantization` says, and in numerics="invariant" refuse
    unverified devices; then run the start-up check the mode needs on this device
    (vllm.kernels.selfcheck.start_up_check: the GEMM self-check in invariant mode on CUDA,
    with the kernel options `spec.kernels`; `self_check_tokens`: the largest step the caller
    runs) and apply `spec.parallel`. Returns (model in eval mode, self-check report or None)."""
    if not isinstance(spec, NumericsSpec):
        raise ValueError(f"build_model takes a NumericsSpec (vllm.config), got {type(spec).__name__}")
    device = torch.device(device)
    dtype, numerics, parallel = spec.dtype, spec.numerics, spec.parallel
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
    if spec.quantization is not None:
        from vllm.layers.linear import enable_fp8
        from vllm.model_loader.fp8_checkpoint import unquantized_linears, unquantized_modules
        # quantized from the master weights, but for what the checkpoint keeps in the model dtype
        keep = unquantized_linears(model, unquantized_modules(model_config.hf_config))
        n = enable_fp8(model, skip=keep)
        if load_format != "dummy" and reader is not None:
            same, compared = reader.compare(model)
            log = logger.info if same == compared else logger.warning
            log("fp8 linear layers: %d (%d kept in the model dtype); %d of %d checkpoint fp8 tensors are what the "
                "master re-quantizes to%s", n, len(keep), same, compared,
                "" if same == compared else ": the others are served as the master re-quantized (the checkpoint's "
                "scales are not amax / 448 of the model-dtype weights), the same in rollout and trainer")
        if not keep_master_weights:
            from vllm.layers.linear import drop_master_weights
            logger.info("fp8 linear layers without master weights: %d", drop_master_weights(model))
    model.eval()
    from vllm.kernels.selfcheck import start_up_check
    t0 = time.perf_counter()
    report = start_up_check(model, numerics, device, dtype, max_tokens=self_check_tokens, kernels=spec.kernels)
    if report is not None:
        logger.info("%s numerics self-check passed in %.2f s", numerics, time.perf_counter() - t0)
    if parallel.leaves is not None:
        # tensor parallelism in this process (all ranks on this device), or the K-leaf tree at TP=1
        from vllm.parallel.tensor_parallel import apply_tensor_parallel
        apply_tensor_parallel(model, parallel.tensor_parallel_size, leaves=parallel.leaves)
    return model, report
