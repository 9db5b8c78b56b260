"""csrc ops against their torch fallbacks (GPU; skipped where the extension is not built)."""
import pytest
import torch

from vllm import _custom_ops


def test_cache_kv_fallback_on_cpu():
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    slots = torch.tensor([4, 5, 9, 15, 6])
    _custom_ops.cache_kv(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 8)[slots], k) and torch.equal(vc.view(-1, 2, 8)[slots], v)


@pytest.mark.gpu
@pytest.mark.skipif(not _custom_ops.HAS_C, reason="vllm._C was not built (no nvcc/CMake at install time)")
def test_cache_kv_cuda_matches_index_copy():
    k = torch.randn(37, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(37, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device="cuda")[:37]
    kc, vc = torch.randn(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16), torch.randn(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    rk, rv = kc.clone(), vc.clone()
    rk.view(-1, 8, 128).index_copy_(0, slots, k)
    rv.view(-1, 8, 128).index_copy_(0, slots, v)
    torch.ops.vllm_parity.cache_kv(k, v, kc, vc, slots)
    assert torch.equal(kc.view(torch.int16), rk.view(torch.int16)) and torch.equal(vc.view(torch.int16), rv.view(torch.int16))
