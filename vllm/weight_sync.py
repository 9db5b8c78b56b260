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

from vllm.layers.linear import FusedLinear


def _plan(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]):
    """Map HF-named tensors to (destination view, source) pairs; raise ValueError on any problem.

    Returns (plan, covered) where covered holds (parameter name, shard id or None) keys."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    tied = getattr(model.config, "tie_word_embeddings", False)
    plan, covered, names = [], set(), set()
    tied_head = embed = None
    for hf_name, tensor in weights:
        if hf_name in names:
            raise ValueError(f"weight {hf_name!r} given twice")
        names.add(hf_name)
        if not torch.is_tensor(tensor):
            raise ValueError(f"weight {hf_name!r} is not a tensor")
        if "rotary_emb.inv_freq" in hf_name:
            continue  # derived from the config, as in load_weights
        name, shard = model.resolve_hf_name(hf_name)
        if tied and hf_name == "lm_head.weight":
            # one tensor in our model: validated like any other, written as the embedding
            name = "model.embed_tokens.weight"
        if name not in params:
            raise ValueError(f"unknown weight {hf_name!r}")
        param = params[name]
        mod = modules[name.rsplit(".", 1)[0]]
        if shard is None:
            dest = param.data
        elif isinstance(mod, FusedLinear):
            off, size = mod.shard_offsets[shard]
            dest = param.data.narrow(0, off, size)
        else:  # other fused layouts (MoE experts) name their own slices
            dest = mod.shard_view(param.data, shard)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"weight {hf_name!r}: shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
        if tensor.dtype != dest.dtype:
            raise ValueError(f"weight {hf_name!r}: dtype {tensor.dtype} != the engine's {dest.dtype} "
                             "(sync the exact bits the trainer's forward used)")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"weight {hf_name!r} has non-finite values")
        if tied and hf_name == "lm_head.weight":
            tied_head = tensor
            continue
        if tied and name == "model.embed_tokens.weight":
            embed = tensor
        # a fused parameter given whole (our own name) covers every shard
        keys = _param_keys(name, mod) if shard is None else [(name, shard)]
        if covered.intersection(keys):
            raise ValueError(f"weight {hf_name!r} overlaps another tensor of this update")
        covered.update(keys)
        plan.append((dest, tensor))
    if tied_head is not None:
        if embed is None:
            plan.append((params["model.embed_tokens.weight"].data, tied_head))
            covered.add(("model.embed_tokens.weight", None))
        elif not torch.equal(tied_head.detach().cpu().contiguous().view(torch.uint8),
                             embed.detach().cpu().contiguous().view(torch.uint8)):  # bit patterns
            raise ValueError("tied embeddings: 'lm_head.weight' differs from 'model.embed_tokens.weight'")
    return plan, covered


def _param_keys(name: str, mod: torch.nn.Module) -> list:
    """(parameter name, shard id) keys that one whole parameter covers."""
    if isinstance(mod, FusedLinear):
        return [(name, sid) for sid in mod.shard_offsets]
    if hasattr(mod, "shard_ids"):  # MoE experts: one shard per (expert, projection)
        return [(name, sid) for sid in mod.shard_ids(name.rsplit(".", 1)[1])]
    return [(name, None)]


def _all_keys(model: torch.nn.Module) -> set:
    keys = set()
    modules = dict(model.named_modules())
    for name, _ in model.named_parameters():
        keys.update(_param_keys(name, modules[name.rsplit(".", 1)[0]]))
    return keys


def update_weights(engine, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   contract=None, require_complete: bool = False) -> int:
    """Copy `weights` (HF names) into the engine's model in place; returns the new weight version.

    `contract`: the trainer's ExecutionContract; refused unless compatible with the
    engine's. `require_complete`: every parameter (every fused shard) must be given.
    Must be called while no request is running (the engine refuses otherwise).
    """
    from vllm.contract import build_contract

    engine.drain()
    if engine.has_unfinished_requests():
        raise ValueError("weights can only be updated while no request is running")
    pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    model = engine.runner.model
    if contract is not None:
        ours = build_contract(engine.config, model)
        ours.check_compatible(contract)  # ValueError names the differing keys
    plan, seen = _plan(model, pairs)
    if require_complete:
        missing = _all_keys(model) - seen
        if missing:
            raise ValueError(f"incomplete update: missing {sorted(f'{n}[{k}]' if k is not None else n for n, k in missing)[:6]}")
    if any(src.is_cuda for _, src in plan):
        torch.cuda.synchronize()  # the trainer may have written the sources on another stream
    with torch.no_grad():
        for dest, src in plan:
            dest.copy_(src.to(dest.device), non_blocking=True)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)
    engine.on_weights_updated()
    return engine.weight_version

