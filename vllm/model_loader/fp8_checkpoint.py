"""FP8-quantized HF checkpoints (`quantization_config: {quant_method: fp8, weight_block_size:
[128, 128]}`: float8_e4m3fn weights with a float32 `weight_scale_inv` per 128 x 128 block,
w = weight * weight_scale_inv).

Loading keeps the master weight (the dequantized value, in the model dtype, what a trainer
updates); every FP8 layer's fp8 copy is the master quantized by the deployment rule, on
both sides, at load and after every weight change. So the copy is always a function of
the master: an engine and a trainer (with or without masters, after partial or whole
updates) quantize the same values into the same bits. Where the checkpoint's own bits and
scales are what the rule gives for the master (a checkpoint quantized by amax / 448 per
block from weights in the model dtype), that is exactly the published quantized model;
elsewhere (power-of-two scales, weights quantized from float32 and loaded in bfloat16) the
served fp8 weights are the master re-quantized, and the load logs how many tensors differ.
Modules the config lists in `modules_to_not_convert` (or `ignored_layers`) stay in the
model dtype."""
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
    unquantized_modules(hf_config)   # a malformed list is refused here
    return "fp8"


def unquantized_modules(hf_config: dict) -> list[str]:
    """The module names an FP8 checkpoint keeps in the model dtype (`modules_to_not_convert`,
    or upstream vLLM's `ignored_layers`): a module whose HF name contains one stays unquantized,
    as transformers matches them."""
    qc = hf_config.get("quantization_config") or {}
    names = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        value = qc.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"fp8 checkpoint {key} must be a list of module names, got {value!r}")
        names += value
    return sorted(set(names))


def unquantized_linears(model: torch.nn.Module, patterns: list[str]) -> set[str]:
    """Our names of the Linear modules whose HF weights match `patterns` (unquantized_modules).
    ValueError for a fused layer only some of whose shards match: one layer has one dtype."""
    from vllm.layers.linear import Linear
    if not patterns:
        return set()
    modules = dict(model.named_modules())
    matched: dict[str, set[bool]] = {}
    for hf_name, slot in model.weight_mapping().slots.items():
        owner = slot.param.rsplit(".", 1)[0]
        if not isinstance(modules.get(owner), Linear) or not slot.param.endswith(".weight"):
            continue
        module = hf_name.rsplit(".", 1)[0]
        matched.setdefault(owner, set()).add(any(p in module for p in patterns))
    mixed = sorted(m for m, v in matched.items() if len(v) > 1)
    if mixed:
        raise ValueError(f"modules_to_not_convert names some shards of fused layers {mixed[:4]} but not the others "
                         "(a fused layer is quantized as a whole)")
    return {m for m, v in matched.items() if v == {True}}


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
            elif t.dtype.is_floating_point and t.element_size() == 1:
                raise ValueError(f"{name}: {t.dtype} weights are not read (fp8 checkpoints hold float8_e4m3fn)")
            elif name.endswith((".input_scale", ".activation_scale")):
                continue  # static activation scales: not used (dynamic per-token scaling)
            else:
                yield name, t
        missing = sorted(set(self.fp8) - set(self.scales))
        if missing:
            raise ValueError(f"fp8 weights without weight_scale_inv: {missing[:4]}")
        orphans = sorted(set(self.scales) - set(self.fp8))
        if orphans:
            raise ValueError(f"weight_scale_inv without an fp8 weight (the weight would load unscaled): "
                             f"{[o + '_scale_inv' for o in orphans[:4]]}")
        for name, t in self.fp8.items():
            yield name, dequantize_weight(t, self.scales[name], torch.float32)

    def compare(self, model: torch.nn.Module) -> tuple[int, int]:
        """(tensors whose fp8 copy, quantized from the master, has the checkpoint's own bits
        and scales, tensors compared): what the load reports. Fused shards are compared
        where they line up with the 128-row blocks; modules left unquantized are skipped."""
        from vllm.layers.linear import FusedLinear, Linear
        mapping = model.weight_mapping()
        modules = dict(model.named_modules())
        same = compared = 0
        for name, t in self.fp8.items():
            slot = mapping.slot(name)
            mod = modules.get(slot.param.rsplit(".", 1)[0])
            if not isinstance(mod, Linear) or not mod.fp8 or not slot.param.endswith(".weight"):
                continue
            n = mod.out_features
            off, size = (0, n) if slot.shard is None or not isinstance(mod, FusedLinear) \
                else mod.shard_offsets[slot.shard]
            if off % BLOCK or (size % BLOCK and off + size != n) or t.shape != (size, mod.in_features):
                continue
            compared += 1
            s = self.scales[name]
            rows = slot.view(mod.weight_fp8)
            same += int(torch.equal(rows.cpu().view(torch.uint8), t.view(torch.uint8)) and torch.equal(
                mod.weight_scale_inv[off // BLOCK:off // BLOCK + s.shape[0]].cpu(), s))
        return same, compared
