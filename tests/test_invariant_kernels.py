"""Invariant GEMM and row-wise kernels: float64 references and bit-pattern invariance.

On CPU the Triton kernels run under TRITON_INTERPRET=1 at tiny sizes; the
`gpu` tests repeat the checks at Qwen3-8B shapes on the H200.
"""
from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from vllm.kernels.matmul import GPU_CONFIGS, INTERPRET_CONFIGS, invariant_matmul
from vllm.kernels.rowwise import rms_norm_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("M,K,N", [(1, 40, 24), (5, 64, 48), (33, 70, 17), (17, 16, 100)])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_matches_float64(M, K, N, bias):
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    x = torch.randn(M, K, generator=g).to(DEV)
    w = torch.randn(N, K, generator=g).to(DEV)
    b = torch.randn(N, generator=g).to(DEV) if bias else None
    out = invariant_matmul(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert rel_err(out, ref) < (1e-5 if DEV == "cpu" else 5e-3)


def test_matmul_rows_independent_of_M_and_config():
    g = torch.Generator().manual_seed(0)
    K, N = 80, 48
    x = torch.randn(40, K, generator=g).to(DEV)
    w = torch.randn(N, K, generator=g).to(DEV)
    configs = INTERPRET_CONFIGS if DEV == "cpu" else GPU_CONFIGS
    full = invariant_matmul(x, w)
    for M in (1, 2, 3, 16, 17, 33, 40):
        part = invariant_matmul(x[:M].clone(), w)
        assert torch.equal(bits(part), bits(full[:M])), f"M={M}"
    # every tile configuration gives the same bits
    for _, *cfg in configs:
        out = invariant_matmul(x, w, config=tuple(cfg))
        assert torch.equal(bits(out), bits(full)), cfg


@pytest.mark.gpu
def test_gpu_matmul_row_alone_equals_row_in_batch():
    """A row computed alone (row 0 of its tile) == the same row inside a batch, at any
    position in its tile. GPU only: numpy's matmul, which the Triton interpreter runs for
    tl.dot, rounds a row differently depending on its position inside the tile (CPU
    engines use the row-wise torch path: test_cpu_rowwise_linear_is_position_independent)."""
    g = torch.Generator().manual_seed(0)
    # bf16, the dtype invariant numerics are verified for on the GPU (float32 may take a
    # cuBLASLt entry whose algorithm choice depends on M)
    x = torch.randn(40, 80, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(48, 80, generator=g).to("cuda", torch.bfloat16)
    full = invariant_matmul(x, w)
    for i in (0, 7, 39):
        assert torch.equal(bits(invariant_matmul(x[i:i + 1].clone(), w)), bits(full[i:i + 1])), i


def test_cpu_rowwise_linear_is_position_independent():
    from vllm.kernels.torch_ops import linear_rows as _linear_cpu
    from vllm.kernels.torch_ops import logits_rows as _logits_cpu
    from vllm.kernels.torch_ops import rms_norm_rows as _rms_norm_cpu
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g)
    full = _linear_cpu(x, w, b)
    perm = torch.randperm(37, generator=g)
    assert torch.equal(bits(_linear_cpu(x[perm], w, b)), bits(full[perm]))
    for i in (0, 13, 36):
        assert torch.equal(bits(_linear_cpu(x[i:i + 1], w, b)), bits(full[i:i + 1]))
    assert torch.equal(bits(_logits_cpu(x[perm], w)), bits(_logits_cpu(x, w)[perm]))
    nw = torch.randn(64, generator=g)
    assert torch.equal(bits(_rms_norm_cpu(x[perm], nw, 1e-6)), bits(_rms_norm_cpu(x, nw, 1e-6)[perm]))


def test_cpu_rowwise_linear_and_silu_bits_do_not_depend_on_the_slice():
    """A tensor-parallel rank computes a slice of a column-parallel weight's rows (10 of 80 at
    TP=8 with an intermediate dim of 40) and of the activation's row: every output element must
    have the bits of the whole computation's (the one-row GEMM's column groups, the silu's
    vector path), also with several CPU threads."""
    from vllm.kernels.torch_ops import linear_rows, silu_and_mul_chunked
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g)
    w = torch.randn(80, 64, generator=g)
    full = linear_rows(x, w)
    for n in (10, 5, 3):
        parts = torch.cat([linear_rows(x, w[r:r + n]) for r in range(0, 80, n)], dim=-1)[:, :80]
        assert torch.equal(bits(parts), bits(full)), n
    saved = torch.get_num_threads()
    try:
        for threads in (1, max(2, saved)):
            torch.set_num_threads(threads)
            h = torch.randn(700, 2 * 40, generator=g)
            whole = silu_and_mul_chunked(h)
            gate, up = h.chunk(2, dim=-1)
            for n in (5, 20):   # a rank's slice of the intermediate dim
                for r in range(0, 40, n):
                    part = silu_and_mul_chunked(torch.cat((gate[:, r:r + n], up[:, r:r + n]), dim=-1))
                    assert torch.equal(bits(part), bits(whole[:, r:r + n])), (threads, n, r)
            assert torch.equal(bits(silu_and_mul_chunked(h[3:4])), bits(whole[3:4]))
    finally:
        torch.set_num_threads(saved)


