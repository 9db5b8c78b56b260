"""FP8-quantized HF checkpoints (`quantization_config: {quant_method: fp8, weight_block_size:
[128, 128]}`: float8_e4m3fn weights with a float32 `weight_scale_inv` per 128 x 128 block,
w = weight * weight_scale_inv).

Loading keeps two things: the master weight (the dequantized value, in the model dtype,
what a trainer updates) and, for every linear layer whose checkpoint shards line up with the
128-row blocks of its fused weight, the checkpoint's own fp8 bits and scales as the layer's
fp8 copy, so the first weight version serves exactly the published quantized model. Layers
that do not line up (and tensors of modules that stay unquantized, e.g. MoE experts) keep
the re-quantized master."""
from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch

from vllm.kernels.fp8 import BLOCK, FP8_DTYPE, dequantize_weight

logger = logging.getLogger(__name__)


def checkpoint_quantization(hf_config: dict) -> str | None:
    """"fp8" for a block-scaled FP8 checkpoint, None for an unquantized one; ValueError for a
    quantization this engine does not read."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"checkpoint quantization {method!r} is not supported (only fp8 with 128x128 blocks)")
    block = qc.get("weight_block_size")
    if list(block or []) != [BLOCK, BLOCK]:
        raise ValueError(f"fp8 checkpoint weight_block_size {block!r} is not supported (only [128, 128])")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError("fp8 checkpoint activation_scheme must be 'dynamic' (per-token scales computed at run time)")
    return "fp8"


class FP8CheckpointReader:
    """Wraps a checkpoint's (name, tensor) stream: fp8 weights come out dequantized (float32)
    for the master weights, and are remembered with their scales for `apply`."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]):
        self.weights = weights
        self.fp8: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.weights:
            if name.endswith(".weight_scale_inv"):
                self.scales[name[:-len("_scale_inv")]] = t.float()
            elif t.dtype == FP8_DTYPE:
                self.fp8[name] = t
            elif name.endswith((".input_scale", ".activation_scale")):
                continue  # static activation scales: not used (dynamic per-token scaling)
            else:
                yield name, t
        missing = sorted(set(self.fp8) - set(self.scales))
        if missing:
            raise ValueError(f"fp8 weights without weight_scale_inv: {missing[:4]}")
        for name, t in self.fp8.items():
            yield name, dequantize_weight(t, self.scales[name], torch.float32)

    def apply(self, model: torch.nn.Module) -> int:
        """Write the checkpoint's fp8 bits into the layers' fp8 copies where the blocks line
        up; returns how many tensors were taken as they are."""
        from vllm.layers.linear import FusedLinear, Linear
        mapping = model.weight_mapping()
        modules = dict(model.named_modules())
        taken = 0
        with torch.no_grad():
            for name, t in self.fp8.items():
                slot = mapping.slot(name)
                mod = modules.get(slot.param.rsplit(".", 1)[0])
                if not isinstance(mod, Linear) or not mod.fp8 or not slot.param.endswith(".weight"):
                    continue
                n = mod.out_features
                off, size = (0, n) if slot.shard is None or not isinstance(mod, FusedLinear) \
                    else mod.shard_offsets[slot.shard]
                if off % BLOCK or (size % BLOCK and off + size != n) or t.shape != (size, mod.in_features):
                    logger.info("fp8 checkpoint: %s does not line up with 128-row blocks; re-quantized", name)
                    continue
                slot.view(mod.weight_fp8).copy_(t.to(mod.weight_fp8.device))
                s = self.scales[name]
                mod.weight_scale_inv[off // BLOCK:off // BLOCK + s.shape[0]].copy_(s.to(mod.weight_scale_inv.device))
                taken += 1
        return taken
