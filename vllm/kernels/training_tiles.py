"""What the training backwards' Triton kernels share (chunk_recurrence.py, gdn_backward.py,
mamba2_backward.py): float32 tiles of [matrices, rows, cols] tensors moved through TMA tensor
descriptors (zero fill past the edges, clipped stores, no per-element pointer tiles held in
registers), and their dots (`mm`) at the precision `dot_precision` picks."""
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
        """x as matrix i's [R, X] box, in the descriptor's dtype (to_dtype_rn)."""
        desc.store([i, 0, 0], tl.reshape(to_dtype_rn(x, desc.dtype), (1, R, X)))

    @triton.jit
    def chunk_of(ch, cu_ptr, NC, H, C):
        """Chunk ch of [sequences, heads, chunks] over packed sequences (cu_ptr: their int32
        offsets): its first token, its number of tokens (0 for a chunk past its sequence's
        end) and its head."""
        c = ch % NC
        s = ch // NC // H
        start = tl.load(cu_ptr + s)
        n = tl.minimum(tl.maximum(tl.load(cu_ptr + s + 1) - start - c * C, 0), C)
        return start + c * C, n, (ch // NC) % H

    @triton.jit
    def _rows_cols(t0, n, c0, stride, W: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr):
        r = tl.arange(0, BC)
        cols = tl.arange(0, BX)
        off = (t0 + r).to(tl.int64)[:, None] * stride + c0 + cols[None, :]
        if W >= BX:  # a mask constant along the row keeps the accesses vectorised
            return off, (r < n)[:, None]
        else:
            return off, (r < n)[:, None] & (cols < W)[None, :]

    @triton.jit
    def load_rows(ptr, t0, n, c0, stride, W: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr):
        """Rows t0 .. t0 + n - 1, columns c0 .. c0 + min(W, BX) - 1 of a row-major tensor of
        `stride` columns (the caller's, in its dtype, e.g. one head of [T, heads, X]) as a
        float32 [BC, BX] tile, zeros elsewhere."""
        off, m = _rows_cols(t0, n, c0, stride, W, BC, BX)
        return tl.load(ptr + off, mask=m, other=0.0).to(tl.float32)

    @triton.jit
    def load_operand(ptr, t0, n, c0, stride, W: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr,
                     PREC: tl.constexpr):
        """load_rows for a tile that is mostly a dot's operand: with bf16 dots it stays in the
        caller's dtype (half the registers of a float32 copy for bfloat16 inputs; mm rounds it
        to bfloat16 and an elementwise use widens it exactly), else float32 as load_rows."""
        off, m = _rows_cols(t0, n, c0, stride, W, BC, BX)
        t = tl.load(ptr + off, mask=m, other=0.0)
        if PREC == "bf16":
            return t
        else:
            return t.to(tl.float32)

    @triton.jit
    def store_rows(ptr, x, t0, n, c0, stride, W: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr):
        """x's first n rows (and min(W, BX) columns) to the box load_rows reads, cast to ptr's dtype."""
        off, m = _rows_cols(t0, n, c0, stride, W, BC, BX)
        tl.store(ptr + off, x.to(ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _block_cols(t0, n, c0, stride, n0, W: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr):
        off, m = _rows_cols(t0, n, c0 + n0, stride, BX, BC, BX)
        if W % BX == 0:  # every block whole: no column mask (vectorised accesses)
            return off, m
        else:
            return off, m & (tl.arange(0, BX) < W - n0)[None, :]

    @triton.jit
    def load_block(ptr, t0, n, c0, stride, n0, W: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr):
        """load_rows of the BX columns from n0 (a program's block, n0 not a constexpr) of the
        W columns at c0."""
        off, m = _block_cols(t0, n, c0, stride, n0, W, BC, BX)
        return tl.load(ptr + off, mask=m, other=0.0).to(tl.float32)

    @triton.jit
    def store_block(ptr, x, t0, n, c0, stride, n0, W: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr):
        off, m = _block_cols(t0, n, c0, stride, n0, W, BC, BX)
        tl.store(ptr + off, x.to(ptr.dtype.element_ty), mask=m)

    @triton.jit
    def round_bf16(x):
        """float32 x rounded to the nearest bfloat16 (ties to even), kept in float32 (finite x)."""
        i = x.to(tl.int32, bitcast=True)
        i = (i + 0x7FFF + ((i >> 16) & 1)) & -65536
        return i.to(tl.float32, bitcast=True)

    @triton.jit
    def to_dtype_rn(x, dtype: tl.constexpr):
        """x in dtype, rounded to nearest: bfloat16 through round_bf16 (exact in bfloat16, so
        the cast after it is exact too: the interpreter's cast truncates, the GPU's rounds, and
        both give the bits the "bf16" dots of mm round their operands to)."""
        if dtype == tl.bfloat16:
            return round_bf16(x.to(tl.float32)).to(tl.bfloat16)
        else:
            return x.to(dtype)

    @triton.jit
    def operand(x, PREC: tl.constexpr):
        """x held for mm's use only: with the bf16 dots the bfloat16 mm rounds it to (to
        nearest; half the registers of float32, the same products), else as it is."""
        if PREC == "bf16":
            return to_dtype_rn(x, tl.bfloat16)
        elif PREC == "bf16_emulated":
            return round_bf16(x.to(tl.float32))
        else:
            return x

    @triton.jit
    def mm(a, b, PREC: tl.constexpr):
        """a @ b of float32 tiles, accumulated in float32: "bf16" rounds both operands to
        bfloat16 first (one tensor-core pass); "bf16_emulated" is the same product for the
        interpreter (whose bfloat16 dot multiplies raw bit patterns and whose cast does not
        round to nearest): operands rounded to nearest, then an ieee float32 dot (each product
        of two bfloat16 values is exact in float32); anything else is tl.dot's input_precision.
        With the bf16 ones an operand may already be bfloat16 (stored so by to_dtype_rn: the
        same bits as rounding it here)."""
        if PREC == "bf16":
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        elif PREC == "bf16_emulated":
            return tl.dot(round_bf16(a.to(tl.float32)), round_bf16(b.to(tl.float32)), input_precision="ieee")
        else:
            return tl.dot(a, b, input_precision=PREC)


def matrix_desc(t: torch.Tensor, block: tuple[int, int]):
    """A descriptor over t as [matrices, rows, cols] (its last two dims), one matrix a box."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor.from_tensor(t.view(-1, t.shape[-2], t.shape[-1]), [1, *block])


def dot_precision(x: torch.Tensor) -> str:
    """The dots' precision for a backward whose inputs are x's dtype. On the GPU: for bfloat16
    inputs "bf16", operands rounded to bfloat16 and float32 accumulation, as every bf16
    linear layer's backward computes its gradients (and fla's and mamba_ssm's backwards
    theirs); for any other dtype 3xTF32 (near float32; ieee float32 dots compile to FMA loops
    that spill at these tiles; float16 operands would lose bits to bfloat16). Under the
    interpreter (CPU tensors) the same choice: "bf16_emulated" for bfloat16 inputs, "ieee"
    otherwise."""
    emulated = INTERPRET or not x.is_cuda
    if x.dtype == torch.bfloat16:
        return "bf16_emulated" if emulated else "bf16"
    return "ieee" if emulated else "tf32x3"


def rows_aligned(*dims: int) -> bool:
    """float32 rows of these widths are 16-byte multiples, as a descriptor needs."""
    return all(d > 0 and d % 4 == 0 for d in dims)
