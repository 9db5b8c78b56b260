"""In-place weight updates for a running engine (the trainer -> rollout sync).

Everything is validated before anything is written (names, shapes, dtypes,
finiteness, complete coverage of fused shards, and the trainer's execution
contract when given), so a rejected update leaves the engine serving the old
weights. Accepted tensors are copied INTO the existing parameters: storage
addresses do not change, so captured CUDA graphs keep reading the right
memory. The engine's weight version is bumped and its prefix cache dropped.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch


def plan_update(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], require_complete: bool = False):
    """Validate HF-named tensors against the model's own mapping (`model.weight_mapping()`,
    the one loading uses) and return the (destination view, source) pairs to copy.
    Raises ValueError on any problem; nothing is written here."""
    planner = model.weight_mapping().planner(exact_dtype=True, check_finite=True)
    plan = [w for name, tensor in weights if (w := planner.add(name, tensor)) is not None]
    plan += planner.finish()
    if require_complete:
        missing = planner.missing()
        if missing:
            raise ValueError(f"incomplete update: missing {missing[:6]}")
    return plan


def _as_pairs(weights) -> list[tuple[str, torch.Tensor]]:
    """A mapping or an iterable of (name, tensor) pairs, as a list; anything else is a
    ValueError that says what was given (not an unpacking error from deep inside)."""
    if isinstance(weights, Mapping):
        return list(weights.items())
    expected = "weights must be a mapping {HF name: tensor} or an iterable of (HF name, tensor) pairs"
    if torch.is_tensor(weights) or isinstance(weights, (str, bytes)):
        raise ValueError(f"{expected}, got a {type(weights).__name__}")
    try:
        items = list(weights)
    except TypeError:
        raise ValueError(f"{expected}, got {type(weights).__name__}") from None
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"{expected}; item {i} is a {type(item).__name__}"
                             + (" (a list of tensors has no names: pass model.hf_state_dict() or zip(names, tensors))"
                                if torch.is_tensor(item) else ""))
    return [(name, tensor) for name, tensor in items]


def update_weights(engine, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   contract=None, require_complete: bool = False) -> int:
    """Copy `weights` (HF names) into the engine's model in place; returns the new weight version.

    `contract`: the trainer's ExecutionContract; refused unless compatible with the
    engine's. `require_complete`: every parameter (every fused shard) must be given.
    Must be called while no request is running, or while the engine is paused (the
    paused requests then continue under the new weights); the engine refuses otherwise.
    """
    engine.drain()
    if engine.has_unfinished_requests() and not engine.paused:
        raise ValueError("weights can only be updated while no request is running (or the engine is paused)")
    pairs = _as_pairs(weights)
    model = engine.runner.model
    if contract is not None:
        engine.execution_contract().check_compatible(contract)  # ValueError names the differing keys
    plan = plan_update(model, pairs, require_complete)
    if any(src.is_cuda for _, src in plan):
        torch.cuda.synchronize()  # the trainer may have written the sources on another stream
    with torch.no_grad():
        for dest, src in plan:
            dest.copy_(src.to(dest.device), non_blocking=True)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)
    engine.on_weights_updated()
    return engine.weight_version
