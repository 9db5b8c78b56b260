"""What the training backwards' Triton kernels share (chunk_recurrence.py, gdn_backward.py,
mamba2_backward.py): float32 tiles of [matrices, rows, cols] tensors moved through TMA tensor
descriptors (zero fill past the edges, clipped stores, no per-element pointer tiles held in
registers), and the precision of their dots."""
from __future__ import annotations

import torch

from vllm.kernels.chunk_tiles import HAS_TRITON, INTERPRET

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def load_tile(desc, i, R: tl.constexpr, X: tl.constexpr):
        """Matrix i's [R, X] box of a descriptor over [matrices, rows, cols]."""
        return tl.reshape(desc.load([i, 0, 0]), (R, X))

    @triton.jit
    def store_tile(desc, i, x, R: tl.constexpr, X: tl.constexpr):
        desc.store([i, 0, 0], tl.reshape(x, (1, R, X)))


def matrix_desc(t: torch.Tensor, block: tuple[int, int]):
    """A descriptor over t as [matrices, rows, cols] (its last two dims), one matrix a box."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor.from_tensor(t.view(-1, t.shape[-2], t.shape[-1]), [1, *block])


def dot_precision(x: torch.Tensor) -> str:
    """3xTF32 on the GPU (near float32; ieee float32 dots compile to FMA loops that spill at
    these tiles), ieee under the interpreter."""
    return "ieee" if INTERPRET or not x.is_cuda else "tf32x3"


def rows_aligned(*dims: int) -> bool:
    """float32 rows of these widths are 16-byte multiples, as a descriptor needs."""
    return all(d > 0 and d % 4 == 0 for d in dims)
