"""Per-step metadata shared with every layer, so layers keep plain `forward` signatures.

The worker (inference) or the trainer sets a `ForwardContext` around a model
call. Layers and the op shim read three things from it: which numerics mode's
kernels to call and the kernel options (`current_numerics()`,
`current_kernel_config()`), and the attention backend that owns everything
step-specific (KV cache writes, block tables, packed sequence boundaries).
Layers never hold that state.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

from vllm.config import KernelConfig


class AttentionBackend(Protocol):
    """What an attention layer calls; implemented by the worker or the trainer."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> [T, Hq, D]."""
        ...


@dataclass
class ForwardContext:
    attention: AttentionBackend | None
    numerics: str = "fast"
    kernels: KernelConfig = field(default_factory=KernelConfig)


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


_DEFAULT_KERNELS = KernelConfig()


def current_kernel_config() -> KernelConfig:
    """The kernel options of the model call in progress (defaults outside any context)."""
    return _CURRENT.kernels if _CURRENT is not None else _DEFAULT_KERNELS


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CURRENT
    prev, _CURRENT = _CURRENT, ctx
    try:
        yield ctx
    finally:
        _CURRENT = prev
