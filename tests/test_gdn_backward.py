"""Gated DeltaNet's fused training backward (vllm/kernels/gdn_backward.py) against float64
autograd of the reference it differentiates (gdn_reference), in the Triton interpreter on CPU."""
from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

from vllm.kernels.chunk_scan import reference_grads
from vllm.kernels.gdn_backward import gdn_backward_triton
from vllm.kernels.gdn_chunk import gdn_reference
from vllm.testing.chunked_scan import DEVICE as DEV, rel_err


def make(T, hk, hv, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, hk, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(T, hk, K, generator=gen), dim=-1)
    v = torch.randn(T, hv, V, generator=gen)
    g = -0.6 * torch.rand(T, hv, generator=gen)
    beta = torch.rand(T, hv, generator=gen)
    do = torch.randn(T, hv, V, generator=gen)
    return (q, k, v, g, beta), do


# (lens, Hk, Hv, K, V, C): grouped heads, sequences ending mid-chunk, padded tiles (C, K, V
# below their power-of-two tiles); K = 40 in a 64-wide K tile, the final w / u kernel's second
# K block partly padding
CASES = [([21, 9], 2, 4, 16, 32, 16), ([37], 1, 1, 12, 20, 8), ([5, 16, 3], 1, 2, 16, 16, 16),
         ([19, 14], 1, 2, 40, 24, 16)]


@pytest.mark.parametrize("case", CASES)
def test_matches_float64_autograd_of_the_reference(case):
    lens, hk, hv, K, V, C = case
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    xs, do = make(cu[-1], hk, hv, K, V, seed=sum(lens) + K)
    scale = K ** -0.5
    ref = reference_grads(lambda *a: gdn_reference(*a, cu, scale, chunk_size=C),
                          [x.double() for x in xs], [True] * 5, do.double())
    got = gdn_backward_triton(*(x.to(DEV) for x in xs), do.to(DEV), cu, scale, chunk_size=C)
    for name, a, b, x in zip("q k v g beta".split(), got, ref, xs):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        assert rel_err(a.cpu(), b) < 1e-5, name


def test_strong_decay_with_a_chunk_of_padded_rows():
    """C = 12 (a 16-row tile: four pad rows) and log decays down to -24 a step: a pad row's
    exp(gamma_i - gamma_j) would overflow and turn every gradient to NaN if it took part."""
    cu = [0, 30]
    xs, do = make(30, 1, 2, 16, 16, seed=11)
    xs = (xs[0], xs[1], xs[2], xs[3] * 40.0, xs[4])
    ref = reference_grads(lambda *a: gdn_reference(*a, cu, 0.25, chunk_size=12), [x.double() for x in xs],
                          [True] * 5, do.double())
    got = gdn_backward_triton(*(x.to(DEV) for x in xs), do.to(DEV), cu, 0.25, chunk_size=12)
    for name, a, b in zip("q k v g beta".split(), got, ref):
        assert torch.isfinite(a).all(), name
        assert rel_err(a.cpu(), b) < 1e-5, name


@pytest.mark.parametrize("hk,hv", [(2, 4), (2, 2)])   # grouped (float32 sums of dq, dk) and not (stored as bf16)
def test_bfloat16_inputs_take_bf16_dots(hk, hv):
    """bfloat16 inputs (the trainer's) take the dots with operands rounded to bfloat16
    (training_tiles.mm, emulated here as the GPU computes them): within 1e-2 of float64
    autograd of the same rounded inputs (3e-3 measured; rounding the float32 reference's
    gradients to bf16 alone is 1.7e-3), and not the float32 dots' result."""
    from vllm.kernels import training_tiles
    cu = [0, 21, 30]
    xs, do = make(30, hk, hv, 16, 32, seed=0)
    xs, do = [x.bfloat16() for x in xs], do.bfloat16()
    assert training_tiles.dot_precision(xs[0].to(DEV)) in ("bf16", "bf16_emulated")
    ref = reference_grads(lambda *a: gdn_reference(*a, cu, 0.25, chunk_size=16), [x.double() for x in xs],
                          [True] * 5, do.double())
    got = gdn_backward_triton(*(x.to(DEV) for x in xs), do.to(DEV), cu, 0.25, chunk_size=16)
    f32 = gdn_backward_triton(*(x.float().to(DEV) for x in xs), do.float().to(DEV), cu, 0.25, chunk_size=16)
    for name, a, b, c in zip("q k v g beta".split(), got, ref, f32):
        assert a.dtype == torch.bfloat16, name
        assert rel_err(a.float().cpu(), b) < 1e-2, name
        assert not torch.equal(a, c.to(a.dtype)), name


