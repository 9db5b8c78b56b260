"""What the chunked recurrences (Gated DeltaNet: gdn_chunk.py; Mamba-2: mamba2_chunk.py) share
outside their kernels, none of it tied to one recurrence: the checks of the chunk grid and of
the layer's state, what the Triton entries pass for the state (the cache's tensors, or stand-ins
no program dereferences), the CPU entries' walk over a step's chunks (it hands each chunk to the
recurrence's own tile function as full C-row tiles), and the padding and backward of the
differentiable references. The kernels' shared device code is chunk_tiles.py."""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from vllm.forward_context import StateMetadata
from vllm.kernels.chunk_tiles import HAS_TRITON, INTERPRET

# The cached state rounded to the model dtype (invariant mode), beside the fp32 "ssm": written
# wherever "ssm" is, and read by the decode steps, which need the state in the model dtype
# only (their dots take model-dtype operands) and read half the bytes.
ROUNDED_STATE = "ssm_rounded"

# ---- checks -------------------------------------------------------------------------------------


def check_grid(chunk_size: int, dims_name: str, *dims: int) -> None:
    """The head dims the tiles cover (multiples of 16: tensor-core dots) and the chunk size
    (a power of two >= 16: the tile's row count)."""
    if any(d % 16 for d in dims) or 0 in dims:
        raise ValueError(f"{dims_name} must be multiples of 16")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError("chunk_size must be a power of two >= 16")


def check_state(md: StateMetadata, state: dict[str, torch.Tensor] | None, aligned: bool,
                ssm_shape: tuple[int, ...], ssm_dims: str, buffers: dict[str, tuple[tuple[int, ...], torch.dtype]]):
    """The layer's cache tensors by name: "ssm" float32 [slots, *ssm_shape] (`ssm_dims` names
    them in the message) and, aligned, the partial chunk's rows, `buffers`: name -> (shape
    after the slot dim, dtype). None (no cache) passes."""
    if state is None:
        return
    if md.slots is None:
        raise ValueError("a state needs md.slots")
    names = ("ssm", *buffers) if aligned else ("ssm",)
    for name in names:
        if name not in state:
            raise ValueError(f"state lacks {name!r}")
        if not state[name].is_contiguous():
            raise ValueError(f"state[{name!r}] must be contiguous")
    ns = state["ssm"].shape[0]
    if state["ssm"].shape[1:] != ssm_shape or state["ssm"].dtype != torch.float32:
        raise ValueError(f"state['ssm'] must be float32 [num_slots, {ssm_dims}]")
    if aligned:
        # the rows of a partial chunk exist for running sequences' slots only; the state
        # tensor also holds prefix-cache snapshots after them (vllm/worker/kv_cache.py)
        for name, (shape, dtype) in buffers.items():
            t = state[name]
            if tuple(t.shape[1:]) != shape or t.shape[0] > ns or t.dtype != dtype:
                raise ValueError(f"state[{name!r}] must be {dtype} [slots <= {ns}, {', '.join(map(str, shape))}]")


# ---- Triton entries -----------------------------------------------------------------------------

