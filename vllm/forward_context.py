"""Per-step metadata shared with every layer, so layers keep plain `forward` signatures.

The worker (inference) or the trainer sets a `ForwardContext` around a model
call. Layers read two things from it: which numerics mode's kernels to call,
and the attention backend that owns everything step-specific (KV cache writes,
block tables, packed sequence boundaries). Layers never hold that state.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch


class AttentionBackend(Protocol):
    """What an attention layer calls; implemented by the worker or the trainer."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> [T, Hq, D]."""
        ...


@dataclass
class ForwardContext:
    attention: AttentionBackend | None
    numerics: str = "fast"


_CURRENT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CURRENT is None:
        raise RuntimeError("no forward context is set: call the model inside `set_forward_context(...)`")
    return _CURRENT


def current_numerics() -> str:
    """The numerics mode of the model call in progress (what the op shim dispatches on).
    Outside any forward context (a kernel called directly, as tests and benchmarks do)
    it is "fast", the baseline."""
    return _CURRENT.numerics if _CURRENT is not None else "fast"


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CURRENT
    prev, _CURRENT = _CURRENT, ctx
    try:
        yield ctx
    finally:
        _CURRENT = prev