@pytest.mark.parametrize("hk,hv", [(2, 4), (2, 2)])
def test_bf16_dots_pass_bfloat16_between_the_kernels(hk, hv, monkeypatch):
    """With bf16 dots, u, w, kd, v_new and the states pass between the kernels in bfloat16 (as
    fla's backward passes them; the gradients' distance from float64 is
    test_bfloat16_inputs_take_bf16_dots'); float32 inputs (3xTF32 / ieee dots) keep float32,
    and so do bf16 dots at a K or V whose bfloat16 rows would not be 16-byte aligned."""
    from vllm.kernels import gdn_backward
    seen = []
    real = gdn_backward.recurrence_forward_triton

    def spy(u, w, kd, e, prec, vn_dtype=torch.float32, states_dtype=torch.float32):
        seen.append((u.dtype, w.dtype, kd.dtype, vn_dtype, states_dtype))
        return real(u, w, kd, e, prec, vn_dtype=vn_dtype, states_dtype=states_dtype)
    monkeypatch.setattr(gdn_backward, "recurrence_forward_triton", spy)
    cu = [0, 21, 30]
    xs, do = make(30, hk, hv, 16, 32, seed=0)
    bf = [x.bfloat16().to(DEV) if i < 3 else x.to(DEV) for i, x in enumerate(xs)]
    gdn_backward_triton(*bf, do.bfloat16().to(DEV), cu, 0.25, chunk_size=16)
    gdn_backward_triton(*(x.float() for x in bf), do.float().to(DEV), cu, 0.25, chunk_size=16)
    assert seen == [(torch.bfloat16,) * 5, (torch.float32,) * 5]
    assert gdn_backward.bf16_between_kernels("bf16", 16, 32) and not gdn_backward.bf16_between_kernels("bf16", 12, 32)
    assert not gdn_backward.bf16_between_kernels("tf32x3", 128, 128)


@pytest.mark.parametrize("hk,hv", [(2, 4), (2, 2)])
def test_du_in_bfloat16_gives_the_same_gradients(hk, hv, monkeypatch):
    """With bf16 dots the recurrence walk's du passes to the final kernels in bfloat16: every
    use is a dot operand, rounded so anyway, so all five gradients keep their bits against du
    in float32."""
    from vllm.kernels import gdn_backward
    cu = [0, 21, 30]
    xs, do = make(30, hk, hv, 16, 32, seed=3)
    bf = [x.bfloat16().to(DEV) if i < 3 else x.to(DEV) for i, x in enumerate(xs)]
    got = gdn_backward_triton(*bf, do.bfloat16().to(DEV), cu, 0.25, chunk_size=16)
    real, dtypes = gdn_backward._du_dtype, []

    def float32_du(between):
        dtypes.append(real(between))
        return torch.float32
    monkeypatch.setattr(gdn_backward, "_du_dtype", float32_du)
    ref = gdn_backward_triton(*bf, do.bfloat16().to(DEV), cu, 0.25, chunk_size=16)
    assert dtypes == [torch.bfloat16]
    for name, a, b in zip("q k v g beta".split(), got, ref):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32)), name


@pytest.mark.parametrize("saved", [False, True])
def test_prep_column_blocks_give_the_same_gradients(saved, monkeypatch):
    """The prep writes w, u and kd a block of columns at a time (PREP_COLUMNS): their dots
    contract over the chunk's rows, so every width gives the same bits, with T built or
    saved. V = 96 leaves a 64-wide block half past V (its column mask)."""
    from vllm.kernels import gdn_backward
    cu, C = [0, 21, 30], 16
    xs, do = make(30, 1, 2, 64, 96, seed=4)
    bf = [x.bfloat16().to(DEV) if i < 3 else x.to(DEV) for i, x in enumerate(xs)]
    extra = ()
    if saved:  # any unit lower T per chunk (2 + 1 chunks): the widths must agree on it
        gen = torch.Generator().manual_seed(5)
        t = torch.eye(C) + 0.1 * torch.randn(3, 2, C, C, generator=gen).tril(-1)
        extra = (t.bfloat16().to(DEV), torch.tensor([0, 2, 3], dtype=torch.int32, device=DEV))
    grads = {}
    for width in (32, 64, 128):
        monkeypatch.setattr(gdn_backward, "PREP_COLUMNS", {p: {"prep": width, "prep_t_saved": width}
                                                           for p in ("bf16", "tf32x3")})
        grads[width] = gdn_backward_triton(*bf, do.bfloat16().to(DEV), cu, 0.25, C, *extra)
    for width in (32, 64):
        for name, a, b in zip("q k v g beta".split(), grads[width], grads[128]):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32)), (width, name)


