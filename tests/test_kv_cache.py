"""The KV cache built from the caches layers declare (vllm/worker/kv_cache.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm.layers.attention import Attention, PagedKVSpec
from vllm.worker.kv_cache import PagedKVCache, bytes_per_block, cache_specs
from vllm.worker.kv_format import KVFormat


class _Toy(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.attn = nn.ModuleList(Attention(i, 2 * h, h, d) for i, (h, d) in enumerate(shapes))


def test_specs_come_from_the_layers_in_index_order():
    specs = cache_specs(_Toy([(2, 16), (4, 32), (2, 16)]))
    assert specs == [PagedKVSpec(0, 2, 16), PagedKVSpec(1, 4, 32), PagedKVSpec(2, 2, 16)]
    gap = _Toy([(2, 16), (2, 16)])
    gap.attn[1].layer_idx = 5
    with pytest.raises(ValueError, match="indices"):
        cache_specs(gap)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_bytes_per_block_matches_the_uniform_format(kv):
    fmt = KVFormat(torch.bfloat16, kv)
    specs = [PagedKVSpec(i, 8, 128) for i in range(36)]
    assert bytes_per_block(specs, fmt, 16) == fmt.bytes_per_block(36, 16, 8, 128)


def test_mixed_layer_shapes_get_one_read_copy_each():
    fmt = KVFormat(torch.float32, "fp8")
    specs = cache_specs(_Toy([(2, 16), (4, 32), (2, 16)]))
    cache = PagedKVCache.allocate(specs, fmt, 5, 4, torch.device("cpu"))
    assert [tuple(c.shape) for c in cache.k] == [(5, 4, 2, 16), (5, 4, 4, 32), (5, 4, 2, 16)]
    assert sorted(cache.dequant) == [(2, 16), (4, 32)]
    backend = cache.backend()
    assert backend.dequant[0] is backend.dequant[2] and backend.dequant[1][0].shape == (5, 4, 4, 32)
    expect = sum(t.numel() * t.element_size() for t in cache.tensors())
    assert cache.nbytes() == expect == 5 * bytes_per_block(specs, fmt, 4)


def test_release_and_restore():
    fmt = KVFormat(torch.float32, "fp8")
    cache = PagedKVCache.allocate(cache_specs(_Toy([(2, 16)])), fmt, 3, 4, torch.device("cpu"))
    cache.k[0].fill_(1)
    cache.k_scales[0].fill_(7)
    freed = cache.release()
    assert freed > 0 and cache.sleeping and all(t.untyped_storage().nbytes() == 0 for t in cache.tensors())
    assert cache.release() == 0
    assert cache.restore() is True  # plain allocations come back at new addresses
    assert not cache.sleeping and (cache.k[0].float() == 0).all() and (cache.k_scales[0] == 1).all()
    assert cache.restore() is False