def require_triton(x: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if not x.is_cuda and not INTERPRET:
        raise RuntimeError("CPU tensors need TRITON_INTERPRET=1 (set before importing triton)")


def dot_mode(x: torch.Tensor) -> tuple[bool, str]:
    """(EMULATE, PREC) of chunk_tiles.dot_rows for the model dtype's tensors."""
    emulate = INTERPRET or not x.is_cuda
    # fp32 models (GPU tests only): 3xTF32 tensor-core dots, near-fp32 accuracy (ieee fp32
    # dots compile to FMA loops that spill heavily at these tiles)
    prec = "tf32x3" if x.dtype == torch.float32 else "tf32"
    return emulate, prec


def launch_state(md: StateMetadata, state: dict[str, torch.Tensor] | None, aligned: bool, buffers: Sequence[str],
                 stand_ins: Sequence[torch.Tensor], device: torch.device):
    """(has_state, ssm, slots, buffer tensors) for a launch: the cache's tensors, or where the
    kernels never dereference them (no cache; the buffers in fast mode) `stand_ins` and
    placeholders, so every launch has the same signature."""
    if state is not None:
        has_state = 1
        ssm = state["ssm"]
        slots = md.slots
        if aligned:
            bufs = tuple(state[name] for name in buffers)
        else:  # never dereferenced: there are no buffer rows and no buffer writes
            bufs = tuple(stand_ins)
        for t in (ssm, *bufs):
            if t.data_ptr() % 16:
                raise ValueError("state tensors must be 16-byte aligned")
    else:
        # placeholders, never dereferenced (has_state = 0 masks every access)
        has_state = 0
        ssm = torch.empty(4, dtype=torch.float32, device=device)
        slots = torch.zeros(max(md.start_pos.shape[0], 1), dtype=torch.int32, device=device)
        bufs = tuple(stand_ins)
    return has_state, ssm, slots, bufs


# ---- CPU entries --------------------------------------------------------------------------------

class HostChunks(NamedTuple):
    """A step's ChunkPlan (vllm/forward_context.py) as host lists, with its sequences' start
    positions and slots (None without a cache)."""
    start: list[int]
    first: list[int]
    end: list[int]
    tok0: list[int]
    seq_chunks: list[int]
    start_pos: list[int]
    slots: list[int] | None


def host_chunks(md: StateMetadata, chunk_size: int, aligned: bool, state: dict | None,
                num_tokens: int) -> HostChunks | None:
    """The step's chunks for a CPU entry; None when the step has nothing to compute."""
    plan = md.chunk_plan(chunk_size, aligned)
    if plan.num_chunks == 0 or num_tokens == 0:
        return None
    start, first, end, tok0 = (t.tolist() for t in (plan.start, plan.first_new, plan.end, plan.token0))
    return HostChunks(start, first, end, tok0, plan.seq_chunks.tolist(), md.start_pos.tolist(),
                      md.slots.tolist() if state is not None else None)


def scan_chunks_torch(chunks: HostChunks, out: torch.Tensor, inputs: Sequence[tuple[torch.Tensor, str | None]],
                      state: dict[str, torch.Tensor] | None, state_shape: tuple[int, ...], chunk_size: int,
                      aligned: bool, chunk_fn: Callable) -> None:
    """Each sequence's chunks in order, each as full C-row tiles of fixed shape (CPU library
    kernels round a row differently when the row count changes; here it never does).

    inputs: the step's per-token tensors [T, ...] in chunk_fn's order, each with the name of
    the state buffer that keeps its rows of a partial chunk (None: not kept). A tile holds the
    buffer's rows before the step's first token, the step's rows, zeros after.
    chunk_fn(tiles, h, L) -> (out rows [C, ...], state after rows <= L) for boundary state h
    (float32 state_shape). Writes `out` at the step's rows and, with a cache, the state and
    (aligned) the buffer rows of an incomplete last chunk, in place."""
    C = chunk_size
    start, first, end, tok0 = chunks.start, chunks.first, chunks.end, chunks.tok0
    for s in range(len(chunks.start_pos)):
        c0, c1 = chunks.seq_chunks[s], chunks.seq_chunks[s + 1]
        if c0 == c1:
            continue
        if chunks.start_pos[s] > 0 and state is None:
            raise ValueError("a sequence past position 0 needs a state")
        slot = chunks.slots[s] if state is not None else None
        if chunks.start_pos[s] > 0:
            h = state["ssm"][slot].clone()
        else:  # never read the slot: it may hold a previous owner's state
            h = torch.zeros(state_shape, dtype=torch.float32, device=out.device)
        for n in range(c0, c1):
            nb, nv, nn, t0 = first[n] - start[n], end[n] - start[n], end[n] - first[n], tok0[n]
            tiles = [x.new_zeros((C, *x.shape[1:])) for x, _ in inputs]
            if nb:
                for tile, (_, buf) in zip(tiles, inputs):
                    if buf is not None:
                        tile[:nb] = state[buf][slot, :nb]
            for tile, (x, _) in zip(tiles, inputs):
                tile[nb:nv] = x[t0:t0 + nn]
            oc, h_next = chunk_fn(tiles, h, nv - 1)
            out[t0:t0 + nn] = oc[nb:nv].to(out.dtype)
            if not aligned or nv == C:
                h = h_next
            elif state is not None and n == c1 - 1:
                # the partial chunk's new rows join the buffer (earlier rows are there)
                for tile, (_, buf) in zip(tiles, inputs):
                    if buf is not None:
                        state[buf][slot, nb:nv] = tile[nb:nv]
        if state is not None:
            state["ssm"][slot] = h
            if ROUNDED_STATE in state:  # what the GPU's decode path reads; nothing here does
                state[ROUNDED_STATE][slot] = h.to(state[ROUNDED_STATE].dtype)


# ---- differentiable references --------------------------------------------------------------------

def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a reference computes in: float32 / float64 as given, lower precisions in float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class PaddedChunks:
    """Packed sequences that all start at position 0 (a reference's input, cu_seqlens) as a
    batch padded with zero rows to a common whole number of chunks (zero rows change no
    earlier row)."""

    def __init__(self, cu_seqlens, chunk_size: int):
        self.chunk_size = chunk_size
        self.cu = cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else list(cu_seqlens)
        self.lens = [self.cu[i + 1] - self.cu[i] for i in range(len(self.cu) - 1)]
        self.num_chunks = max(1, max((-(-n // chunk_size) for n in self.lens), default=0))
        self.rows = self.num_chunks * chunk_size

    def require_covers(self, T: int) -> None:
        """ValueError unless the sequences are T tokens from token 0 on, back to back (a kernel
        that writes each sequence's rows in place leaves no row unwritten)."""
        if self.cu and (self.cu[0] != 0 or self.cu[-1] != T or any(n < 0 for n in self.lens)):
            raise ValueError(f"cu_seqlens must run from 0 to the {T} tokens, nondecreasing; got {self.cu}")

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [S, rows, ...]"""
        cu = self.cu
        return torch.stack([F.pad(t[cu[i]:cu[i + 1]], (0, 0) * (t.dim() - 1) + (0, self.rows - n))
                            for i, n in enumerate(self.lens)])

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """[S, rows, ...] -> [T, ...]"""
        return torch.cat([t[i, :n] for i, n in enumerate(self.lens)])

    def by_chunk(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[T, H, ...] -> [S, H, chunks, C, ...], contiguous (in `dtype` when given)."""
        x = self.pad(t if dtype is None else t.to(dtype)).transpose(1, 2)
        return x.reshape(x.shape[0], x.shape[1], self.num_chunks, self.chunk_size, *x.shape[3:]).contiguous()

    def from_chunks(self, t: torch.Tensor) -> torch.Tensor:
        """[S, H, chunks, C, ...] -> [T, H, ...]"""
        return self.unpad(t.reshape(t.shape[0], t.shape[1], self.rows, *t.shape[4:]).transpose(1, 2))


def reference_grads(reference: Callable, inputs, needs, dy: torch.Tensor) -> list:
    """The gradients of y = reference(*inputs) against dy for the inputs where `needs`,
    recomputed under autograd in float32 (float64 when dy or the first input is), in the
    inputs' dtypes (zeros for an input y does not depend on); None elsewhere."""
    grads = [None] * len(inputs)
    if any(needs):
        acc = torch.float64 if torch.float64 in (dy.dtype, inputs[0].dtype) else torch.float32
        with torch.enable_grad():
            xs = [x.detach().to(acc).requires_grad_(bool(n)) for x, n in zip(inputs, needs)]
            y = reference(*xs)
            wrt = [x for x, n in zip(xs, needs) if n]
            got = iter(torch.autograd.grad(y, wrt, dy.to(acc), allow_unused=True))
        for i, (x, n) in enumerate(zip(inputs, needs)):
            if n:
                d = next(got)
                grads[i] = torch.zeros_like(x) if d is None else d.to(x.dtype)
    return grads
