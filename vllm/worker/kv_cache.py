"""The worker's caches, sized and allocated from the caches the model's layers declare.

Each stateful layer declares what it needs (`cache_spec(numerics)`, vllm/layers/cache_spec.py):
a `PagedKVSpec` for paged attention, a `RecurrentStateSpec` for a recurrent layer's
per-sequence state. The engine's `KVFormat` says how a paged K/V is stored (the model dtype,
or FP8 with per-token-per-head scales and a model-dtype read copy). This module turns the
specs into bytes (per KV block, what the memory budget divides by, and per state slot, a
fixed reservation taken first), allocates every tensor (plain allocations, or one driver VMM
region in sleep mode so that waking maps new pages at the same addresses and captured CUDA
graphs stay valid), releases and restores them for sleep mode, copies state slots for
prefix-cache snapshots, and hands the attention and state backends their tensors.

State slot 0, like KV block 0, is the null slot: padding rows of a CUDA graph write there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm.forward_context import StateBackend, StateMetadata
from vllm.host_copy import to_device
from vllm.layers.cache_spec import PagedKVSpec, RecurrentStateSpec
from vllm.worker.attention_backend import PagedAttentionBackend
from vllm.worker.kv_format import KVFormat

logger = logging.getLogger(__name__)

NULL_STATE_SLOT = 0


@dataclass(frozen=True)
class CacheSpecs:
    """What the model's layers declare, each kind in its layers' index order."""
    paged: list[PagedKVSpec]
    recurrent: list[RecurrentStateSpec]

    @property
    def state_chunk_size(self) -> int | None:
        """The grid every recurrent state is defined on (None without recurrent layers)."""
        sizes = {s.chunk_size for s in self.recurrent}
        if len(sizes) > 1:
            raise ValueError(f"recurrent layers declare different chunk sizes {sorted(sizes)}: one grid is supported")
        return sizes.pop() if sizes else None


def _in_index_order(specs: list, what: str) -> list:
    specs = sorted(specs, key=lambda s: s.layer_idx)
    if [s.layer_idx for s in specs] != list(range(len(specs))):
        raise ValueError(f"layers declare {what} for indices {[s.layer_idx for s in specs]}: expected 0..{len(specs) - 1}")
    return specs


def cache_specs(model: nn.Module, numerics: str = "invariant") -> CacheSpecs:
    """The caches the model's layers declare for `numerics`, by kind and layer index (0, 1,
    ... without gaps within a kind: each backend addresses a layer's cache by its index)."""
    declared = [m.cache_spec(numerics) for m in model.modules() if hasattr(m, "cache_spec")]
    unknown = sorted({type(s).__name__ for s in declared if not isinstance(s, (PagedKVSpec, RecurrentStateSpec))})
    if unknown:
        raise ValueError(f"unsupported cache specs: {unknown}")
    return CacheSpecs(_in_index_order([s for s in declared if isinstance(s, PagedKVSpec)], "paged KV caches"),
                      _in_index_order([s for s in declared if isinstance(s, RecurrentStateSpec)], "recurrent states"))


def _shapes(specs: list[PagedKVSpec]) -> list[tuple[int, int]]:
    """The distinct (kv heads, head_dim) of the layers: one FP8 read copy each."""
    return sorted({(s.num_kv_heads, s.head_dim) for s in specs})


def bytes_per_block(specs: list[PagedKVSpec], fmt: KVFormat, block_size: int) -> int:
    """K and V of every layer for one block of `block_size` tokens, FP8 scales and read
    copies included."""
    per_layer = sum(fmt.payload_bytes(1, block_size, s.num_kv_heads, s.head_dim)
                    + fmt.scale_bytes(1, block_size, s.num_kv_heads) for s in specs)
    copies = sum(fmt.dequant_bytes(1, block_size, h, d) for h, d in _shapes(specs))
    return 2 * (per_layer + copies)