def test_matmul_float32_out_and_empty():
    x = torch.randn(3, 32).to(DEV)
    w = torch.randn(20, 32).to(DEV)
    assert invariant_matmul(x, w, out_dtype=torch.float32).dtype == torch.float32
    assert invariant_matmul(x[:0], w).shape == (0, 20)
    with pytest.raises(ValueError):
        invariant_matmul(x, torch.randn(20, 31).to(DEV))


@pytest.mark.parametrize("H", [8, 48, 100])
def test_rms_norm_matches_reference_and_is_row_invariant(H):
    g = torch.Generator().manual_seed(H)
    x = torch.randn(9, H, generator=g).to(DEV)
    r = torch.randn(9, H, generator=g).to(DEV)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(DEV)
    out = rms_norm_triton(x, w, 1e-6)
    xd = x.double()
    ref = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_err(out, ref) < 1e-6
    out2, res2 = rms_norm_triton(x, w, 1e-6, residual=r)
    assert torch.equal(bits(res2), bits(x + r))
    assert torch.equal(bits(out2), bits(rms_norm_triton(x + r, w, 1e-6)))
    for i in (0, 4, 8):
        assert torch.equal(bits(rms_norm_triton(x[i:i + 1].clone(), w, 1e-6)), bits(out[i:i + 1]))


@pytest.mark.parametrize("H", [8, 48, 100])
def test_zero_centred_rms_norm_matches_reference_and_is_row_invariant(H):
    """(x * rstd) * (1 + w) rounded once, the residual sum rounded first; the flag leaves
    Llama's form of the same kernel as it was."""
    from vllm.kernels.rowwise import add_zero_centred_rms_norm_triton, zero_centred_rms_norm_triton
    from vllm.kernels.torch_ops import zero_centred_rms_norm
    g = torch.Generator().manual_seed(100 + H)
    x = torch.randn(9, H, generator=g).to(DEV)
    r = torch.randn(9, H, generator=g).to(DEV)
    w = (0.1 * torch.randn(H, generator=g)).to(DEV)
    out = zero_centred_rms_norm_triton(x, w, 1e-6)
    xd = x.double()
    ref = (1 + w.double()) * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_err(out, ref) < 1e-6
    assert rel_err(zero_centred_rms_norm(x, w, 1e-6), ref) < 1e-6
    out2, res2 = add_zero_centred_rms_norm_triton(x, r, w, 1e-6)
    assert torch.equal(bits(res2), bits(x + r))
    assert torch.equal(bits(out2), bits(zero_centred_rms_norm_triton(x + r, w, 1e-6)))
    for i in (0, 4, 8):
        assert torch.equal(bits(zero_centred_rms_norm_triton(x[i:i + 1].clone(), w, 1e-6)), bits(out[i:i + 1]))
    # a per-head norm on a strided [T, heads, D] view (the gated q of a fused projection)
    heads = torch.randn(5, 3, 2 * H, generator=g).to(DEV)[..., :H]
    assert torch.equal(bits(zero_centred_rms_norm_triton(heads, w, 1e-6)),
                       bits(zero_centred_rms_norm_triton(heads.contiguous(), w, 1e-6)))
    # w == 0 is the identity scale; Llama's form with weight 1 + w computes the same values
    assert rel_err(zero_centred_rms_norm_triton(x, torch.zeros_like(w), 1e-6), xd / torch.sqrt(
        xd.pow(2).mean(-1, keepdim=True) + 1e-6)) < 1e-6


