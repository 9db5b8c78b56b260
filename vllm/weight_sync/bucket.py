"""Flat buckets: many named tensors packed into one contiguous byte buffer.

Every transport moves buckets, not tensors: one CUDA IPC handle, one shared-memory
segment or one collective per bucket instead of one per tensor (per-tensor messages
are what made published syncs slow: hundreds of round trips). The layout is a pure
function of the tensors' (name, dtype, shape) list and the bucket size, so a sender
and a receiver that agree on the manifest agree on every offset without sending them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

ALIGN = 256   # byte alignment of every tensor inside a bucket (any dtype view, vector loads)
DEFAULT_BUCKET_BYTES = 1 << 30


@dataclass(frozen=True)
class BucketEntry:
    """One tensor of a bucket: its HF name, dtype name ("bfloat16"), shape, and byte offset."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset]

    @classmethod
    def from_json(cls, item) -> "BucketEntry":
        name, dtype, shape, offset = item
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"bucket entry {name!r}: offset must be a non-negative integer, got {offset!r}")
        return cls(str(name), str(dtype), shape_of(shape, name), offset)


def shape_of(shape, name) -> tuple[int, ...]:
    """A manifest's shape as a tuple of non-negative ints; anything else (a negative or
    fractional dimension, a bool, a string) is a ValueError naming the tensor."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (list, tuple)) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"weight {name!r}: shape {shape!r} is not a list of non-negative integers")
    return tuple(shape)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class BucketLayout:
    """Where each tensor of one bucket goes; `nbytes` is the buffer size."""
    entries: tuple[BucketEntry, ...]
    nbytes: int

    def to_json(self) -> dict:
        return {"entries": [e.to_json() for e in self.entries], "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: dict) -> "BucketLayout":
        return cls(tuple(BucketEntry.from_json(e) for e in d["entries"]), int(d["nbytes"]))


def manifest_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype name, shape) of each tensor: what a receiver needs to plan the buckets."""
    return [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in named]


def plan_buckets(manifest: Sequence[tuple[str, str, Sequence[int]]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
                 ) -> list[BucketLayout]:
    """Split a manifest into buckets of at most `bucket_bytes` (a tensor larger than that
    gets a bucket of its own), in manifest order."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    out: list[BucketLayout] = []
    cur: list[BucketEntry] = []
    used = 0
    for name, dtype, shape in manifest:
        e = BucketEntry(str(name), str(dtype), shape_of(shape, name), 0)
        size = e.nbytes
        if cur and used + size > bucket_bytes:
            out.append(BucketLayout(tuple(cur), used))
            cur, used = [], 0
        cur.append(BucketEntry(e.name, e.dtype, e.shape, used))
        used = _aligned(used + size)
    if cur:
        out.append(BucketLayout(tuple(cur), used))
    return out


class FlatBucket:
    """A byte buffer and the layout of the tensors in it. `tensors()` gives views (no copies)."""

    def __init__(self, buffer: torch.Tensor, layout: BucketLayout):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError("a bucket buffer is a contiguous 1-D uint8 tensor")
        if buffer.numel() < layout.nbytes:
            raise ValueError(f"bucket buffer has {buffer.numel()} bytes, its layout needs {layout.nbytes}")
        for e in layout.entries:   # a layout from the wire: every view must lie inside the buffer
            if e.offset < 0 or e.offset + e.nbytes > min(layout.nbytes, buffer.numel()):
                raise ValueError(f"bucket entry {e.name!r} (bytes {e.offset}..{e.offset + e.nbytes}) lies outside "
                                 f"its bucket of {min(layout.nbytes, buffer.numel())} bytes")
            size = torch.empty((), dtype=e.torch_dtype).element_size()
            if e.offset % size:
                raise ValueError(f"bucket entry {e.name!r} starts at byte {e.offset}, not a multiple of its "
                                 f"{e.dtype} element size ({size})")
        self.buffer = buffer
        self.layout = layout
        self._views: list[tuple[str, torch.Tensor]] | None = None

    @classmethod
    def empty(cls, layout: BucketLayout, device: torch.device | str) -> "FlatBucket":
        return cls(torch.empty(max(1, layout.nbytes), dtype=torch.uint8, device=device), layout)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view) of each entry, made once per bucket: a bucket kept open across
        updates (CUDA IPC) is read through the same views every time."""
        if self._views is None:
            self._views = [(e.name, self.buffer[e.offset:e.offset + e.nbytes].view(e.torch_dtype).view(e.shape))
                           for e in self.layout.entries]
        return list(self._views)

    def fill(self, sources: dict[str, torch.Tensor]) -> "FlatBucket":
        """Copy each entry's tensor from `sources` (by name) into the buffer."""
        dests, srcs = [], []
        for name, view in self.tensors():
            dests.append(view)
            srcs.append(sources[name].detach())
        with torch.no_grad():
            copy_all(dests, srcs)
        return self


def pack(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
         device: torch.device | str | None = None) -> list[FlatBucket]:
    """The tensors packed into fresh flat buckets on `device` (default: the first tensor's)."""
    named = list(named)
    if not named:
        return []
    device = device if device is not None else named[0][1].device
    sources = dict(named)
    return [FlatBucket.empty(layout, device).fill(sources) for layout in plan_buckets(manifest_of(named), bucket_bytes)]


# Tensors at least this large are copied one by one: a lone contiguous copy is a device
# memcpy at the copy-bandwidth floor, while the multi-tensor kernel that batches the many
# small ones (norms, biases) is slower on large ones (H200, Qwen3-8B dims, 15 GiB:
# 8.5 ms vs 11.6 ms; benchmarks/weight_sync.py prints both).
LARGE_TENSOR_BYTES = 1 << 20


def _is_large(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() >= LARGE_TENSOR_BYTES


def copy_all(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dest[i].copy_(src[i]) for all i: large same-dtype pairs one copy each (memcpy), the
    small ones batched into multi-tensor kernels, other dtypes cast on the way."""
    small: tuple[list, list] = ([], [])
    for d, s in zip(dests, srcs):
        if d.device == s.device and d.dtype == s.dtype and not _is_large(d):
            small[0].append(d)
            small[1].append(s)
        else:
            d.copy_(s, non_blocking=True)
    if small[0]:
        torch._foreach_copy_(small[0], small[1], non_blocking=True)
