"""Load an HF checkpoint directory (one or many safetensors files) into our model class."""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

from vllm.config import ModelConfig
from vllm.models.registry import model_class


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


def iterate_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
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


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, load_format: str = "safetensors") -> torch.nn.Module:
    cls = model_class(cfg.architecture)
    with torch.device(device):
        model = cls(cfg, dtype=dtype)
    if load_format == "dummy":
        init_dummy_weights(model)
        return model.eval()
    if load_format != "safetensors":
        raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {load_format!r}")
    loaded = model.load_weights(iterate_weights(cfg.path))
    missing = model.expected_weight_keys() - loaded
    if missing:
        raise ValueError(f"checkpoint {cfg.path!r} lacks weights for: {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")
    model.eval()
    return model