def test_partial_rope_and_sigmoid_gate_match_torch():
    """Partial rope (the first R dims of each head rotated, the rest copied) and x * sigmoid(gate)
    (per element, or one gate per row) against the torch formulas; full rope's bits unchanged."""
    from vllm.kernels.elementwise import rope_triton, sigmoid_gate_triton
    from vllm.kernels.torch_ops import rope_one, sigmoid_gate, sigmoid_gate_rows
    g = torch.Generator().manual_seed(4)
    T, D = 7, 32
    q = torch.randn(T, 4, D, generator=g).to(DEV)
    k = torch.randn(T, 2, D, generator=g).to(DEV)
    for rot in (8, 16, 32):
        ang = torch.randn(T, rot // 2, generator=g).to(DEV)
        cos, sin = ang.cos(), ang.sin()
        rq, rk = rope_triton(q, k, cos, sin)
        assert torch.equal(bits(rq), bits(rope_one(q, cos, sin))) and torch.equal(bits(rk), bits(rope_one(k, cos, sin)))
        assert torch.equal(bits(rq[..., rot:]), bits(q[..., rot:]))
        h = rot // 2
        ref = torch.cat((q[..., :h] * cos[:, None] - q[..., h:rot] * sin[:, None],
                         q[..., h:rot] * cos[:, None] + q[..., :h] * sin[:, None]), dim=-1)
        assert torch.equal(bits(rq[..., :rot]), bits(ref))
    x = torch.randn(6, 3, 16, generator=g).to(DEV)
    gate = (torch.randn(6, 3, 32, generator=g) * 4).to(DEV)[..., 16:]  # a strided view, as the model passes it
    row_gate = (torch.randn(6, 3, 1, generator=g) * 4).to(DEV)
    for gt in (gate, row_gate):
        ref = x.double() * torch.sigmoid(gt.double())
        out = sigmoid_gate_triton(x, gt)
        assert out.shape == x.shape and (out.double() - ref).abs().max().item() < 1e-6
        rows = sigmoid_gate_rows(x.cpu(), gt.cpu())  # the CPU's invariant form: one token at a time
        assert (rows.double() - ref.cpu()).abs().max().item() < 1e-6
        assert (sigmoid_gate(x, gt).double() - ref).abs().max().item() < 1e-6
        for i in (0, 5):
            assert torch.equal(bits(sigmoid_gate_triton(x[i:i + 1].clone(), gt[i:i + 1].clone())), bits(out[i:i + 1]))
            assert torch.equal(bits(sigmoid_gate_rows(x[i:i + 1].cpu(), gt[i:i + 1].cpu())), bits(rows[i:i + 1]))
    with pytest.raises(ValueError, match="does not gate"):
        sigmoid_gate_triton(x, gate[..., :3])


# ---- GPU, real shapes ---------------------------------------------------------------------
QWEN3_8B_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(QWEN3_8B_SHAPES))
def test_gpu_matmul_invariant_over_M(name):
    K, N = QWEN3_8B_SHAPES[name]
    torch.manual_seed(0)
    x = torch.randn(2048, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    full = invariant_matmul(x, w)
    ref = x.double() @ w.double().T
    assert rel_err(full, ref) < 1e-2
    for M in (1, 2, 3, 8, 15, 16, 17, 31, 64, 100, 128, 255, 256, 257, 511, 1024, 2047):
        assert torch.equal(bits(invariant_matmul(x[:M].clone(), w)), bits(full[:M])), f"{name} M={M}"
    for impl in ("plain", "tma", "tmaf"):  # every impl the tables use, at a decode and a prefill size
        for M in (7, 300):
            out = invariant_matmul(x[:M].clone(), w, impl=impl)
            assert torch.equal(bits(out), bits(full[:M])), f"{name} {impl} M={M}"
    cublas_row0 = torch.nn.functional.linear(x[:1], w)
    assert rel_err(full[:1], cublas_row0.double()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(QWEN3_8B_SHAPES) + ["lm_head"])
def test_gpu_cublaslt_nosplit_equals_triton(name):
    """cuBLASLt with split-K forbidden computes our Triton kernel's bits at every M (its
    heuristic picks a kernel per M), from an offset 16-byte aligned view too, and inside a
    CUDA graph; the global cuBLAS settings are back as they were after each call."""
    from vllm.kernels import matmul as mm
    assert mm.cublaslt_nosplit_supported(), "torch cannot forbid cuBLASLt split-K here"
    K, N = {**QWEN3_8B_SHAPES, "lm_head": (4096, 151936)}[name]
    out_dtype = torch.float32 if name == "lm_head" else torch.bfloat16
    torch.manual_seed(2)
    x = torch.randn(1024, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    big = 1024 if name == "lm_head" else 8192  # prefill steps reach the engine's token budget
    x = torch.randn(big, K, device="cuda", dtype=torch.bfloat16)
    ref = invariant_matmul(x, w, out_dtype=out_dtype, impl="plain")
    before = _blas_state()
    mm._LT_REFUSED.clear()
    calls = []
    real = mm._cublaslt_matmul

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)
    mm._cublaslt_matmul = counted
    try:
        ms = (1, 2, 5, 16, 33, 64, 100, 128, 200, 256, 300, 512, 777, 1024, 1025, 2048, 3000, 4096, 5000, 8192)
        for M in [m for m in ms if m <= big]:
            out = invariant_matmul(x[:M].clone(), w, out_dtype=out_dtype, impl="cublaslt")
            assert torch.equal(bits(out), bits(ref[:M])), f"{name} M={M}"
    finally:
        mm._cublaslt_matmul = real
    assert len(calls) == len([m for m in ms if m <= big]) and not mm._LT_REFUSED  # cuBLASLt really ran
    x = x[:1024].contiguous()
    ref = ref[:1024]
    assert _blas_state() == before
    # what it does not take runs in Triton: a bias, fp16, a 16-byte (not 256-byte) aligned view
    buf = torch.empty(256 * K + 8, device="cuda", dtype=torch.bfloat16)
    view = buf[8:8 + 256 * K].view(256, K)
    view.copy_(x[:256])
    assert not mm._cublaslt_takes(view, w, None, out_dtype)
    assert torch.equal(bits(invariant_matmul(view, w, out_dtype=out_dtype, impl="cublaslt")), bits(ref[:256]))
    assert not mm._cublaslt_takes(x, w, torch.zeros(N, device="cuda", dtype=torch.bfloat16), out_dtype)
    assert not mm._cublaslt_takes(x.half(), w.half(), None, out_dtype)
    assert mm._cublaslt_takes(x[:256].clone(), w, None, out_dtype)
    xs = x[:256].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        invariant_matmul(xs, w, out_dtype=out_dtype, impl="cublaslt")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = invariant_matmul(xs, w, out_dtype=out_dtype, impl="cublaslt")
    xs.copy_(x[256:512])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(captured), bits(ref[256:512]))
    assert _blas_state() == before


