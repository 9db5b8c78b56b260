"""Block-scaled FP8 GEMM: y = x @ w.T with x quantized per token per 128 channels and w per
128 x 128 block (vllm/kernels/fp8.py), float32 scales.

One arithmetic, two devices (docs/fp8.md):

    acc = 0 (float32)
    for each 128-wide K block kb, ascending:
        part = dot(xq[m, kb], wq[n, kb])           # fp8 products, float32 sum, fresh per block
        acc  = acc + part * (xs[m, kb] * ws[n // 128, kb])   # one scale product per (m, kb)
    y = round_to_out_dtype(acc (+ bias in float32))

* CUDA: `fp8_gemm_triton`, tl.dot on fp8 operands (Hopper wgmma, both operands K-major),
  one K block per loop step, the block's partial promoted to the float32 accumulator with
  the combined scale (no long fp8 accumulation inside the tensor core; on the GPU the
  multiply-add is one fused FMA). K is never split and K blocks are summed in ascending
  order whatever the tile, so a row's bits cannot depend on the batch; loads are unmasked
  when K % 128 == 0 (rows/columns past M/N re-read a valid row and are never stored).
  Tiles (`gemm_config(N, K, M)`): `GEMM_CONFIG` or a per-weight-shape entry, and for
  M <= SMALL_M_MAX (decode) narrower tiles that fill the SMs. The small-M tiles are used for
  a weight shape only after a probe on that device found them bit-identical to the large
  tiles (`small_m_tiles_verified`): the tensor core's per-element order does not depend on
  the tile, and the probe proves it rather than assumes it. Activations are quantized by one
  fused kernel (vllm/kernels/fp8_quant.py, bit-identical to fp8.quantize_act).
* CUDA, from CUBLASLT_MIN_M rows: cuBLASLt's block-scaled FP8 GEMM (vllm/kernels/fp8_cublaslt.py,
  no split-K, no workspace), which computes the Triton kernel's bits: measured at every M for
  Qwen3-8B's shapes on the H200, and proved per weight shape on each device before use
  (`cublaslt_verified`, a probe like the small-M tiles'). It runs 1.4-1.8x the bf16 invariant
  GEMM at M >= 1024 where the Triton kernel reaches 0.9-1.3x (docs/fp8.md says why).
  `fp8_linear_cuda` picks per call; both sides of the switch give every row the same bits.
* CPU: `fp8_gemm_rows`, the same formula with each block's dot an explicit pairwise tree of
  exact fp32 products (elementwise ops only), so its bits cannot depend on the batch either.
  It does not reproduce the Triton kernel's bits (the tensor core sums in its own order).
* `fp8_gemm_dequant`: fast mode on CPU (dequantize, then a BLAS matmul; no promise).
"""
from __future__ import annotations

import os

import torch

from vllm.kernels import fp8_cublaslt
from vllm.kernels.fp8 import BLOCK, dequantize_act, dequantize_weight, quantize_act
from vllm.kernels.fp8_quant import quantize_act_triton

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Tiles, from `benchmarks/kernels/fp8_gemm.py --graph --sweep` on the H200 (figures in
# benchmarks/NOTES.md; every config there computed the same bits). K block = the quantization
# block. BLOCK_N divides 128 or is a multiple of it, so a weight-scale row is one scalar per
# tile or one per 128 columns. TMA: operand tiles through host-side tensor descriptors
# (Hopper TMA) instead of pointer loads. 64-row tiles of one warpgroup let several programs
# share an SM, so one program's fp32 promotion overlaps another's dot.
GEMM_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3, "TMA": True}
# Per weight shape {(N, K): config} (Qwen3-8B's o projection).
GEMM_CONFIG_BY_SHAPE: dict[tuple[int, int], dict] = {
    (4096, 4096): {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "TMA": True},
}
# Decode-sized batches: 64-row tiles (the smallest wgmma) and narrow columns, so a
# [<=256, K] x [K, N] product spreads over the SMs instead of leaving most of them idle
# (chosen from the sweep timed inside CUDA graphs, as decode runs).
SMALL_M_MAX = 256
GEMM_CONFIG_SMALL_M = {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4, "TMA": True}
GEMM_CONFIG_SMALL_M_BY_SHAPE: dict[tuple[int, int], dict] = {
    (4096, 4096): {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 6, "TMA": True},
    (24576, 4096): {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3, "TMA": True},
    (4096, 12288): {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 6, "TMA": True},
}
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 128, "GROUP_M": 1, "num_warps": 1, "num_stages": 1}
# From this many rows the layer's GEMM runs on cuBLASLt (where verified). Graph timings on
# the H200 (benchmarks/NOTES.md): from 192 rows cuBLASLt is faster for qkv, gate_up and down
# (qkv 15.4 vs 19.7 us, gate_up 51.9 vs 61.2) and within 8% for o; at 128 rows and below the
# Triton small-M tiles are faster for o and down (down at 64: 29.9 vs 36.1 us).
CUBLASLT_MIN_M = 192


