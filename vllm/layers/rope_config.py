"""A rope's configuration read from an HF config.json: its theta and scaling, and the
longest context it covers. Plain Python (no torch), so the engine's config reads it too."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RopeScaling:
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_from_hf(hf: dict) -> tuple[float, RopeScaling]:
    """(theta, scaling) from an HF config.json. transformers 4.x writes `rope_theta` +
    `rope_scaling`; 5.x folds both into `rope_parameters`: both spellings are read."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    src = scaling or params
    rope_type = src.get("rope_type", src.get("type", "default")) if src else "default"
    if rope_type not in ("default", "llama3", "linear"):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3)")
    rs = RopeScaling(rope_type=rope_type)
    if rope_type != "default":
        rs.factor = float(src.get("factor", 1.0))
        rs.low_freq_factor = float(src.get("low_freq_factor", 1.0))
        rs.high_freq_factor = float(src.get("high_freq_factor", 4.0))
        rs.original_max_position_embeddings = int(src.get("original_max_position_embeddings", 8192))
    return float(theta), rs


def positions_covered(max_position_embeddings: int, scaling: RopeScaling) -> int:
    """The longest context the rope covers: linear scaling stretches the trained positions by
    its factor (a 4,096-position model with factor 4 serves 16,384, as upstream derives its
    max length); llama3's config already names its longer length."""
    if scaling.rope_type == "linear":
        return int(max_position_embeddings * scaling.factor)
    return max_position_embeddings
