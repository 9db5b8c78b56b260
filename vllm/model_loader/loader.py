"""Read an HF checkpoint directory (one or many safetensors files) into a built model,
through the model's own HF-name mapping (`model.weight_mapping()`)."""
from __future__ import annotations

import glob
import json
import os
from typing import Iterable, Iterator

import torch
from safetensors import safe_open


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ValueError(f"checkpoint {path!r}: index names missing shard file(s) {missing}")
        return [os.path.join(path, f) for f in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"checkpoint {path!r} has no *.safetensors files (pickled .bin checkpoints are not loaded: convert them)")
    return files


def iterate_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place (benchmarks on real dimensions without writing a checkpoint):
    matrices ~ N(0, std), norm weights ~ 1 + N(0, 0.1), biases ~ N(0, std). Drawn on the
    parameter's own device, in chunks, so an 8B model initialises in seconds on a GPU."""
    gens: dict = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            flat = p.view(-1)
            step = 1 << 26
            for i in range(0, flat.numel(), step):
                n = min(step, flat.numel() - i)
                vals = torch.randn(n, generator=gen, device=p.device)
                vals = 1.0 + 0.1 * vals if "norm" in name else vals * std
                flat[i:i + n].copy_(vals)


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter of `model` from HF-named tensors, converted to the parameter's
    dtype and written as they come (a checkpoint is streamed, never held whole).
    ValueError for unknown names, wrong shapes, tied tensors that differ, or anything missing."""
    planner = model.weight_mapping().planner(exact_dtype=False, check_finite=False)
    with torch.no_grad():
        for name, tensor in weights:
            write = planner.add(name, tensor)
            if write is not None:
                write[0].copy_(write[1])
        for dest, src in planner.finish():
            dest.copy_(src)
    missing = planner.missing()
    if missing:
        raise ValueError(f"lacks weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    # FP8 layers multiply their quantized copy: the writes above go through views whose version
    # counters are not the parameters', so the forward's change check cannot see them
    from vllm.layers.linear import fp8_linears
    for layer in fp8_linears(model):
        layer.requantize()