def _pad_k(t: torch.Tensor, kb: int) -> torch.Tensor:
    pad = kb * BLOCK - t.shape[-1]
    return t if pad == 0 else torch.nn.functional.pad(t, (0, pad))


def _tree_sum_last(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    while n > 1:
        n //= 2
        x = x[..., :n] + x[..., n:2 * n]
    return x[..., 0]


def fp8_gemm_rows(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The CPU kernel (see module docstring); rows are processed in chunks only to bound
    the [rows, N, 128] temporary: chunking is invisible in the bits."""
    M, K = xq.shape
    N = wq.shape[0]
    kb = -(-K // BLOCK)
    wf = _pad_k(wq.float(), kb).view(N, kb, BLOCK)
    wsn = ws.float().repeat_interleave(BLOCK, 0)[:N]  # [N, kb]
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    rows = max(1, (1 << 24) // max(1, N * BLOCK))
    bias_f = bias.float() if bias is not None else None
    for r0 in range(0, M, rows):
        xf = _pad_k(xq[r0:r0 + rows].float(), kb).view(-1, kb, BLOCK)
        acc = torch.zeros(xf.shape[0], N, dtype=torch.float32, device=xq.device)
        for b in range(kb):
            part = _tree_sum_last(xf[:, None, b, :] * wf[None, :, b, :])  # [m, N]
            acc = acc + part * (xs[r0:r0 + rows, b, None] * wsn[None, :, b])
        if bias_f is not None:
            acc = acc + bias_f
        out[r0:r0 + rows] = acc.to(out_dtype)
    return out


def fp8_gemm_dequant(xq, xs, wq, ws, bias, out_dtype):
    """Fast mode on CPU: float32 dequantized operands through the BLAS (batch-dependent bits)."""
    y = torch.nn.functional.linear(dequantize_act(xq, xs, torch.float32), dequantize_weight(wq, ws, torch.float32),
                                   None if bias is None else bias.float())
    return y.to(out_dtype)


if HAS_TRITON:
    try:  # host-side TMA descriptors (triton >= 3.4); the pointer path needs none
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover
        TensorDescriptor = None

    @triton.jit
    def _load_scale(as_ptrs, bs_ptrs, kb, stride_ask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """K block kb's combined scale: [BM, 1] (one weight scale per tile) or [BM, BN]."""
        sa = tl.load(as_ptrs + kb * stride_ask)
        sb = tl.load(bs_ptrs + kb)
        if BLOCK_N <= BLOCK_K:
            return (sa * sb)[:, None]
        return sa[:, None] * sb[None, :]

    @triton.jit
    def _load_operands(a_ptr, b_ptr, a_ptrs, b_ptrs, kb, pid_m, pid_n, K,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, USE_TMA: tl.constexpr):
        """K block kb's operand tiles (TMA boxes or pointer loads)."""
        if USE_TMA:
            a = a_ptr.load([pid_m * BLOCK_M, kb * BLOCK_K])
            b = b_ptr.load([pid_n * BLOCK_N, kb * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs + kb * BLOCK_K)
            b = tl.load(b_ptrs + kb * BLOCK_K)
        else:
            k_ok = (kb * BLOCK_K + tl.arange(0, BLOCK_K)) < K
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs + kb * BLOCK_K, mask=k_ok[None, :], other=0.0)
        return a, b

    @triton.jit
    def _block_dot(a, b, EMULATE: tl.constexpr):
        if EMULATE:
            return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], 2)
        return tl.dot(a, tl.trans(b))  # both operands K-major: the fp8 wgmma form

    @triton.jit
    def _fp8_tile(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, pid_m, pid_n,
                  M, N, K, stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_cm,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
                  EMULATE: tl.constexpr):
        """One output tile: the module docstring's loop, then the store."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        # Lanes past M / N read a valid row (the last one) instead of being masked: a product
        # row depends on its own A row only, so the duplicates change no stored bits, and the
        # loads stay unmasked. (TMA zero-fills out-of-range boxes itself.)
        rm = tl.where(m_ok, offs_m, M - 1).to(tl.int64)
        rn = tl.where(n_ok, offs_n, N - 1).to(tl.int64)
        a_ptrs = a_ptr
        b_ptrs = b_ptr
        if not USE_TMA:
            a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :]
            b_ptrs = b_ptr + rn[:, None] * stride_bn + offs_k[None, :]
        as_ptrs = as_ptr + rm * stride_asm
        if BLOCK_N <= BLOCK_K:  # the tile's weight-scale column is one scalar per K block
            bs_ptrs = bs_ptr + (pid_n * BLOCK_N // BLOCK_K) * stride_bsn
        else:
            bs_ptrs = bs_ptr + (rn // BLOCK_K) * stride_bsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            s = _load_scale(as_ptrs, bs_ptrs, kb, stride_ask, BLOCK_N, BLOCK_K)
            a, b = _load_operands(a_ptr, b_ptr, a_ptrs, b_ptrs, kb, pid_m, pid_n, K,
                                  BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA)
            acc = acc + _block_dot(a, b, EMULATE) * s
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _tile_of(t, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Output tile t -> (pid_m, pid_n), grouped GROUP_M row tiles at a time (L2 reuse)."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_n
        first_m = (t // group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (t % group) % size_m, (t % group) // size_m

    @triton.jit
    def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr,
                         M, N, K, stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_cm,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                         USE_TMA: tl.constexpr, EMULATE: tl.constexpr):
        pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _fp8_tile(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, pid_m, pid_n,
                  M, N, K, stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_cm,
                  HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, EMULATE)


# (N, K, device index) -> whether small_m_config(N, K) computed the large tiles' bits there
_SMALL_M_OK: dict[tuple[int, int, int], bool] = {}


def small_m_tiles_verified(N: int, K: int, device: torch.device) -> bool:
    """Whether the small-M tiles may serve weight shape [N, K] on `device`: decided once, by
    a probe GEMM (random operands, SMALL_M_MAX rows, with a bias) through both tile configs,
    compared bit for bit. Decided False, and never probed, when first asked inside a CUDA
    graph capture (no probe can run there); later calls keep the first answer, so the eager
    and the captured forward always pick the same tiles."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (N, K, idx)
    if key not in _SMALL_M_OK:
        if torch.cuda.is_current_stream_capturing():
            _SMALL_M_OK[key] = False
        else:
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(SMALL_M_MAX, K, device=device, generator=g, dtype=torch.bfloat16)
            w = torch.randn(N, K, device=device, generator=g, dtype=torch.bfloat16)
            bias = torch.randn(N, device=device, generator=g, dtype=torch.bfloat16)
            xq, xs = quantize_act_device(x)
            from vllm.kernels.fp8 import quantize_weight
            wq, ws = quantize_weight(w)
            small = fp8_gemm_triton(xq, xs, wq, ws, bias, torch.bfloat16, config=small_m_config(N, K))
            large = fp8_gemm_triton(xq, xs, wq, ws, bias, torch.bfloat16, config=gemm_config(N, K))
            _SMALL_M_OK[key] = torch.equal(small.view(torch.int16), large.view(torch.int16))
    return _SMALL_M_OK[key]