@pytest.mark.gpu
def test_gpu_lm_head_fp32_invariant():
    torch.manual_seed(0)
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(151936, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    full = invariant_matmul(x, w, out_dtype=torch.float32)
    for M in (1, 7, 64, 299):
        assert torch.equal(bits(invariant_matmul(x[:M].clone(), w, out_dtype=torch.float32)), bits(full[:M]))


@pytest.mark.gpu
def test_gpu_fp32_logits_small_vocab_large_M():
    """float32 outputs below the wide-N threshold (small-vocab logits, e.g. test models)
    at prefill/training sizes: a config that fits, and rows independent of M."""
    torch.manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5000, 1024, device="cuda", dtype=torch.bfloat16) * 0.03
    full = invariant_matmul(x, w, out_dtype=torch.float32)
    assert rel_err(full, x.double() @ w.double().T) < 1e-2
    for M in (1, 100, 1000):
        assert torch.equal(bits(invariant_matmul(x[:M].clone(), w, out_dtype=torch.float32)), bits(full[:M]))


@pytest.mark.gpu
def test_gpu_rowwise_invariant():
    torch.manual_seed(0)
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    full, res = rms_norm_triton(x, w, 1e-6, residual=r)
    for M in (1, 3, 64, 511):
        o, rr = rms_norm_triton(x[:M].clone(), w, 1e-6, residual=r[:M].clone())
        assert torch.equal(bits(o), bits(full[:M])) and torch.equal(bits(rr), bits(res[:M]))