def test_refuses_cu_seqlens_that_do_not_cover_the_tokens():
    """The gradients are written in place, row by row of each sequence: sequences that miss
    tokens (or do not start at 0) would leave rows unwritten, so they are refused."""
    xs, do = make(10, 1, 1, 8, 8, seed=0)
    for cu in ([0, 8], [2, 10], [0, 6, 4, 10]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            gdn_backward_triton(*(x.to(DEV) for x in xs), do.to(DEV), cu, 1.0, chunk_size=4)


def test_refuses_unaligned_head_dims():
    xs, do = make(4, 1, 1, 6, 8, seed=0)
    with pytest.raises(ValueError, match="multiples of 4"):
        gdn_backward_triton(*(x.to(DEV) for x in xs), do.to(DEV), [0, 4], 1.0, chunk_size=4)
    xs, do = make(4, 1, 1, 8, 8, seed=0)
    with pytest.raises(ValueError, match="at most 64 rows"):
        gdn_backward_triton(*(x.to(DEV) for x in xs), do.to(DEV), [0, 4], 1.0, chunk_size=128)


REAL_DIMS_CU = [0, 1000, 1700]


def _real_dims_case(dtype):
    """Qwen3-Next's head dims (16 / 32 heads of 128, chunk 64), two sequences ending mid-chunk,
    on the GPU: q, k, v and do in dtype (g, beta float32, as the layer passes them)."""
    xs, do = make(REAL_DIMS_CU[-1], 16, 32, 128, 128, seed=5)
    return [x.cuda().to(dtype) if i < 3 else x.cuda() for i, x in enumerate(xs)], do.cuda().to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_real_dims_match_the_reference_backward(dtype):
    """_real_dims_case: the fused kernels against float64 autograd of the reference. float32
    inputs (3xTF32 dots): within 1e-4 (every gradient float32, no rounding to hide behind);
    bf16 inputs as the layer passes them (bf16 dots, bfloat16 between the kernels): within
    1e-2 (float32 g and beta included, whose gradients the bf16 dots feed)."""
    cu, scale = REAL_DIMS_CU, 128 ** -0.5
    xs, do = _real_dims_case(dtype)
    ref64 = reference_grads(lambda *a: gdn_reference(*a, cu, scale), [x.double() for x in xs], [True] * 5,
                            do.double())
    got = gdn_backward_triton(*xs, do, cu, scale)
    if dtype == torch.float32:
        for name, a, c in zip("q k v g beta".split(), got, ref64):
            assert rel_err(a.cpu(), c.cpu()) < 1e-4, name
        return
    for name, a, x, c in zip("q k v g beta".split(), got, xs, ref64):
        assert a.dtype == x.dtype, name
        assert rel_err(a.float().cpu(), c.cpu()) < 1e-2, name


@pytest.mark.parametrize("G", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_head_group_sum(G, dtype):
    """The key heads' gradients: each the sum of its G value heads' (float32), rounded once to
    the inputs' dtype to nearest. At G = 2 that is the one add torch's sum makes, so the bits
    are torch's; at G = 3 left to right (g0 + g1) + g2."""
    from vllm.kernels.gdn_backward import _group_sum
    gen = torch.Generator().manual_seed(G)
    x = torch.randn(37, 3 * G, 20, generator=gen).to(DEV)
    out = _group_sum(x, G, dtype)
    assert out.shape == (37, 3, 20) and out.dtype == dtype
    parts = x.view(37, 3, G, 20).unbind(2)
    want = parts[0]
    for p in parts[1:]:
        want = want + p
    want = want.to(dtype)  # torch's cast rounds to nearest even
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), want.view(bits))
    if G == 2:
        assert torch.equal(out.view(bits), x.view(37, 3, G, 20).sum(2).to(dtype).view(bits))
    assert _group_sum(x[:0], G, dtype).shape == (0, 3, 20)


@pytest.mark.parametrize("in_walk", [True, False], ids=["in_walk", "output_grad_kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_walk_forms_match_float64(in_walk, dtype, monkeypatch):
    """The recurrence's backward walk taking the gradients reaching the outputs itself (q, k,
    do and gamma per V tile; bf16 dots' form) or reading the output-gradient kernel's (3xTF32's
    form): each within float64's tolerance, at V tiles of 32 over V = 64 (two walks per head)
    and grouped heads with sequences ending mid-chunk."""
    from vllm.kernels import gdn_backward
    monkeypatch.setattr(gdn_backward, "OUTPUT_GRADS_IN_WALK", {"bf16": in_walk, "tf32x3": in_walk})
    monkeypatch.setattr(gdn_backward, "WALK_CONFIG", {"bf16": (32, 4, 2), "tf32x3": (32, 4, 2)})
    cu = [0, 45, 70]
    xs, do = make(70, 1, 2, 32, 64, seed=9)
    xs = [x.to(dtype) if i < 3 else x for i, x in enumerate(xs)]
    do = do.to(dtype)
    ref = reference_grads(lambda *a: gdn_reference(*a, cu, 32 ** -0.5, chunk_size=32), [x.double() for x in xs],
                          [True] * 5, do.double())
    got = gdn_backward_triton(*(x.to(DEV) for x in xs), do.to(DEV), cu, 32 ** -0.5, chunk_size=32)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, b in zip("q k v g beta".split(), got, ref):
        assert rel_err(a.double().cpu(), b) < tol, name
