"""The worker's caches built from the caches layers declare (vllm/worker/kv_cache.py):
paged KV for attention layers, per-sequence slots for recurrent layers."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm.layers.attention import Attention
from vllm.layers.cache_spec import PagedKVSpec, RecurrentStateSpec, StateTensor
from vllm.worker.kv_cache import LayerCaches, bytes_per_block, cache_specs, state_bytes
from vllm.worker.kv_format import KVFormat


class _Toy(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.attn = nn.ModuleList(Attention(i, 2 * h, h, d) for i, (h, d) in enumerate(shapes))


class _Recurrent(nn.Module):
    """A layer with a recurrent state: a window kept only in the invariant mode."""

    def __init__(self, idx: int):
        super().__init__()
        self.idx = idx

    def cache_spec(self, numerics: str) -> RecurrentStateSpec:
        tensors = (StateTensor("h", (2, 3), torch.float32),)
        if numerics == "invariant":
            tensors += (StateTensor("rows", (4, 5)),)
        return RecurrentStateSpec(self.idx, "toy", tensors, chunk_size=4, snapshot=("h",))


def test_specs_come_from_the_layers_in_index_order():
    specs = cache_specs(_Toy([(2, 16), (4, 32), (2, 16)]))
    assert specs.paged == [PagedKVSpec(0, 2, 16), PagedKVSpec(1, 4, 32), PagedKVSpec(2, 2, 16)]
    assert specs.recurrent == [] and specs.state_chunk_size is None
    gap = _Toy([(2, 16), (2, 16)])
    gap.attn[1].layer_idx = 5
    with pytest.raises(ValueError, match="indices"):
        cache_specs(gap)
    hybrid = _Toy([(2, 16)])
    hybrid.rec = nn.ModuleList([_Recurrent(1), _Recurrent(0)])
    specs = cache_specs(hybrid, "fast")
    assert [s.layer_idx for s in specs.recurrent] == [0, 1] and specs.state_chunk_size == 4
    assert [t.name for t in specs.recurrent[0].tensors] == ["h"]
    assert [t.name for t in cache_specs(hybrid, "invariant").recurrent[0].tensors] == ["h", "rows"]
    with pytest.raises(ValueError, match="does not hold"):
        RecurrentStateSpec(0, "toy", (StateTensor("h", (1,)),), 4, snapshot=("x",))


def test_recurrent_states_slots_snapshots_and_sleep():
    """Running slots hold every tensor, snapshot slots only the snapshot's; copies move a
    state between slots; sleep releases the states with the KV and restores them zeroed."""
    fmt = KVFormat(torch.float32, "auto")
    m = _Toy([(2, 16)])
    m.rec = nn.ModuleList([_Recurrent(0), _Recurrent(1)])
    specs = cache_specs(m, "invariant")
    cache = LayerCaches.allocate(specs.paged, fmt, 3, 4, torch.device("cpu"), state_specs=specs.recurrent,
                                 num_slots=3, num_snapshots=2)
    h, rows = cache.states[1]["h"], cache.states[1]["rows"]
    assert h.shape == (5, 2, 3) and rows.shape == (3, 4, 5) and rows.dtype == torch.float32
    expect = sum(t.numel() * t.element_size() for t in cache.tensors())
    assert cache.nbytes() == expect == 3 * bytes_per_block(specs.paged, fmt, 4) + state_bytes(specs.recurrent, torch.float32, 3, 2)
    h[2] = 7.0
    cache.copy_state_slots([2], [4])  # take a snapshot of slot 2 into snapshot slot 4
    h[2] = 0.0
    cache.copy_state_slots([4], [1])  # restore it into slot 1
    assert (h[1] == 7).all() and (h[4] == 7).all() and (h[2] == 0).all()
    assert set(cache.graph_tensors()) >= {"state:0:h", "state:1:rows"}
    backend = cache.state_backend(None)
    assert backend.layer(1)["h"] is h
    freed = cache.release()
    assert freed == expect and all(t.untyped_storage().nbytes() == 0 for t in cache.tensors())
    cache.restore()
    assert (cache.states[1]["h"] == 0).all()


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_bytes_per_block_matches_the_uniform_format(kv):
    fmt = KVFormat(torch.bfloat16, kv)
    specs = [PagedKVSpec(i, 8, 128) for i in range(36)]
    assert bytes_per_block(specs, fmt, 16) == fmt.bytes_per_block(36, 16, 8, 128)


def test_mixed_layer_shapes_get_one_read_copy_each():
    fmt = KVFormat(torch.float32, "fp8")
    specs = cache_specs(_Toy([(2, 16), (4, 32), (2, 16)])).paged
    cache = LayerCaches.allocate(specs, fmt, 5, 4, torch.device("cpu"))
    assert [tuple(c.shape) for c in cache.k] == [(5, 4, 2, 16), (5, 4, 4, 32), (5, 4, 2, 16)]
    assert sorted(cache.dequant) == [(2, 16), (4, 32)]
    backend = cache.backend()
    assert backend.dequant[0] is backend.dequant[2] and backend.dequant[1][0].shape == (5, 4, 4, 32)
    expect = sum(t.numel() * t.element_size() for t in cache.tensors())
    assert cache.nbytes() == expect == 5 * bytes_per_block(specs, fmt, 4)


def test_release_and_restore():
    fmt = KVFormat(torch.float32, "fp8")
    cache = LayerCaches.allocate(cache_specs(_Toy([(2, 16)])).paged, fmt, 3, 4, torch.device("cpu"))
    cache.k[0].fill_(1)
    cache.k_scales[0].fill_(7)
    freed = cache.release()
    assert freed > 0 and cache.sleeping and all(t.untyped_storage().nbytes() == 0 for t in cache.tensors())
    assert cache.release() == 0
    assert cache.restore() is True  # plain allocations come back at new addresses
    assert not cache.sleeping and (cache.k[0].float() == 0).all() and (cache.k_scales[0] == 1).all()
    assert cache.restore() is False