def test_fused_elementwise_match_torch():
    """rope and silu-and-mul kernels vs the torch formulas they replace: equal bits."""
    from vllm.kernels.elementwise import rope_triton, silu_and_mul_triton
    from vllm.kernels.torch_ops import rope_one
    g = torch.Generator().manual_seed(3)
    # (the interpreter casts float32 -> bf16 by truncation, so bf16 bits are checked on the GPU only)
    for dtype in (torch.float32, torch.bfloat16) if DEV == "cuda" else (torch.float32,):
        q = torch.randn(7, 4, 16, generator=g).to(DEV, dtype)
        k = torch.randn(7, 2, 16, generator=g).to(DEV, dtype)
        ang = torch.randn(7, 8, generator=g).to(DEV)
        cos, sin = ang.cos(), ang.sin()
        rq, rk = rope_triton(q, k, cos, sin)
        assert torch.equal(bits(rq), bits(rope_one(q, cos, sin)))
        assert torch.equal(bits(rk), bits(rope_one(k, cos, sin)))
        x = torch.randn(5, 2 * 24, generator=g).to(DEV, dtype)
        gate, up = x.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        out = silu_and_mul_triton(x)
        if dtype == torch.float32:
            assert (out - ref).abs().max().item() < 1e-6  # exp implementations may differ by an ulp
        else:
            assert (out.float() - ref.float()).abs().max().item() <= 2 ** -6 * ref.float().abs().max().item()


def test_every_impl_gives_the_same_bits():
    """plain (one program per tile), tma / tmaf (persistent, TMA descriptors) and cublaslt
    (off CUDA: its Triton fallback) compute one reduction order."""
    g = torch.Generator().manual_seed(7)
    for M, K, N, bias in ((37, 72, 48, False), (5, 64, 40, True), (3, 96, 24, True)):
        x = torch.randn(M, K, generator=g).to(DEV)
        w = torch.randn(N, K, generator=g).to(DEV)
        b = torch.randn(N, generator=g).to(DEV) if bias else None
        plain = invariant_matmul(x, w, b, impl="plain")
        for impl in ("tma", "tmaf", "cublaslt"):
            other = invariant_matmul(x, w, b, impl=impl)
            assert torch.equal(bits(plain), bits(other)), (impl, M, K, N)
        assert rel_err(plain, x.double() @ w.double().T + (b.double() if bias else 0)) < (1e-5 if DEV == "cpu" else 5e-3)
    with pytest.raises(ValueError, match="impl must be one of"):
        invariant_matmul(x, w, impl="partial")