def state_bytes(specs: list[RecurrentStateSpec], model_dtype: torch.dtype, num_slots: int, num_snapshots: int) -> int:
    """Every recurrent layer's state: `num_slots` whole slots (running sequences and the null
    slot) and `num_snapshots` prefix-cache snapshots (only the tensors each layer names in its
    `snapshot`)."""
    total = 0
    for s in specs:
        for t in s.tensors:
            total += t.nbytes(model_dtype) * (num_slots + (num_snapshots if t.name in s.snapshot else 0))
    return total


@dataclass(eq=False)
class LayerCaches:
    """Paged KV: per attention layer a K and a V payload [num_blocks, block_size, kv heads,
    head_dim]; for an FP8 cache also their float32 scales [num_blocks, block_size, kv heads]
    and, per distinct layer shape, one model-dtype (k, v) copy every read dequantizes into.
    Recurrent states: per recurrent layer and declared tensor, [num_slots + num_snapshots,
    *shape] for the tensors of a snapshot, [num_slots, *shape] for the others: slot 0 is
    the null slot, 1 .. num_slots - 1 hold running sequences, num_slots .. the snapshots."""
    fmt: KVFormat
    num_blocks: int
    block_size: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scales: list[torch.Tensor] | None
    v_scales: list[torch.Tensor] | None
    dequant: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None
    state_specs: list[RecurrentStateSpec] = field(default_factory=list)
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    num_slots: int = 0
    num_snapshots: int = 0
    region: object = None  # the VMM region the tensors view (sleep mode on CUDA), else None
    sleeping: bool = False

    @classmethod
    def allocate(cls, specs: list[PagedKVSpec], fmt: KVFormat, num_blocks: int, block_size: int,
                 device: torch.device, vmm: bool = False, state_specs: list[RecurrentStateSpec] = (),
                 num_slots: int = 0, num_snapshots: int = 0) -> "LayerCaches":
        """Zero payloads and states, unit scales. `vmm`: one driver VMM region (falls back to
        plain allocations, with a warning, where the driver API is unavailable)."""
        # (shape, dtype, fill) of every tensor, in one order for both allocators
        pieces = []
        for s in specs:
            shape = (num_blocks, block_size, s.num_kv_heads, s.head_dim)
            for _ in "kv":
                pieces.append((shape, fmt.dtype, 0.0))
                if fmt.fp8:
                    pieces.append((shape[:3], torch.float32, 1.0))
        copies = _shapes(specs) if fmt.fp8 else []
        for h, d in copies:
            pieces += [((num_blocks, block_size, h, d), fmt.model_dtype, 0.0)] * 2
        state_specs = list(state_specs)
        for st in state_specs:
            pieces += [((num_slots + (num_snapshots if t.name in st.snapshot else 0), *t.shape),
                        t.dtype or fmt.model_dtype, 0.0) for t in st.tensors]
        region = None
        tensors = None
        if vmm and device.type == "cuda":
            try:
                region, tensors = _vmm_tensors(pieces, device)
            except (ImportError, RuntimeError, OSError) as err:
                # still correct, only slower to wake: the caches come back at new addresses
                # and the runner re-captures its CUDA graphs
                logger.warning("sleep mode: driver VMM unavailable (%s); waking will re-capture CUDA graphs", err)
        if tensors is None:
            tensors = [torch.full(shape, fill, dtype=dt, device=device) for shape, dt, fill in pieces]
        per = 4 if fmt.fp8 else 2  # tensors per layer: k (+ scales), v (+ scales)
        layers = [tensors[i * per:(i + 1) * per] for i in range(len(specs))]
        rest = tensors[len(specs) * per:]
        tail, rest = rest[:2 * len(copies)], rest[2 * len(copies):]
        if fmt.fp8:
            k, ks, v, vs = ([t[j] for t in layers] for j in range(4))
            dequant = {shape: (tail[2 * i], tail[2 * i + 1]) for i, shape in enumerate(copies)}
        else:
            k, v = [t[0] for t in layers], [t[1] for t in layers]
            ks = vs = dequant = None
        states = []
        for st in state_specs:
            states.append({t.name: rest.pop(0) for t in st.tensors})
        return cls(fmt, num_blocks, block_size, k, v, ks, vs, dequant, state_specs, states, num_slots, num_snapshots,
                   region)

    # ---- what the rest of the worker reads ---------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        return (self.k + self.v + (self.k_scales or []) + (self.v_scales or [])
                + [t for pair in (self.dequant or {}).values() for t in pair]
                + [t for layer in self.states for t in layer.values()])

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a captured graph reads, by name (for the graph-pointer table)."""
        out = {f"kv:k{i}": c for i, c in enumerate(self.k)}
        out.update({f"kv:v{i}": c for i, c in enumerate(self.v)})
        for (h, d), (kd, vd) in (self.dequant or {}).items():
            out[f"kv:dequant_k_{h}x{d}"], out[f"kv:dequant_v_{h}x{d}"] = kd, vd
        for i, layer in enumerate(self.states):
            out.update({f"state:{i}:{name}": t for name, t in layer.items()})
        return out

    def backend(self) -> PagedAttentionBackend:
        copies = None
        if self.dequant is not None:
            copies = [self.dequant[(c.shape[2], c.shape[3])] for c in self.k]
        return PagedAttentionBackend(self.k, self.v, self.k_scales, self.v_scales, copies)

    def state_backend(self, metadata: StateMetadata) -> StateBackend | None:
        """The recurrent layers' view of one step (None for a model without them)."""
        if not self.state_specs:
            return None
        return StateBackend(metadata, self.states)

    def copy_state_slots(self, src: list[int], dst: list[int], snapshot_only: bool = True) -> None:
        """state[dst[i]] = state[src[i]] for every recurrent layer: restoring a prefix-cache
        snapshot into a sequence's slot, or taking one (`snapshot_only`: the tensors that
        describe a state at a chunk boundary, as each layer declared)."""
        if not src:
            return
        dev = self.states[0][next(iter(self.states[0]))].device
        s, d = to_device(list(src) + list(dst), torch.long, dev).split(len(src))
        for spec, layer in zip(self.state_specs, self.states):
            for name in (spec.snapshot if snapshot_only else layer):
                layer[name].index_copy_(0, d, layer[name].index_select(0, s))

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def nbytes(self) -> int:
        if self.region is not None:
            return self.region.size
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    # ---- sleep mode ----------------------------------------------------------------------
    def release(self) -> int:
        """Give the memory back; returns the bytes released. The tensors keep their shapes;
        their contents are gone."""
        if self.sleeping:
            return 0
        all_tensors = self.tensors()
        if all_tensors and all_tensors[0].is_cuda:
            torch.cuda.synchronize(all_tensors[0].device)
        freed = self.nbytes()
        if self.region is not None:
            self.region.unmap()
        else:
            for t in all_tensors:
                t.untyped_storage().resize_(0)
        self.sleeping = True
        return freed

    def restore(self) -> bool:
        """Take the memory back, zero payloads and states and unit scales as at allocation.
        Returns whether the tensors moved (plain allocations do; a VMM region does not)."""
        if not self.sleeping:
            return False
        if self.region is not None:
            torch.cuda.empty_cache()  # blocks a trainer freed go back to the driver first
            self.region.map()
            self.region.as_tensor().zero_()
        else:
            for t in self.tensors():
                t.untyped_storage().resize_(t.numel() * t.element_size())
                t.zero_()
        for s in (self.k_scales or []) + (self.v_scales or []):
            s.fill_(1.0)
        self.sleeping = False
        return self.region is None


def _vmm_tensors(pieces, device: torch.device):
    from vllm.worker.cuda_vmm import VirtualMemoryRegion

    align = lambda x: -(-x // 256) * 256  # each tensor 256-byte aligned
    sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for shape, dt, _ in pieces]
    region = VirtualMemoryRegion(sum(align(b) for b in sizes), device)
    raw = region.as_tensor()
    raw.zero_()
    tensors, off = [], 0
    for (shape, dt, fill), nbytes in zip(pieces, sizes):
        t = raw[off:off + nbytes].view(dt).view(shape)
        if fill:
            t.fill_(fill)
        tensors.append(t)
        off += align(nbytes)
    return region, tensors
