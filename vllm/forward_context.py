"""Per-step metadata shared with every layer, so layers keep plain `forward` signatures.

The worker (inference) or the trainer sets a `ForwardContext` around a model
call. Layers and the op shim read four things from it: which numerics mode's
kernels to call and the kernel options (`current_numerics()`,
`current_kernel_config()`), the attention backend that owns everything
step-specific for attention (KV cache writes, block tables, packed sequence
boundaries), and the state backend of recurrent layers (each sequence's state
slot and start position, the step cut into chunks on a layer's grid). Layers
never hold that state.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np
import torch

from vllm.config import KernelConfig


class AttentionBackend(Protocol):
    """What an attention layer calls; implemented by the worker or the trainer."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> [T, Hq, D]."""
        ...


@dataclass
class ChunkPlan:
    """The step's new tokens cut into chunks of `chunk_size` rows, each chunk within one
    sequence (device int32 tensors, one entry per chunk, in sequence then position order).

    `aligned`: chunks lie on the absolute grid of the sequence (row 0 of a chunk at a
    multiple of chunk_size), so a chunk the step resumes in the middle starts before the
    step's first token: its rows `[start, first_new)` come from the layer's state (the rows
    of the partial chunk it kept), rows `[first_new, end)` are the step's tokens
    `token0 ...`. Not aligned: chunks start at each sequence's first new token
    (`first_new == start`), the grid of the step, not of the sequence."""
    chunk_size: int
    aligned: bool
    num_chunks: int
    max_chunks_per_seq: int
    seq: torch.Tensor        # [N] sequence index of the chunk
    start: torch.Tensor      # [N] absolute position of the chunk's row 0
    first_new: torch.Tensor  # [N] absolute position of its first row computed in this step
    end: torch.Tensor        # [N] one past its last row in this step (<= start + chunk_size)
    token0: torch.Tensor     # [N] packed index (in the step's tokens) of the row at first_new
    seq_chunks: torch.Tensor  # [S + 1] chunks of sequence s: seq_chunks[s] .. seq_chunks[s + 1] - 1

    @classmethod
    def from_host(cls, start_pos: np.ndarray, q_lens: np.ndarray, chunk_size: int, aligned: bool,
                  device: torch.device) -> "ChunkPlan":
        """Any step, planned on the host (one copy to the device)."""
        start_pos = np.asarray(start_pos, dtype=np.int64)
        q_lens = np.asarray(q_lens, dtype=np.int64)
        C = chunk_size
        cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        first = (start_pos // C) * C if aligned else start_pos
        stop = start_pos + q_lens
        counts = np.where(q_lens > 0, -(-(stop - first) // C), 0)
        seq_chunks = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(counts, out=seq_chunks[1:])
        seq = np.repeat(np.arange(len(q_lens)), counts)
        k = np.arange(int(seq_chunks[-1])) - seq_chunks[:-1][seq]
        start = first[seq] + k * C
        first_new = np.maximum(start, start_pos[seq])
        end = np.minimum(start + C, stop[seq])
        token0 = cu[:-1][seq] + (first_new - start_pos[seq])
        n = len(seq)
        packed = np.concatenate((seq, start, first_new, end, token0, seq_chunks)).astype(np.int32)
        dev = torch.from_numpy(packed)
        if torch.device(device).type == "cuda":
            dev = dev.pin_memory().to(device, non_blocking=True)
        else:
            dev = dev.to(device)
        parts = dev[:5 * n].view(5, n)
        return cls(C, aligned, n, int(counts.max()) if len(counts) else 0, parts[0], parts[1], parts[2], parts[3],
                   parts[4], dev[5 * n:])

    @classmethod
    def one_token_each(cls, start_pos: torch.Tensor, chunk_size: int, aligned: bool) -> "ChunkPlan":
        """A step where every sequence has one token (decode), planned on the device from
        the positions alone: no host work, so it runs inside a captured CUDA graph."""
        n = start_pos.shape[0]
        pos = start_pos.to(torch.int32)
        idx = torch.arange(n + 1, dtype=torch.int32, device=pos.device)
        start = pos - pos % chunk_size if aligned else pos
        return cls(chunk_size, aligned, n, 1, idx[:n], start, pos, pos + 1, idx[:n], idx)


@dataclass
class StateMetadata:
    """One step's sequences as recurrent layers see them."""
    cu_seqlens: torch.Tensor    # [S + 1] int32: the step's tokens of sequence s are cu[s] .. cu[s + 1] - 1
    start_pos: torch.Tensor     # [S] int32: position of each sequence's first token in this step
    slots: torch.Tensor | None  # [S] int32 state slot of each sequence; None: no cache (every
    #                             sequence starts at position 0 and its final state is dropped)
    max_query_len: int
    # host copies to plan chunks from; None when every sequence has one token (decode,
    # CUDA graphs), which is planned on the device
    host_start_pos: np.ndarray | None = None
    host_q_lens: np.ndarray | None = None
    _plans: dict = field(default_factory=dict, repr=False)

    def chunk_plan(self, chunk_size: int, aligned: bool) -> ChunkPlan:
        """The step cut into chunks (built once per step and grid, shared by every layer)."""
        key = (chunk_size, aligned)
        plan = self._plans.get(key)
        if plan is None:
            if self.max_query_len == 1 or self.host_q_lens is None:
                if self.max_query_len != 1:
                    raise ValueError("a step with multi-token sequences needs host copies to plan its chunks")
                plan = ChunkPlan.one_token_each(self.start_pos, chunk_size, aligned)
            else:
                plan = ChunkPlan.from_host(self.host_start_pos, self.host_q_lens, chunk_size, aligned,
                                           self.start_pos.device)
            self._plans[key] = plan
        return plan


@dataclass
class StateBackend:
    """What a recurrent layer reads from the forward context: the step's metadata and, per
    layer (its index among the recurrent layers), its cached state tensors by name
    ([num_slots, ...] each) or None when nothing is cached (the trainer)."""
    metadata: StateMetadata
    tensors: list[dict[str, torch.Tensor]] | None = None

    def layer(self, layer_idx: int) -> dict[str, torch.Tensor] | None:
        return None if self.tensors is None else self.tensors[layer_idx]


@dataclass
class ForwardContext:
    attention: AttentionBackend | None
    numerics: str = "fast"
    kernels: KernelConfig = field(default_factory=KernelConfig)
    state: StateBackend | None = None
    # activation checkpointing's recomputation in backward: the same computation again, which
    # layers that record something per call (router statistics) must not record twice
    recomputing: bool = False


# Per thread: a trainer thread's Policy forward and the engine's step on another thread each
# see their own context (one global was overwritten by the other mid-call). Autograd's
# recomputation (activation checkpointing) re-enters the context it captured, so a backward on
# autograd's device thread still sees it.
_LOCAL = threading.local()
# float32 matmul precision is process-wide in torch: the invariant calls in flight (any thread)
# hold it at "highest"; the last one out puts the caller's setting back
_PRECISION_LOCK = threading.Lock()
_PRECISION_HOLDERS = 0
_PRECISION_SAVED: str | None = None


def _current() -> ForwardContext | None:
    return getattr(_LOCAL, "ctx", None)


def recomputing() -> bool:
    """Whether this call is activation checkpointing's recomputation of a forward."""
    ctx = _current()
    return ctx is not None and ctx.recomputing


def get_forward_context() -> ForwardContext:
    ctx = _current()
    if ctx is None:
        raise RuntimeError("no forward context is set: call the model inside `set_forward_context(...)`")
    return ctx


def current_numerics() -> str:
    """The numerics mode of the model call in progress (what the op shim dispatches on).
    Outside any forward context (a kernel called directly, as tests and benchmarks do)
    it is "fast", the baseline."""
    ctx = _current()
    return ctx.numerics if ctx is not None else "fast"


_DEFAULT_KERNELS = KernelConfig()


def current_kernel_config() -> KernelConfig:
    """The kernel options of the model call in progress (defaults outside any context)."""
    ctx = _current()
    return ctx.kernels if ctx is not None else _DEFAULT_KERNELS


def _hold_highest_precision() -> None:
    global _PRECISION_HOLDERS, _PRECISION_SAVED
    with _PRECISION_LOCK:
        if _PRECISION_HOLDERS == 0:
            _PRECISION_SAVED = torch.get_float32_matmul_precision()
            if _PRECISION_SAVED != "highest":
                torch.set_float32_matmul_precision("highest")
        _PRECISION_HOLDERS += 1


def _release_precision() -> None:
    global _PRECISION_HOLDERS
    with _PRECISION_LOCK:
        _PRECISION_HOLDERS -= 1
        if _PRECISION_HOLDERS == 0 and _PRECISION_SAVED not in (None, "highest"):
            torch.set_float32_matmul_precision(_PRECISION_SAVED)


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` this thread's model-call context. In invariant mode the caller's torch-wide
    numerics settings are set aside for the call: autocast off (it would change the ops'
    dtypes) and float32 matmuls at "highest" precision (a lower one lets the CPU BLAS and
    cuBLAS round through bfloat16 / TF32), so the trainer's forward and the rollout's run the
    same arithmetic whatever either caller set around them."""
    prev = _current()
    _LOCAL.ctx = ctx
    with contextlib.ExitStack() as stack:
        if ctx.numerics == "invariant":
            stack.enter_context(torch.autocast("cpu", enabled=False))
            if torch.cuda.is_available():
                stack.enter_context(torch.autocast("cuda", enabled=False))
            _hold_highest_precision()
            stack.callback(_release_precision)
        try:
            yield ctx
        finally:
            _LOCAL.ctx = prev