def _blas_state():
    return (torch._C._get_blas_preferred_backend(), torch._C._get_cublas_allow_bf16_reduced_precision_reduction(),
            torch._C._get_cublas_allow_fp16_reduced_precision_reduction())


def test_cublaslt_impl_falls_back_and_restores_global_state(monkeypatch):
    """impl "cublaslt" takes only what cuBLASLt-nosplit can run (CUDA, no bias, aligned rows);
    everything else runs the entry's tiles in Triton (same bits). The process-global cuBLAS
    settings it switches are restored after every call, also when the GEMM raises."""
    from vllm.kernels import matmul as mm
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 48, generator=g).to(DEV)
    w = torch.randn(20, 48, generator=g).to(DEV)
    b = torch.randn(20, generator=g).to(DEV)
    before = _blas_state()
    for bias in (None, b):
        assert torch.equal(bits(invariant_matmul(x, w, bias, impl="cublaslt")), bits(invariant_matmul(x, w, bias)))
    assert not mm._cublaslt_takes(x.cpu(), w.cpu(), None, x.dtype)
    assert not mm._cublaslt_takes(x, w, b, x.dtype)
    assert _blas_state() == before

    # cuBLASLt refusing a problem (torch raises before launching): Triton, remembered
    calls = []

    def refuse(*args):
        calls.append(args)
        raise RuntimeError("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction(..., "
                           "allow_splitk=False) requires the cuBLASLt backend")
    monkeypatch.setattr(mm, "_cublaslt_takes", lambda *args: True)
    monkeypatch.setattr(mm, "_cublaslt_matmul", refuse)
    monkeypatch.setattr(mm, "_LT_REFUSED", set())
    for _ in range(2):
        assert torch.equal(bits(invariant_matmul(x, w, impl="cublaslt")), bits(invariant_matmul(x, w)))
        assert torch.equal(bits(invariant_matmul(x, w, impl="cublaslt+plain")), bits(invariant_matmul(x, w)))
    assert len(calls) == 1 and len(mm._LT_REFUSED) == 1

    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(mm, "_cublaslt_matmul", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        invariant_matmul(x[:5], w, impl="cublaslt")  # not a refusal: not hidden
    with pytest.raises(ValueError, match="cublaslt"):
        invariant_matmul(x, w, impl="cublaslt+cublaslt")
    monkeypatch.undo()

    # the switch itself, on CPU tensors (a CPU torch cannot select cuBLASLt: a stand-in records it)
    backend = {"now": "default"}
    monkeypatch.setattr(torch._C, "_get_blas_preferred_backend", lambda: backend["now"])
    monkeypatch.setattr(torch._C, "_set_blas_preferred_backend", lambda b: backend.update(now=b))
    seen = []
    real_mm = torch.mm

    def spy_mm(*args, **kwargs):
        seen.append((backend["now"], torch._C._get_cublas_allow_bf16_reduced_precision_reduction()))
        return real_mm(*args, **kwargs)
    monkeypatch.setattr(torch, "mm", spy_mm)
    xb, wb = x.cpu().bfloat16(), w.cpu().bfloat16()
    assert torch.equal(bits(mm._cublaslt_matmul(xb, wb, torch.bfloat16)), bits(xb @ wb.t()))
    assert seen == [(torch._C._BlasBackend.Cublaslt, (False, False))]
    with pytest.raises(RuntimeError):
        mm._cublaslt_matmul(xb, wb[:, :40], torch.bfloat16)  # shapes do not match: raises inside
    assert backend["now"] == "default"
    assert _blas_state()[1:] == before[1:]


def test_cublaslt_can_be_turned_off(monkeypatch):
    """allow_cublaslt=False (KernelConfig.gemm_cublaslt) never calls cuBLASLt, even where it
    would take the problem: the entry's Triton fallback runs (same bits)."""
    from vllm.kernels import matmul as mm
    g = torch.Generator().manual_seed(12)
    x = torch.randn(6, 48, generator=g).to(DEV)
    w = torch.randn(20, 48, generator=g).to(DEV)
    calls = []
    monkeypatch.setattr(mm, "_cublaslt_takes", lambda *args: True)
    monkeypatch.setattr(mm, "_cublaslt_matmul", lambda a, w_, out_dtype: calls.append(1) or torch.mm(a, w_.t()))
    monkeypatch.setattr(mm, "_LT_REFUSED", set())
    off = mm.invariant_matmul(x, w, impl="cublaslt", allow_cublaslt=False)
    assert not calls and torch.equal(bits(off), bits(invariant_matmul(x, w, impl="plain")))
    mm.invariant_matmul(x, w, impl="cublaslt")
    assert calls == [1]  # the stand-ins are live: turned on, cuBLASLt is called


def test_selfcheck_covers_cublaslt_buckets_densely(monkeypatch):
    """Buckets served by cuBLASLt pick their kernel by cuBLAS's heuristic per M: the
    start-up self-check visits every LT_STRIDE-th M of them and both ends."""
    from vllm.kernels import matmul as mm
    from vllm.kernels import selfcheck
    table = [(16, "plain", 16, 32, 64, 4, 3), (256, "cublaslt", 64, 64, 64, 4, 3), (1 << 62, "tma", 128, 128, 64, 8, 3)]
    monkeypatch.setattr(mm, "config_table", lambda *args, **kw: table)
    ms = selfcheck._check_ms(4096, 4096, False, 1024)
    assert set(selfcheck.CHECK_MS) <= set(ms)
    assert {17, 17 + selfcheck.LT_STRIDE, 256} <= set(ms)
    assert all(m in ms for m in range(17, 257, selfcheck.LT_STRIDE))
    assert max(ms) == 1024
    assert 300 not in ms  # tma bucket: table tiles, checked at CHECK_MS only
    assert max(selfcheck._check_ms(4096, 4096, False, 100)) == 100
    # a cuBLASLt bucket above max_m is checked up to the engine's token budget
    table[2] = (4096, "cublaslt+tma", 128, 128, 64, 8, 3)
    table.append((1 << 62, "tma", 128, 256, 64, 8, 3))
    ms = selfcheck._check_ms(4096, 4096, False, 1024, 8192)
    assert {257, 1025, 1025 + selfcheck.LT_STRIDE_LARGE, 4096} <= set(ms) and max(ms) == 4096
    assert all(m in ms for m in range(257, 1025, selfcheck.LT_STRIDE))
    assert max(selfcheck._check_ms(4096, 4096, False, 1024, 2000)) == 2000
    assert max(selfcheck._check_ms(4096, 4096, False, 1024)) == 1024


def test_tuned_config_tables_roundtrip(tmp_path, monkeypatch):
    """A sweep result becomes a per-shape table that the loader reads back."""
    import importlib.util
    import json

    from vllm.kernels import matmul
    spec = importlib.util.spec_from_file_location("derive", os.path.join(
        os.path.dirname(__file__), "..", "benchmarks", "kernels", "derive_gemm_configs.py"))
    derive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(derive)
    rows = [{"K": 64, "N": 32, "M": m, "cublas_us": 1.0,
             "timings": [[2.0, ["plain", 16, 32, 64, 4, 3]], [3.0, ["tma", 64, 32, 64, 4, 3]]]}
            for m in (1, 16, 256)]
    table = derive.derive(rows)
    assert table == {"64,32": [[1, "plain", 16, 32, 64, 4, 3], [16, "plain", 16, 32, 64, 4, 3],
                               [1 << 62, "plain", 16, 32, 64, 4, 3]]}
    (tmp_path / "gemm_fake.json").write_text(json.dumps({"shapes": table}))
    monkeypatch.setattr(matmul, "_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(matmul, "_tuned_cache", {})
    assert matmul.pick_config(20, configs=matmul.tuned_tables("fake")["64,32"]) == ("plain", 16, 32, 64, 4, 3)
    assert matmul.tuned_tables("absent") == {}
