"""The paged KV write (vllm/kernels/cache_write.py): the Triton write against the torch
reference, element for element (bit patterns, NaN-filled caches)."""
import pytest
import torch

from vllm.kernels.cache_write import cache_kv, cache_kv_ref


def _kv_problem(T, H, D, blocks, bs, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (4 + 2) * H * D, generator=g).to(dtype)  # k, v as strided views of a fused output
    k = qkv[:, 4 * H * D:5 * H * D].view(T, H, D)
    v = qkv[:, 5 * H * D:].view(T, H, D)
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    kc = torch.full((blocks, bs, H, D), float("nan"), dtype=dtype)
    vc = torch.full((blocks, bs, H, D), float("nan"), dtype=dtype)
    return k, v, kc, vc, slots


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_cache_kv_on_cpu_is_the_reference():
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    slots = torch.tensor([4, 5, 9, 15, 6])
    cache_kv(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 8)[slots], k) and torch.equal(vc.view(-1, 2, 8)[slots], v)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert (kc.view(-1, 2, 8)[untouched] == 0).all() and (vc.view(-1, 2, 8)[untouched] == 0).all()


def test_reference_refuses_a_non_contiguous_cache():
    k, v, kc, vc, slots = _kv_problem(3, 2, 8, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        cache_kv_ref(k, v, kc.transpose(1, 2), vc.transpose(1, 2), slots)


@pytest.mark.parametrize("dtype,H", [(torch.bfloat16, 2), (torch.float32, 3)])
def test_triton_cache_write_equals_reference(dtype, H):
    """Every element lands where the reference puts it, NaN-untouched elsewhere (bits,
    including the NaN pattern of untouched slots), for strided K/V and a head count that
    is not a power of two."""
    import subprocess
    import sys
    import textwrap
    # the interpreter must be chosen before triton is imported: run in a fresh process
    code = textwrap.dedent(f"""
        import os; os.environ["TRITON_INTERPRET"] = "1"
        import torch, sys
        sys.path.insert(0, {repr(__file__.rsplit('/', 1)[0])})
        from test_cache_write import _kv_problem, _bits
        from vllm.kernels.cache_write import cache_kv_ref, cache_kv_triton
        k, v, kc, vc, slots = _kv_problem(11, {H}, 16, 6, 4, {dtype})
        rk, rv = kc.clone(), vc.clone()
        cache_kv_ref(k, v, rk, rv, slots)
        cache_kv_triton(k, v, kc, vc, slots)
        assert torch.equal(_bits(kc), _bits(rk)) and torch.equal(_bits(vc), _bits(rv))
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.gpu
def test_gpu_triton_cache_write_equals_reference():
    k, v, kc, vc, slots = _kv_problem(300, 8, 128, 40, 16, torch.bfloat16)
    k, v, kc, vc, slots = (t.cuda() for t in (k, v, kc, vc, slots))
    from vllm.kernels.cache_write import cache_kv_triton, triton_supports
    assert triton_supports(k, v, kc, vc)
    rk, rv = kc.clone(), vc.clone()
    cache_kv_ref(k, v, rk, rv, slots)
    cache_kv_triton(k, v, kc, vc, slots)
    assert torch.equal(_bits(kc), _bits(rk)) and torch.equal(_bits(vc), _bits(rv))