def small_m_config(N: int, K: int) -> dict:
    """The decode tiles for weight shape [N, K] (per shape or GEMM_CONFIG_SMALL_M)."""
    return GEMM_CONFIG_SMALL_M_BY_SHAPE.get((N, K), GEMM_CONFIG_SMALL_M)


def gemm_config(N: int, K: int, M: int | None = None, device: torch.device | None = None) -> dict:
    """The tiles for weight shape [N, K] at M rows: the large tiles (per shape or GEMM_CONFIG),
    or for M <= SMALL_M_MAX the small-M tiles where they are verified bit-identical."""
    if M is not None and M <= SMALL_M_MAX and device is not None and small_m_tiles_verified(N, K, device):
        return small_m_config(N, K)
    return GEMM_CONFIG_BY_SHAPE.get((N, K), GEMM_CONFIG)


def fp8_gemm_triton(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """The CUDA kernel (CPU tensors under TRITON_INTERPRET=1 in tests). `config`: tile
    override for the benchmark's sweep; the engine always runs gemm_config(N, K, M).
    xs may have any strides."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    M, K = xq.shape
    N = wq.shape[0]
    if wq.shape[1] != K or xs.shape != (M, -(-K // BLOCK)) or ws.shape != (-(-N // BLOCK), -(-K // BLOCK)):
        raise ValueError("fp8_gemm: xq [M, K], xs [M, K/128], wq [N, K], ws [N/128, K/128]")
    xq, wq = xq.contiguous(), wq.contiguous()
    xs, ws = xs.float(), ws.float().contiguous()
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    emulate = _INTERPRET or not xq.is_cuda
    cfg = dict(config or (INTERPRET_CONFIG if emulate else gemm_config(N, K, M, xq.device)))
    if cfg["BLOCK_N"] % BLOCK and BLOCK % cfg["BLOCK_N"]:
        raise ValueError("BLOCK_N must divide 128 or be a multiple of it (weight scales per 128 columns)")
    bm, bn = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    use_tma = bool(cfg.pop("TMA", False)) and TensorDescriptor is not None and K % 16 == 0
    a, b = xq, wq
    if use_tma:
        a = TensorDescriptor.from_tensor(xq, [bm, BLOCK])
        b = TensorDescriptor.from_tensor(wq, [bn, BLOCK])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    args = (a, xs, b, ws, bias if bias is not None else ws, out,
            M, N, K, xq.stride(0), xs.stride(0), xs.stride(1), wq.stride(0), ws.stride(0), out.stride(0))
    meta = dict(HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, GROUP_M=cfg.pop("GROUP_M"),
                EVEN_K=K % BLOCK == 0, USE_TMA=use_tma, EMULATE=emulate)
    _fp8_gemm_kernel[(tiles,)](*args, **meta, **cfg, enable_fp_fusion=True)
    return out


# (N, K, device index) -> whether cuBLASLt computed the Triton kernel's bits there
_CUBLASLT_OK: dict[tuple[int, int, int], bool] = {}
CUBLASLT_PROBE_MS = (CUBLASLT_MIN_M, 1028)


def cublaslt_verified(N: int, K: int, device: torch.device) -> bool:
    """Whether cuBLASLt may serve weight shape [N, K] on `device`: decided once, by probe
    GEMMs (random operands at CUBLASLT_PROBE_MS rows) through cuBLASLt and through the
    Triton kernel, compared bit for bit. False when cuBLAS refuses the problem (no
    block-scaled FP8 on this GPU or library) and, never probed, when first asked inside a
    CUDA graph capture; later calls keep the first answer, so the eager and the captured
    forward pick the same kernel."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (N, K, idx)
    if key not in _CUBLASLT_OK:
        ok = False
        if not torch.cuda.is_current_stream_capturing() and N % BLOCK == 0 and K % BLOCK == 0:
            from vllm.kernels.fp8 import quantize_weight
            g = torch.Generator(device=device).manual_seed(0)
            wq, ws = quantize_weight(torch.randn(N, K, device=device, generator=g, dtype=torch.bfloat16))
            try:
                ok = True
                for m in CUBLASLT_PROBE_MS:
                    x = torch.randn(m, K, device=device, generator=g, dtype=torch.bfloat16)
                    xq, xs = quantize_act_triton(x, m_major=True)
                    lt = fp8_cublaslt.fp8_gemm_cublaslt(xq, xs, wq, ws, torch.bfloat16)
                    tri = fp8_gemm_triton(xq, xs, wq, ws, None, torch.bfloat16, config=gemm_config(N, K))
                    ok &= torch.equal(lt.view(torch.int16), tri.view(torch.int16))
            except (fp8_cublaslt.CublasLtError, OSError, AttributeError):
                ok = False  # no cuBLASLt, or one without block-scaled FP8 for this shape or GPU
        _CUBLASLT_OK[key] = ok
    return _CUBLASLT_OK[key]


def cublaslt_serves(M: int, wq: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> bool:
    """Whether an M-row product with weight wq [N, K] runs on cuBLASLt."""
    N, K = wq.shape
    return (M >= CUBLASLT_MIN_M and HAS_TRITON and fp8_cublaslt.takes(N, K, wq, bias, out_dtype)
            and cublaslt_verified(N, K, wq.device))


# ---- the op the linear layer calls: quantize the activations, then one of the GEMMs -------
def quantize_act_device(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_act's values: the fused Triton kernel on CUDA, the torch ops elsewhere.
    Scale layout by M, from the graph-timed table: decode-sized batches (the small-M tiles)
    read row-major scales faster (down at M=16: 29 vs 48 us), larger ones M-contiguous
    (gate_up at M=8192: 2,087 vs 2,306 us). A layout, not a value: the same bits."""
    if x2.is_cuda and HAS_TRITON:
        return quantize_act_triton(x2, m_major=x2.shape[0] > SMALL_M_MAX)
    return quantize_act(x2)


def _linear(gemm):
    def fp8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_act_device(x2)
        return gemm(xq, xs, wq, ws, bias, x.dtype).reshape(*x.shape[:-1], wq.shape[0])
    fp8_linear.__name__ = fp8_linear.__qualname__ = f"fp8_linear[{gemm.__name__}]"
    fp8_linear.gemm = gemm
    return fp8_linear


fp8_linear_triton = _linear(fp8_gemm_triton)
fp8_linear_rows = _linear(fp8_gemm_rows)
fp8_linear_dequant = _linear(fp8_gemm_dequant)


def fp8_linear_cuda(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
                    allow_cublaslt: bool = True) -> torch.Tensor:
    """The CUDA layer op: cuBLASLt where `cublaslt_serves` (activations quantized into rows
    padded to cuBLAS's row multiple, scales M-contiguous; the padding rows are dropped),
    else the Triton kernel. allow_cublaslt: KernelConfig.gemm_cublaslt."""
    x2 = x.reshape(-1, x.shape[-1])
    M, N = x2.shape[0], wq.shape[0]
    if not (allow_cublaslt and cublaslt_serves(M, wq, bias, x.dtype)):
        return fp8_linear_triton(x, wq, ws, bias)
    rows = -(-M // fp8_cublaslt.ROW_MULTIPLE) * fp8_cublaslt.ROW_MULTIPLE
    xq, xs = quantize_act_triton(x2, m_major=True, rows=rows)
    return fp8_cublaslt.fp8_gemm_cublaslt(xq, xs, wq, ws, x.dtype)[:M].reshape(*x.shape[:-1], N)


class FP8LinearFn(torch.autograd.Function):
    """Forward: the deployment kernel on the quantized operands. Backward: the straight-
    through estimator, gradients of the model-dtype matmul of the DEQUANTIZED operands:
    dx = dy @ deq(w), dw = dy^T deq(x), db = sum(dy). `weight` (the master) only receives
    dw; the fp8 copy (wq, ws) is what the forward used."""

    @staticmethod
    def forward(ctx, x, weight, wq, ws, bias, fwd):
        ctx.save_for_backward(x, wq, ws)
        ctx.has_bias = bias is not None
        ctx.w_dtype = weight.dtype
        return fwd(x, wq, ws, bias)

    @staticmethod
    def backward(ctx, dy):
        x, wq, ws = ctx.saved_tensors
        acc = dy.dtype if dy.dtype in (torch.bfloat16, torch.float16, torch.float64) else torch.float32
        x2 = x.reshape(-1, x.shape[-1])
        dy2 = dy.reshape(-1, dy.shape[-1]).to(acc)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ dequantize_weight(wq, ws, acc)).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            xq, xs = quantize_act_device(x2)
            dw = (dy2.t() @ dequantize_act(xq, xs, acc)).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[4]:
            db = dy2.sum(0).to(ctx.w_dtype)
        return dx, dw, None, None, db, None
