"""The fused Triton activation quantization (vllm/kernels/fp8_quant.py) against the torch
rule it implements (vllm/kernels/fp8.quantize_act): identical fp8 bytes and float32 scales,
run under TRITON_INTERPRET=1 on CPU and on the GPU."""
from __future__ import annotations

import pytest
import torch

from vllm.kernels import fp8
from vllm.kernels.fp8_quant import quantize_act_triton


def _same(x):
    qr, sr = fp8.quantize_act(x)
    for m_major in (True, False):  # both scale layouts hold the same values
        q, s = quantize_act_triton(x, m_major=m_major)
        assert q.dtype == qr.dtype and q.shape == qr.shape and s.shape == sr.shape
        assert (s.stride(0) == 1) if m_major else s.is_contiguous()
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
        assert torch.equal(s.contiguous().view(torch.int32), sr.contiguous().view(torch.int32))


def _ties():
    """Every e4m3fn value, every midpoint between neighbours (the ties) and points just
    around them, both signs, in rows whose amax is 448 (scale exactly 1)."""
    pos = torch.arange(0, 0x7F, dtype=torch.uint8).view(fp8.FP8_DTYPE).float()
    mid = (pos[:-1] + pos[1:]) / 2
    v = torch.cat([pos, mid, torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, mid + 1)])
    v = torch.cat([v, -v])
    v = torch.cat([v, v.new_zeros(-v.numel() % 127)]).view(-1, 127)
    return torch.cat([v.new_full((v.shape[0], 1), 448.0), v], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_act_triton_bit_identical_to_torch(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=g) * torch.logspace(-6, 3, 300)
    x[3] = 0  # all-zero row: scale 1
    x[5, :128] = 0  # all-zero group
    x[6, 5] = -0.0
    _same(x.to(dtype))
    _same(_ties().to(dtype) if dtype == torch.float32 else _ties()[:, :128].to(dtype))
    _same(x[:1].to(dtype))  # one token (decode)


@pytest.mark.parametrize("m_major", [True, False])
def test_quantize_act_triton_padded_rows(m_major):
    """rows > M (cuBLAS takes row counts of a multiple of 4): the first M rows hold the
    rule's values, the scales' row stride is the padded count, and rows < M is refused."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 300, generator=g).bfloat16()
    qr, sr = fp8.quantize_act(x)
    q, s = quantize_act_triton(x, m_major=m_major, rows=12)
    assert q.shape == (12, 300) and s.shape == (12, 3)
    assert s.stride() == ((1, 12) if m_major else (3, 1))
    assert torch.equal(q[:9].view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s[:9].contiguous().view(torch.int32), sr.view(torch.int32))
    with pytest.raises(ValueError, match="rows"):
        quantize_act_triton(x, rows=8)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(1, 4096), (333, 4096), (2048, 12288), (7, 300)])
def test_gpu_quantize_act_triton_bit_identical_to_torch(M, K):
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", generator=g) * torch.logspace(-4, 2, K, device="cuda")
    _same(x.bfloat16())
    _same(x)
    _same(_ties().cuda())


def _scale_is_ieee_division(device):
    """The rule's scale is amax / 448 rounded once (float64 quotient of float32 operands
    rounds correctly to float32): on CUDA, torch's `tensor / python_number` multiplies by
    the reciprocal instead, which differs in the last bit for some amax."""
    g = torch.Generator(device=device).manual_seed(1)
    amax = (torch.rand(1 << 16, device=device, generator=g) * torch.logspace(-8, 4, 1 << 16, device=device)).float()
    got = fp8._scale(amax)
    want = (amax.double() / fp8.FP8_MAX).float()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # the reciprocal form really differs somewhere in this range, so the test can fail
    assert not torch.equal((amax * (1.0 / fp8.FP8_MAX)).view(torch.int32), want.view(torch.int32))


def test_scale_is_ieee_division():
    _scale_is_ieee_division("cpu")


@pytest.mark.gpu
def test_gpu_scale_is_ieee_division():
    _scale_is_ieee_division("cuda")
