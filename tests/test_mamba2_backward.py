"""Mamba-2's fused training backward (vllm/kernels/mamba2_backward.py) against float64
autograd of the reference it differentiates (mamba2_reference), in the Triton interpreter on CPU."""
from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from vllm.kernels.chunk_scan import reference_grads
from vllm.kernels.mamba2_backward import mamba2_backward_triton
from vllm.kernels.mamba2_chunk import mamba2_reference
from vllm.testing.chunked_scan import DEVICE as DEV, rel_err

DT_MIN = 1e-3


def make(T, h, p, g, n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, p, generator=gen)
    dt = torch.randn(T, h, generator=gen) - 2.0
    B = torch.randn(T, g, n, generator=gen)
    C = torch.randn(T, g, n, generator=gen)
    dt_bias = 0.5 * torch.randn(h, generator=gen)
    A_log = torch.log(0.5 + 4 * torch.rand(h, generator=gen))
    D = torch.randn(h, generator=gen)
    dy = torch.randn(T, h, p, generator=gen)
    return (x, dt, dt_bias, A_log, B, C, D), dy


# (lens, H, P, G, N, chunk): grouped heads, sequences ending mid-chunk, padded tiles, N = 128
CASES = [([21, 9], 4, 16, 2, 16, 16), ([37], 2, 12, 1, 20, 8), ([5, 16, 3], 2, 16, 2, 16, 16),
         ([20, 7], 2, 16, 1, 128, 16),   # N = 128: B, C in column slices, dB / dC in two whole blocks
         ([19, 6], 4, 8, 2, 100, 16),    # N = 100: dB / dC in a block of 64 columns and one of 36, two groups
         ([13], 2, 8, 1, 8, 6)]          # a chunk of 6 rows (not a multiple of 4) in a 16-row tile
NAMES = "x dt dt_bias A_log B C D".split()


@pytest.mark.parametrize("case", CASES)
def test_matches_float64_autograd_of_the_reference(case):
    lens, h, p, g, n, chunk = case
    cu = [0]
    for m in lens:
        cu.append(cu[-1] + m)
    xs, dy = make(cu[-1], h, p, g, n, seed=sum(lens) + p)
    ref = reference_grads(lambda *a: mamba2_reference(*a, DT_MIN, cu, chunk), [t.double() for t in xs],
                          [True] * 7, dy.double())
    got = mamba2_backward_triton(*(t.to(DEV) for t in xs), dy.to(DEV), DT_MIN, cu, chunk)
    for name, a, b, t in zip(NAMES, got, ref, xs):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        assert rel_err(a.cpu(), b) < 1e-5, name


def test_row_blocks_of_the_chunk(monkeypatch):
    """The dx kernel's [C, C] matrices in row blocks (ROW_BLOCK below the chunk's tile: 4 blocks
    of 16 rows at chunk 64), a sequence ending mid-chunk: the same gradients as float64."""
    from vllm.kernels import mamba2_backward
    monkeypatch.setattr(mamba2_backward, "ROW_BLOCK", 16)
    cu = [0, 45, 70]
    xs, dy = make(cu[-1], 4, 16, 2, 16, seed=5)
    ref = reference_grads(lambda *a: mamba2_reference(*a, DT_MIN, cu, 64), [t.double() for t in xs],
                          [True] * 7, dy.double())
    got = mamba2_backward_triton(*(t.to(DEV) for t in xs), dy.to(DEV), DT_MIN, cu, 64)
    for name, a, b in zip(NAMES, got, ref):
        assert rel_err(a.cpu(), b) < 1e-5, name


@pytest.mark.parametrize("width", [80, 70])
def test_row_strided_views_give_the_gradients_of_copies(width):
    """x, B, C, dy as views of one projection row, as the layer passes them: read in place
    where the row stride is a multiple of 16 (80), copied into rows padded to one otherwise
    (70); the same gradients as from contiguous copies either way."""
    from vllm.kernels.chunk_tiles import rows_aligned16
    xs, dy = make(30, 2, 16, 1, 16, seed=9)
    row = torch.zeros(30, width)
    row[:, :32], row[:, 32:48], row[:, 48:64] = xs[0].flatten(1), xs[4][:, 0], xs[5][:, 0]
    row = row.to(DEV)
    dyrow = torch.zeros(30, width, device=DEV)
    dyrow[:, :32] = dy.flatten(1).to(DEV)
    views = list(t.to(DEV) for t in xs)
    views[0], views[4], views[5] = row[:, :32].view(30, 2, 16), row[:, 32:48].view(30, 1, 16), \
        row[:, 48:64].view(30, 1, 16)
    dyv = dyrow[:, :32].view(30, 2, 16)
    for t in (views[0], views[4], views[5], dyv):
        got = rows_aligned16(t)
        assert (got is t) == (width % 16 == 0) and got.stride(0) % 16 == 0 and torch.equal(got, t)
    got = mamba2_backward_triton(*views, dyv, DT_MIN, [0, 21, 30], 16)
    want = mamba2_backward_triton(*(t.to(DEV) for t in xs), dy.to(DEV), DT_MIN, [0, 21, 30], 16)
    for name, a, b in zip(NAMES, got, want):
        assert a.is_contiguous() and torch.equal(a, b), name


