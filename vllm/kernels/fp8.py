"""FP8 (e4m3fn) quantization rules: the one definition of every FP8 number the engine stores.

Three rules, each a scale per group of elements with an FP32 scale and round-to-nearest-even
through torch's cast (values are clamped to +-448 first, so the cast never overflows):

* KV cache (`quantize_kv`): one scale per (token, kv head) over head_dim;
  scale = amax(|x|) / 448 (1.0 for an all-zero row), q = fp8(clamp(x / scale)).
* Activations (`quantize_act`): one scale per token per 128 input channels (DeepSeek-V3).
* Weights (`quantize_weight`): one scale per 128 x 128 block of [N, K].

Dequantization is always `(q.float() * scale)` rounded once to the target dtype: an
elementwise formula, so any kernel that loads q and the scale and applies it (the attention
kernel does, per tile) computes the same bits as this file does on a whole tensor.

Every function is elementwise per group (a max, a division, a cast): the bits of a group do
not depend on how many other rows or tokens are in the tensor. `*_ref` are float64
references for tests.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128  # activation group width and weight block side

KV_RULE = {"format": "float8_e4m3fn", "scale": "per token per kv head over head_dim, float32",
           "scale_formula": "amax(|x|) / 448, IEEE float32 division on every device (1 for an all-zero row)",
           "rounding": "x / scale clamped to +-448, round-to-nearest-even cast",
           "dequantize": "fp8 -> float32, * scale (float32 multiply), one rounding to the model dtype",
           "read": "the step's blocks dequantized into a model-dtype copy, then the model-dtype attention kernel"}
LINEAR_RULE = {"format": "float8_e4m3fn", "activations": "per token per 128 input channels, float32 scale",
               "weights": "per 128 x 128 block, float32 scale", "scale_formula": "amax(|x|) / 448, IEEE float32 division on every device (1 for all-zero)",
               "rounding": "round-to-nearest-even cast after clamp to +-448",
               "gemm": "per 128-wide K block: fp32 dot of fp8 operands, * (act scale * weight scale), "
                       "added to one fp32 accumulator in ascending K blocks; output rounded once",
               "backward": "straight-through: gradients of the bf16 matmul of the dequantized operands"}


def _scale(amax: torch.Tensor) -> torch.Tensor:
    # The divisor is a tensor on amax's device, never a Python number: torch on CUDA turns
    # `tensor / python_scalar` into `tensor * (1 / scalar)` (one bit off for some amax, as
    # 1/448 is inexact), while the CPU divides. A tensor divisor is an IEEE division on
    # every device, which is what the Triton quantization (div_rn) computes too.
    return torch.where(amax > 0, amax / amax.new_full((), FP8_MAX), torch.ones_like(amax))


def _cast(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# ---- KV cache: per token per head -------------------------------------------------------
def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 [..., D], float32 scale [...])."""
    xf = x.float()
    scale = _scale(xf.abs().amax(-1))
    return _cast(xf / scale[..., None]), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


def kv_round_trip(x: torch.Tensor) -> torch.Tensor:
    """The values the attention reads back for K/V x written into an FP8 cache (x's dtype)."""
    q, s = quantize_kv(x)
    return dequantize_kv(q, s, x.dtype)


class _RoundTripSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return kv_round_trip(x)

    @staticmethod
    def backward(ctx, g):
        return g


def kv_round_trip_ste(x: torch.Tensor) -> torch.Tensor:
    """kv_round_trip with a straight-through gradient (the trainer's private FP8 copy)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RoundTripSTE.apply(x)
    return kv_round_trip(x)


# ---- linear layers: activations per token x 128, weights per 128 x 128 --------------------
def _pad_to(x: torch.Tensor, dim: int, mult: int) -> torch.Tensor:
    n = x.shape[dim]
    pad = -n % mult
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim)


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scale [M, ceil(K/128)]). Zero padding of the last
    group never changes its amax."""
    M, K = x.shape
    xf = _pad_to(x.float(), 1, BLOCK).view(M, -1, BLOCK)
    scale = _scale(xf.abs().amax(-1))
    q = _cast(xf / scale[..., None]).view(M, -1)[:, :K]
    return q.contiguous(), scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], float32 scale [ceil(N/128), ceil(K/128)])."""
    N, K = w.shape
    wf = _pad_to(_pad_to(w.float(), 0, BLOCK), 1, BLOCK)
    nb, kb = wf.shape[0] // BLOCK, wf.shape[1] // BLOCK
    blocks = wf.view(nb, BLOCK, kb, BLOCK)
    scale = _scale(blocks.abs().amax(dim=(1, 3)))
    q = _cast(blocks / scale[:, None, :, None]).view(nb * BLOCK, kb * BLOCK)[:N, :K]
    return q.contiguous(), scale


def dequantize_act(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    K = q.shape[1]
    return (q.float() * scale.repeat_interleave(BLOCK, 1)[:, :K]).to(dtype)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    N, K = q.shape
    s = scale.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return (q.float() * s).to(dtype)


# ---- float64 references (tests) --------------------------------------------------------
def fp8_round_ref(x: torch.Tensor) -> torch.Tensor:
    """Round float64 x (|x| <= 448) to the nearest e4m3fn value, ties to even, in float64:
    independent of torch's cast (explicit exponent / mantissa arithmetic)."""
    x = x.double()
    a = x.abs()
    # e4m3fn: 3 mantissa bits, min normal 2^-6, subnormal step 2^-9
    e = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a)))).clamp(min=-6)
    step = torch.pow(2.0, e - 3)
    r = a / step
    fl = torch.floor(r)
    frac = r - fl
    up = (frac > 0.5) | ((frac == 0.5) & (torch.remainder(fl, 2) == 1))
    out = (fl + up.double()) * step
    return torch.copysign(out.clamp(max=FP8_MAX), x)


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference of quantize_kv: (float64 fp8 values, float64 scale)."""
    amax = x.double().abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return fp8_round_ref((x.double() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)), scale


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 y = x @ w.T of the block-quantized operands (quantized by the rules above
    with float64 scales): what an FP8 GEMM should compute up to float32 summation error."""
    xq, xs = quantize_act(x)
    wq, ws = quantize_weight(w)
    xd = xq.double() * xs.double().repeat_interleave(BLOCK, 1)[:, :x.shape[1]]
    wd = wq.double() * ws.double().repeat_interleave(BLOCK, 0)[:w.shape[0]].repeat_interleave(BLOCK, 1)[:, :w.shape[1]]
    y = xd @ wd.T
    return y if bias is None else y + bias.double()
