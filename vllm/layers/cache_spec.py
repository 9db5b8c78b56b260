"""What a stateful layer declares about the cache it needs; the worker sizes, allocates,
sleeps and prefix-caches from these declarations alone (vllm/worker/kv_cache.py).

- `PagedKVSpec`: attention's K/V, paged in blocks of tokens (the engine's KV format: the
  model dtype, or FP8 with scales).
- `RecurrentStateSpec`: a recurrent layer's fixed-size state per sequence (a conv window,
  a matrix state, rows of a partial chunk ...), held in one slot per running sequence.
  Its `chunk_size` is the grid on which the state is defined for reuse: a prefix-cache
  snapshot is taken and restored only at multiples of it.

A layer returns its spec from `cache_spec(numerics)`: what it stores may depend on the
numerics mode (the invariant mode of a chunked recurrence keeps the rows of the partial
chunk; the fast mode does not).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedKVSpec:
    """A layer's paged K/V cache: per block of tokens, K and V of `num_kv_heads` x `head_dim`
    (in the engine's KV format: the model dtype or FP8 with scales), addressed by the
    layer's index in the attention backend (0, 1, ... over the model's attention layers)."""
    layer_idx: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a recurrent state, per sequence slot: `shape` without the slot
    dimension; `dtype` None means the model dtype."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    def nbytes(self, model_dtype: torch.dtype) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype or model_dtype).element_size()


@dataclass(frozen=True)
class RecurrentStateSpec:
    """A recurrent layer's per-sequence state, addressed by the layer's index in the state
    backend (0, 1, ... over the model's recurrent layers).

    `tensors`: what one slot holds. `snapshot`: the names of the tensors that describe the
    state at a multiple of `chunk_size` (a prefix-cache snapshot copies these; the others are
    empty there, e.g. the rows of a partial chunk). `kind`: what the layer is, for the
    execution contract and the logs."""
    layer_idx: int
    kind: str
    tensors: tuple[StateTensor, ...]
    chunk_size: int
    snapshot: tuple[str, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.kind} state declares a tensor name twice: {names}")
        if not set(self.snapshot) <= set(names):
            raise ValueError(f"{self.kind} state snapshot names {sorted(set(self.snapshot) - set(names))} it does not hold")
        if self.chunk_size < 1:
            raise ValueError(f"{self.kind} state chunk_size must be >= 1, got {self.chunk_size}")

    def slot_bytes(self, model_dtype: torch.dtype) -> int:
        return sum(t.nbytes(model_dtype) for t in self.tensors)