def test_strong_decay_with_a_chunk_of_padded_rows():
    """chunk 12 (a 16-row tile: four pad rows) and A down to -245: a pad row's
    exp(gamma_i - gamma_j) would overflow and turn every gradient to NaN if it took part."""
    xs, dy = make(30, 2, 16, 1, 16, seed=12)
    xs = list(xs)
    xs[3] = xs[3] + 4.0
    ref = reference_grads(lambda *a: mamba2_reference(*a, DT_MIN, [0, 30], 12), [t.double() for t in xs],
                          [True] * 7, dy.double())
    ref32 = reference_grads(lambda *a: mamba2_reference(*a, DT_MIN, [0, 30], 12), xs, [True] * 7, dy)
    got = mamba2_backward_triton(*(t.to(DEV) for t in xs), dy.to(DEV), DT_MIN, [0, 30], 12)
    for name, a, b, c in zip(NAMES, got, ref, ref32):
        assert torch.isfinite(a).all(), name
        # float32 cancellation at these decays sets the floor (dA_log: 5.5e-6 in float32 torch)
        assert rel_err(a.cpu(), b) < max(1e-5, 4 * rel_err(c, b)), name


def test_clamped_steps_pass_no_gradient():
    """Steps below dt_min are clamped: their dt gets no gradient (as autograd's clamp)."""
    xs, dy = make(20, 2, 16, 1, 16, seed=3)
    xs = list(xs)
    xs[1] = xs[1] - 30.0                            # softplus far below dt_min everywhere
    ref = reference_grads(lambda *a: mamba2_reference(*a, 0.05, [0, 20], 16), [t.double() for t in xs],
                          [True] * 7, dy.double())
    got = mamba2_backward_triton(*(t.to(DEV) for t in xs), dy.to(DEV), 0.05, [0, 20], 16)
    assert torch.count_nonzero(got[1]) == 0 and torch.count_nonzero(ref[1]) == 0
    assert rel_err(got[3].cpu(), ref[3]) < 1e-5


@pytest.mark.parametrize("h,g", [(4, 2), (2, 2)])   # heads sharing a group's B, C (float32 sums) and not
def test_bfloat16_inputs_take_bf16_dots(h, g):
    """bfloat16 x, B, C, dy (the trainer's) take the dots with operands rounded to bfloat16
    (training_tiles.mm, emulated here as the GPU computes them): within 1e-2 of float64
    autograd of the same rounded inputs, and not the float32 dots' result."""
    from vllm.kernels import training_tiles
    cu = [0, 21, 30]
    xs, dy = make(30, h, 16, g, 16, seed=0)
    xs = [t.bfloat16() if i in (0, 4, 5) else t for i, t in enumerate(xs)]
    dy = dy.bfloat16()
    assert training_tiles.dot_precision(xs[0].to(DEV)) in ("bf16", "bf16_emulated")
    ref = reference_grads(lambda *a: mamba2_reference(*a, DT_MIN, cu, 16), [t.double() for t in xs], [True] * 7,
                          dy.double())
    got = mamba2_backward_triton(*(t.to(DEV) for t in xs), dy.to(DEV), DT_MIN, cu, 16)
    f32 = mamba2_backward_triton(*(t.float().to(DEV) for t in xs), dy.float().to(DEV), DT_MIN, cu, 16)
    for name, a, b in zip(NAMES, got, ref):
        assert rel_err(a.float().cpu(), b) < 1e-2, name
    assert not torch.equal(got[0], f32[0].to(got[0].dtype))


def test_refuses_cu_seqlens_that_do_not_cover_the_tokens():
    xs, dy = make(10, 1, 8, 1, 8, seed=0)
    for cu in ([0, 8], [2, 10]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            mamba2_backward_triton(*(t.to(DEV) for t in xs), dy.to(DEV), DT_MIN, cu, 4)


def test_refuses_unaligned_dims():
    xs, dy = make(4, 1, 6, 1, 8, seed=0)
    with pytest.raises(ValueError, match="multiples of 4"):
        mamba2_backward_triton(*(t.to(DEV) for t in xs), dy.to(DEV), DT_MIN, [0, 4], 4)
    xs, dy = make(4, 1, 8, 1, 8, seed=0)
    with pytest.raises(ValueError, match="at most 128 rows"):
        mamba2_backward_triton(*(t.to(DEV) for t in xs), dy.to(DEV), DT_MIN, [0, 4], 256)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_real_dims_match_the_reference_backward(dtype):
    """NemotronH's mixer dims (128 heads of 64, 8 groups, d_state 128, chunk 128), two
    sequences ending mid-chunk: the fused kernels against float64 autograd of the reference.
    float32 inputs (3xTF32 dots): within 1e-4; bf16 inputs as the layer passes them (bf16
    dots): within 1e-2 (float32 dt, dt_bias, A_log and D included)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cu = [0, 900, 1500]
    xs, dy = make(cu[-1], 128, 64, 8, 128, seed=7)
    xs = [t.cuda().to(dtype) if i in (0, 4, 5) else t.cuda() for i, t in enumerate(xs)]
    dy = dy.cuda().to(dtype)
    ref64 = reference_grads(lambda *a: mamba2_reference(*a, DT_MIN, cu, 128), [t.double() for t in xs],
                            [True] * 7, dy.double())
    got = mamba2_backward_triton(*xs, dy, DT_MIN, cu, 128)
    if dtype == torch.float32:
        for name, a, c in zip(NAMES, got, ref64):
            assert rel_err(a.cpu(), c.cpu()) < 1e-4, name
        return
    for name, a, x, c in zip(NAMES, got, xs, ref64):
        assert a.dtype == x.dtype, name
        assert rel_err(a.float().cpu(), c.cpu()) < 1e-2, name
