"""HF checkpoint names <-> model parameters, declared once by each model.

A model's `weight_mapping()` lists, for every tensor name of its HF checkpoint,
the `WeightSlot` it lives in: a parameter, or one shard of a fused parameter
(q/k/v rows of a fused qkv projection, one expert of a stacked MoE weight ...).
Everything that moves weights reads that one declaration:

- loading a checkpoint (`vllm.model_loader.loader.load_weights`), tensor by tensor;
- in-place weight sync (`vllm.weight_sync`), validated as a whole before any write;
- `hf_state_dict` (the inverse: save_pretrained, gradients under HF names).

Nothing here knows an architecture: names, shards and aliases come from the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

import torch
from torch import nn

Key = tuple  # (parameter name, shard id or None): what one slot covers


@dataclass(frozen=True)
class WeightSlot:
    """Where one HF tensor lives: parameter `param`, or its shard `shard` (`select` gives
    that shard's view of any tensor shaped like the parameter: its data or its grad)."""
    param: str
    shard: Hashable | None = None
    select: Callable[[torch.Tensor], torch.Tensor] | None = None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.select is None else self.select(tensor)


def _key_name(key: Key) -> str:
    name, shard = key
    return name if shard is None else f"{name}[{shard}]"


class WeightMapping:
    """`slots`: HF name -> WeightSlot for every tensor the checkpoint holds, in the order
    `state_dict` writes them. `aliases`: HF names accepted on input as another spelling of
    a slot's tensor (a tied lm_head is the embedding); given together, both must hold the
    same bits. `derived`: name fragments of tensors computed from the config (skipped).
    A fused parameter may also be given whole under our own parameter name: it then
    covers all its shards."""

    def __init__(self, model: nn.Module, slots: dict[str, WeightSlot], *,
                 aliases: dict[str, str] | None = None, derived: Iterable[str] = ()):
        self.model = model
        self.slots = dict(slots)
        self.aliases = dict(aliases or {})
        self.derived = tuple(derived)
        self.params = dict(model.named_parameters())
        self._views: dict[str, tuple[int, torch.Tensor]] = {}   # HF name -> (param address, its view)
        self.shards: dict[str, list] = {}
        for hf_name, slot in self.slots.items():
            if slot.param not in self.params:
                raise ValueError(f"{type(model).__name__}: slot {hf_name!r} names no parameter {slot.param!r}")
            if slot.shard is not None:
                self.shards.setdefault(slot.param, []).append(slot.shard)
        for alias, target in self.aliases.items():
            if target not in self.slots:
                raise ValueError(f"{type(model).__name__}: alias {alias!r} names no slot {target!r}")

    # ---- names -------------------------------------------------------------------------
    def is_derived(self, hf_name: str) -> bool:
        """Whether the checkpoint tensor is one the model does not take (recomputed, or a part it
        does not run). A fragment matches whole dotted components: "rotary_emb.inv_freq" the
        name's last components, "mtp." (ending in a dot) a leading run of them, so a name that
        only contains the text ("...inv_freq_garbage") is not skipped silently."""
        for frag in self.derived:
            if frag.endswith("."):
                if hf_name.startswith(frag) or f".{frag}" in hf_name:
                    return True
            elif hf_name == frag or hf_name.endswith(f".{frag}"):
                return True
        return False

    def slot(self, name: str) -> WeightSlot:
        """The slot of an HF name (or of our own name of a whole parameter); ValueError if none."""
        if name in self.slots:
            return self.slots[name]
        if name in self.aliases:
            return self.slots[self.aliases[name]]
        if name in self.params:
            return WeightSlot(name)
        raise ValueError(f"unknown weight {name!r}: no parameter of {type(self.model).__name__} takes it")

    def covers(self, slot: WeightSlot) -> list[Key]:
        if slot.shard is None and slot.param in self.shards:
            return [(slot.param, sid) for sid in self.shards[slot.param]]
        return [(slot.param, slot.shard)]

    def keys(self) -> set[Key]:
        """Everything a complete set of weights covers."""
        return {(s.param, s.shard) for s in self.slots.values()}

    def destination(self, slot: WeightSlot):
        """The parameter memory `slot` writes (a view: in place, storage unchanged), or for
        an FP8 layer that dropped its master weight, the `QuantizedRows` it covers. A view of
        `p.detach()`, not of `p.data`: it shares the parameter's version counter, so a write
        makes a graph built on the old values raise in backward (torch's in-place check)
        instead of mixing old activations with new weights."""
        p = self.params[slot.param]
        if p.is_meta:
            return self.model.get_submodule(slot.param.rpartition(".")[0]).quantized_rows(slot.view(p.data))
        return slot.view(p.detach())

    def destination_of(self, hf_name: str, slot: WeightSlot) -> torch.Tensor:
        """`destination(slot)`, kept per name while the parameter's memory stays where it
        was (weight sync asks for every tensor on every update)."""
        ptr = self.params[slot.param].data_ptr()
        hit = self._views.get(hf_name)
        if hit is None or hit[0] != ptr:
            hit = self._views[hf_name] = (ptr, self.destination(slot))
        return hit[1]

    # ---- the inverse -------------------------------------------------------------------
    def state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Our parameters (or their .grad with grads=True, skipping parameters without one)
        under HF names, fused parameters split back into their shards; aliases left out."""
        out: dict[str, torch.Tensor] = {}
        for hf_name, slot in self.slots.items():
            p = self.params[slot.param]
            if p.is_meta:
                raise ValueError(f"{slot.param} has no master weight (keep_master_weights=False): only its FP8 "
                                 "copy exists, so there is no model-dtype state dict to give")
            src = p.grad if grads else p
            if src is None:
                continue
            out[hf_name] = slot.view(src.detach())
        return out

    def planner(self, *, exact_dtype: bool, check_finite: bool) -> "WeightPlanner":
        return WeightPlanner(self, exact_dtype=exact_dtype, check_finite=check_finite)


class WeightPlanner:
    """Validates HF-named tensors one at a time against a mapping and says where each goes.

    `add` returns (destination view, source) or None (a derived tensor, or an alias held
    until `finish`); `finish` resolves aliases. Checks: known name, given once, no two
    tensors covering the same shard, shape, dtype (`exact_dtype`: must equal the
    parameter's, else converted), finiteness (`check_finite`), aliases agreeing bit for
    bit. Loading writes as it goes (a checkpoint is streamed); weight sync plans
    everything first and writes only if nothing raised."""

    def __init__(self, mapping: WeightMapping, *, exact_dtype: bool, check_finite: bool):
        self.mapping = mapping
        self.exact_dtype = exact_dtype
        self.check_finite = check_finite
        self.names: set[str] = set()
        self.covered: set[Key] = set()
        self._alias_targets = set(mapping.aliases.values())
        self._aliased: dict[str, tuple[str, torch.Tensor]] = {}   # target slot -> (alias name, tensor)
        self._targets: dict[str, torch.Tensor] = {}                # sources given for slots that have an alias
        # a caller that reuses the sources' memory after `add` (a receive buffer written through
        # bucket by bucket) sets this: the tensors held until `finish` are then copies
        self.copy_held = False

    def add(self, hf_name: str, tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        m = self.mapping
        if hf_name in self.names:
            raise ValueError(f"weight {hf_name!r} given twice")
        self.names.add(hf_name)
        if not torch.is_tensor(tensor):
            raise ValueError(f"weight {hf_name!r} is not a tensor (got {type(tensor).__name__})")
        if tensor.layout != torch.strided:
            raise ValueError(f"weight {hf_name!r} has layout {tensor.layout}: give a dense tensor (.to_dense())")
        if m.is_derived(hf_name):
            return None
        slot = m.slot(hf_name)
        dest = m.destination_of(hf_name, slot)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"weight {hf_name!r}: shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
        if self.exact_dtype and tensor.dtype != dest.dtype:
            raise ValueError(f"weight {hf_name!r}: dtype {tensor.dtype} != the model's {dest.dtype} "
                             "(sync the exact bits the trainer's forward used)")
        if self.check_finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"weight {hf_name!r} has non-finite values")
        if hf_name in m.aliases:
            self._aliased[m.aliases[hf_name]] = (hf_name, tensor.clone() if self.copy_held else tensor)
            return None
        if hf_name in self._alias_targets:
            self._targets[hf_name] = tensor.clone() if self.copy_held else tensor
        self._cover(hf_name, slot)
        return dest, tensor if tensor.dtype == dest.dtype else tensor.to(dest.dtype)

    def finish(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Writes still owed for aliases whose slot was not given under its own name (their
        names, in the same order, in `alias_writes`)."""
        m = self.mapping
        writes = []
        self.alias_writes: list[str] = []
        for target, (alias, tensor) in self._aliased.items():
            dest = m.destination(m.slots[target])
            tensor = tensor if tensor.dtype == dest.dtype else tensor.to(dest.dtype)
            if target in self._targets:
                given = self._targets[target]
                given = given if given.dtype == dest.dtype else given.to(dest.dtype)
                if not torch.equal(_bytes(tensor), _bytes(given)):  # bit patterns, not values
                    raise ValueError(f"{alias!r} differs from {target!r}, which it is tied to")
                continue
            self._cover(alias, m.slots[target])
            writes.append((dest, tensor))
            self.alias_writes.append(alias)
        return writes

    def missing(self) -> list[str]:
        """Slots not covered so far, as `name` or `name[shard]`; a slot whose tied alias was
        given counts as covered (finish writes it from the alias, or checks the two agree)."""
        covered = set(self.covered)
        for target in self._aliased:
            covered.update(self.mapping.covers(self.mapping.slots[target]))
        return sorted(_key_name(k) for k in self.mapping.keys() - covered)

    def _cover(self, hf_name: str, slot: WeightSlot) -> None:
        keys = self.mapping.covers(slot)
        if self.covered.intersection(keys):
            raise ValueError(f"weight {hf_name!r} overlaps another tensor of this update")
        self.covered.update(keys)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)
