"""Paged attention: correctness vs a float64 reference and bit-invariance.

Two implementations are tested:
  * "triton": vllm.kernels.attention.paged_attention_triton (on CPU through
    TRITON_INTERPRET=1 with tiny sizes, on CUDA compiled),
  * "torch":  vllm.kernels.attention_cpu.paged_attention_cpu (the CPU engine's).

Invariance is checked on bit patterns (int views), never with allclose: the
output for one (sequence, position, head) must be identical whatever the
schedule (full prefill / chunks / decode / parallel decode splits), batch
composition, slot and physical block ids.

Every call builds a fresh NaN-filled cache holding only positions < seq_len of
each batch entry (block 0, the null block, stays NaN too), so any read past a
context or through an unused block-table entry shows up as NaN.
"""
import functools
import importlib
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must precede the first triton import: triton.jit picks interpreter vs
    # compiler when the kernels are decorated.
    os.environ["TRITON_INTERPRET"] = "1"

from vllm.kernels import attention as attn  # noqa: E402

if not HAS_CUDA and not attn._INTERPRET:
    # Imported earlier by another test without the interpreter: re-decorate.
    attn = importlib.reload(attn)

from vllm.kernels.attention_cpu import (  # noqa: E402
    _exp_det,
    paged_attention_cpu,
    paged_attention_ref,
)

DEV = "cuda" if HAS_CUDA else "cpu"
KV_TILE = attn.KV_TILE
SPLIT = KV_TILE  # small split size: contexts of a few tiles span several splits
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


# --------------------------------------------------------------------------
# Problem builder
# --------------------------------------------------------------------------
class Problem:
    """Token-level contents of a few sequences (q, k, v for every position)."""

    def __init__(self, lengths, num_q_heads, num_kv_heads, head_dim, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.hq, self.hkv, self.d, self.dtype = num_q_heads, num_kv_heads, head_dim, dtype
        self.seqs = [
            tuple(torch.randn(L, h, head_dim, generator=g).to(dtype)
                  for h in (num_q_heads, num_kv_heads, num_kv_heads))
            for L in lengths
        ]
        self.scale = 1.5 / head_dim ** 0.5  # a bit sharper than usual softmax

    def call(self, impl, items, block_size, *, seed=0, split=SPLIT, decode_parallel=None,
             max_seq_len=None, extra_blocks=5, share_blocks=False, device=DEV, mode="fast"):
        """Run one batch. items: (seq index or None for padding, seq_len, q_len);
        the entry's queries are positions seq_len - q_len .. seq_len - 1.
        Each entry gets its own physical blocks holding only positions
        < seq_len (the rest of the cache is NaN), unless share_blocks (GPU
        sizes: entries of one sequence then share blocks holding all of it).
        impl "dispatch" is the op shim in numerics `mode`.
        Returns the per-entry outputs [q_len, Hq, D] (on CPU)."""
        g = torch.Generator().manual_seed(1000 + seed)
        # Allocation units: one per entry, or one per sequence when sharing.
        units = {}
        for i, (s, L, _) in enumerate(items):
            key = s if (share_blocks and s is not None) else ("entry", i)
            units[key] = max(units.get(key, 0), L)
        nblk_unit = {key: -(-L // block_size) for key, L in units.items()}
        num_blocks = 1 + sum(nblk_unit.values()) + extra_blocks
        phys = torch.randperm(num_blocks - 1, generator=g) + 1  # never block 0
        width = max(list(nblk_unit.values()) + [1]) + 2
        shape = (num_blocks, block_size, self.hkv, self.d)
        k_cache = torch.full(shape, float("nan"), dtype=self.dtype)
        v_cache = torch.full(shape, float("nan"), dtype=self.dtype)
        unit_ids, used = {}, 0
        for key, L in units.items():
            ids = phys[used:used + nblk_unit[key]]
            used += nblk_unit[key]
            unit_ids[key] = ids
            s = key if share_blocks and not isinstance(key, tuple) else items[key[1]][0]
            if s is None or L == 0:
                continue
            _, k, v = self.seqs[s]
            t = torch.arange(L)
            k_cache[ids[t // block_size], t % block_size] = k[:L]
            v_cache[ids[t // block_size], t % block_size] = v[:L]
        block_table = torch.zeros(len(items), width, dtype=torch.int32)  # unused -> null block
        qs = []
        for i, (s, L, n) in enumerate(items):
            key = s if (share_blocks and s is not None) else ("entry", i)
            nb = -(-L // block_size)
            block_table[i, :nb] = unit_ids[key][:nb].to(torch.int32)
            if s is None:  # padding entry: random queries, no context
                assert L == 0
                qs.append(torch.randn(n, self.hq, self.d, generator=g).to(self.dtype))
            else:
                qs.append(self.seqs[s][0][L - n:L])
        q = torch.cat(qs)
        qlens = [n for _, _, n in items]
        cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
        seq_lens = torch.tensor([L for _, L, _ in items], dtype=torch.int32)
        dev = "cpu" if impl in ("torch", "dispatch") else device
        args = [t.to(dev) for t in (q, k_cache, v_cache, block_table, cu, seq_lens)]
        fn = {"torch": paged_attention_cpu, "triton": attn.paged_attention_triton,
              "dispatch": functools.partial(_ops_attention, mode)}[impl]
        out = fn(*args, self.scale, max_query_len=max(qlens),
                 max_seq_len=max_seq_len if max_seq_len is not None else max(seq_lens.tolist()),
                 kv_split_size=split, decode_parallel_splits=decode_parallel).cpu()
        c = cu.tolist()
        return [out[c[i]:c[i + 1]] for i in range(len(items))]

    def reference(self, s, L, n):
        """float64 reference output for queries L-n..L-1 of sequence s."""
        q, k, v = self.seqs[s]
        bt = torch.arange(L, dtype=torch.int32)[None]  # block_size 1, identity
        return paged_attention_ref(
            q[L - n:L], k[:L, None], v[:L, None], bt,
            torch.tensor([0, n], dtype=torch.int32), torch.tensor([L], dtype=torch.int32),
            self.scale, out=torch.zeros(n, self.hq, self.d, dtype=torch.float64),
            max_query_len=n)


def bits(t):
    return t.contiguous().view(BITS[t.dtype])


def assert_same_bits(a, b, what):
    assert a.shape == b.shape, what
    diff = (bits(a) != bits(b)).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ in bits"


def by_position(outs, items):
    """{(seq, position): output row [Hq, D]} from a call's per-entry outputs."""
    table = {}
    for (s, L, n), o in zip(items, outs):
        if s is None:
            continue
        for i in range(n):
            table[(s, L - n + i)] = o[i]
    return table


IMPLS = ["triton", "torch"]


# --------------------------------------------------------------------------
# Helpers themselves
# --------------------------------------------------------------------------
def test_exp_det_is_accurate():
    x = torch.cat([-torch.rand(20000) * 120, torch.tensor([0.0, -0.0, -1e-30, -87.0, -104.0, float("-inf")])])
    got, want = _exp_det(x), torch.exp(x.double())
    assert got[-1].item() == 0.0 and got[-6].item() == 1.0 and got[-5].item() == 1.0
    rel = ((got.double() - want).abs() / want.clamp_min(1e-38))[want > 1e-37]
    assert rel.max().item() < 1.2e-7  # within ~1 fp32 ulp


# --------------------------------------------------------------------------
# Correctness vs float64 reference
# --------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,block_size,hq,hkv", [
    (torch.float32, 1, 2, 2),    # MHA, one token per block
    (torch.bfloat16, 4, 4, 2),   # GQA 2
    (torch.float32, 16, 4, 1),   # GQA 4
    (torch.bfloat16, 16, 4, 1),
])
def test_matches_reference(impl, dtype, block_size, hq, hkv):
    lengths = [1, 77, 150, 9]
    P = Problem(lengths, hq, hkv, 16, dtype, seed=block_size)
    items = [
        (0, 1, 1),      # a single KV token
        (1, 77, 77),    # full prefill, 77 not a multiple of block or tile
        (None, 0, 0),   # q_len 0 padding entry
        (2, 150, 12),   # chunk spanning several splits (split = 64)
        (3, 9, 1),      # decode
        (2, 131, 1),    # decode, 3 splits
        (None, 0, 1),   # seq_len 0 padding entry with a query row
    ]
    outs = P.call(impl, items, block_size, seed=block_size)
    for (s, L, n), o in zip(items, outs):
        assert o.dtype == dtype and o.shape == (n, hq, 16)
        if s is None:
            assert (bits(o) == 0).all(), "padding rows must be +0"
            continue
        torch.testing.assert_close(o.double(), P.reference(s, L, n), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("parallel", [False, True])
def test_decode_matches_reference(impl, parallel):
    P = Problem([200, 65, 3], 8, 2, 32, torch.float32, seed=3)
    items = [(0, 200, 1), (None, 0, 1), (1, 65, 1), (2, 3, 1), (0, 64, 1)]
    outs = P.call(impl, items, 4, decode_parallel=parallel, max_seq_len=256)
    for (s, L, n), o in zip(items, outs):
        want = torch.zeros(n, 8, 32, dtype=torch.float64) if s is None else P.reference(s, L, n)
        torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=2e-5)


def test_out_argument_and_untouched_rows():
    """A preallocated out is written in place; rows not owned by any
    sequence (past cu_seqlens_q[-1]) are left alone."""
    P = Problem([40], 4, 2, 16, torch.float32)
    q, k, v = P.seqs[0]
    k_cache, v_cache = k[:, None].contiguous(), v[:, None].contiguous()
    bt = torch.arange(40, dtype=torch.int32)[None]
    qq = torch.cat([q[30:40], torch.randn(3, 4, 16)])
    for fn in (attn.paged_attention_triton, paged_attention_cpu):
        dev = "cpu" if fn is paged_attention_cpu else DEV
        out = torch.full((13, 4, 16), 7.0, device=dev)
        args = [t.to(dev) for t in (qq, k_cache, v_cache, bt, torch.tensor([0, 10], dtype=torch.int32),
                                    torch.tensor([40], dtype=torch.int32))]
        res = fn(*args, P.scale, out, max_query_len=10, kv_split_size=SPLIT)
        assert res is out
        assert (out[10:] == 7.0).all()
        torch.testing.assert_close(out[:10].cpu().double(), P.reference(0, 40, 10), atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------------------
# Bit invariance (CPU sizes)
# --------------------------------------------------------------------------
def decode_positions(L):
    """Decode positions to test: tile/split edges plus a regular sample."""
    T = KV_TILE
    edges = {0, 1, 2, T - 1, T, T + 1, 2 * T - 1, 2 * T, 2 * T + 1, L - 1}
    return sorted(p for p in edges | set(range(3, L, 11)) if p < L)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunked_decode_same_bits(impl, dtype):
    """Full prefill == every chunking (chunks ending mid-block) == decode."""
    L, bs = 140, 4  # 3 splits of 64: [0,64) [64,128) [128,140)
    P = Problem([L], 4, 1, 16, dtype, seed=11)
    full = by_position(P.call(impl, [(0, L, L)], bs), [(0, L, L)])

    def check(table, what):
        for key, o in table.items():
            assert_same_bits(o, full[key], f"{what} at position {key[1]}")

    # Chunked prefill: each chunk is one call whose context ends at the chunk.
    for chunks in ([5] * 28, [50, 50, 40], [1, 62, 2, 65, 10], [129, 11]):
        assert sum(chunks) == L
        done = 0
        for c in chunks:
            done += c
            table = by_position(P.call(impl, [(0, done, c)], bs, seed=done), [(0, done, c)])
            check(table, f"chunks {chunks[:3]}...")
    # Token-by-token decode: one decode row per position in one batch (batch
    # invariance makes that the same as separate decode steps), with
    # sequential and parallel KV splits ...
    items = [(0, p + 1, 1) for p in decode_positions(L)]
    for parallel in (False, True):
        check(by_position(P.call(impl, items, bs, decode_parallel=parallel), items),
              f"decode (parallel={parallel})")
    # ... and real single-sequence decode steps around tile/split edges.
    for p in (0, 64, 129):
        check(by_position(P.call(impl, [(0, p + 1, 1)], bs), [(0, p + 1, 1)]), "single decode")


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_slot_and_block_ids_do_not_change_bits(impl):
    """A chunk computed alone == in batches of random other sequences at
    every slot, with different physical blocks and block-table widths."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(5)
    lengths = [140] + torch.randint(1, 100, (5,), generator=g).tolist()
    P = Problem(lengths, 8, 2, 16, dtype, seed=5)
    target = (0, 140, 21)  # positions 119..139: crosses a split edge (128)
    alone = P.call(impl, [target], 16, seed=0)[0]
    for trial in range(2):
        others = []
        for s in range(1, len(lengths)):
            L = lengths[s]
            n = min(L, [1, 13, L][torch.randint(0, 3, (1,), generator=g).item()])
            others.append((s, L, n))
        others += [(None, 0, 0), (None, 0, 1)]
        perm = torch.randperm(len(others), generator=g).tolist()
        others = [others[i] for i in perm][: 2 + trial]
        for slot in range(len(others) + 1):
            items = others[:slot] + [target] + others[slot:]
            outs = P.call(impl, items, 16, seed=100 * trial + slot, extra_blocks=7 * slot)
            assert_same_bits(outs[slot], alone, f"trial {trial} slot {slot}")
    # Only the block ids change here: permute the physical layout.
    for seed in range(2):
        assert_same_bits(P.call(impl, [target], 16, seed=77 + seed, extra_blocks=30)[0], alone,
                         f"block permutation {seed}")


@pytest.mark.parametrize("impl", IMPLS)
def test_block_size_does_not_change_bits(impl):
    """Tiles are anchored at token positions, not blocks: the page size of
    the cache cannot show in the bits either."""
    P = Problem([100], 4, 4, 16, torch.bfloat16, seed=8)
    items = [(0, 100, 10)]
    base = P.call(impl, items, 1)[0]
    for bs in (4, 16):
        assert_same_bits(P.call(impl, items, bs)[0], base, f"block_size {bs}")


def test_decode_parallel_vs_sequential_vs_prefill():
    """Parallel split decode (partials + merge kernel) == sequential split
    decode == prefill, for a batch with mixed lengths and padding rows, and
    for a grid sized from a larger max_seq_len (CUDA-graph bucket)."""
    lengths = [257, 1, 64, 129, 200]
    P = Problem(lengths, 4, 1, 32, torch.bfloat16, seed=21)
    items = [(0, 257, 1), (None, 0, 1), (1, 1, 1), (2, 64, 1), (None, 0, 0), (3, 129, 1), (4, 200, 1)]
    seq = P.call("triton", items, 16, decode_parallel=False)
    par = P.call("triton", items, 16, decode_parallel=True, max_seq_len=512)
    auto = P.call("triton", items, 16, max_seq_len=512)
    for i, (s, L, n) in enumerate(items):
        assert_same_bits(par[i], seq[i], f"parallel vs sequential, entry {i}")
        assert_same_bits(auto[i], seq[i], f"auto vs sequential, entry {i}")
        if s is not None:
            pre = P.call("triton", [(s, L, min(L, 5))], 16)[0][-1:]
            assert_same_bits(seq[i], pre, f"decode vs prefill, entry {i}")
        else:
            assert (bits(seq[i]) == 0).all() and (bits(par[i]) == 0).all()


def test_empty_batch_and_all_padding():
    P = Problem([5], 2, 1, 16, torch.float32)
    for impl in IMPLS:
        outs = P.call(impl, [(None, 0, 0), (None, 0, 1), (None, 0, 0)], 4)
        assert outs[1].shape == (1, 2, 16) and (bits(outs[1]) == 0).all()
    outs = P.call("triton", [(None, 0, 1), (None, 0, 1)], 4, decode_parallel=True, max_seq_len=300)
    assert all((bits(o) == 0).all() for o in outs)


def _ops_attention(mode, q, k_cache, v_cache, block_table, cu, seq_lens, scale, *, max_query_len, max_seq_len,
                   kv_split_size, decode_parallel_splits):
    """The op shim (what the engine and the trainer call) in numerics `mode`."""
    from vllm.forward_context import ForwardContext, set_forward_context
    from vllm.kernels import ops
    assert kv_split_size == attn.KV_SPLIT_SIZE and decode_parallel_splits is None
    with set_forward_context(ForwardContext(None, mode)):
        return ops.attention(q, k_cache, v_cache, block_table, cu, seq_lens, scale, max_query_len=max_query_len,
                             max_seq_len=max_seq_len)


@pytest.mark.parametrize("mode", ["fast", "invariant"])
def test_cpu_dispatch_is_the_cpu_version(mode):
    """The op shim on CPU tensors runs paged_attention_cpu in both modes (the CPU engine
    and a CPU trainer therefore share one implementation), prefill and decode."""
    P = Problem([30, 70, 600], 4, 2, 16, torch.float32, seed=9)
    for items in ([(0, 30, 30), (1, 70, 1), (None, 0, 0), (2, 600, 3)], [(0, 30, 1), (2, 600, 1)]):
        for a, b in zip(P.call("dispatch", items, 4, split=attn.KV_SPLIT_SIZE, mode=mode),
                        P.call("torch", items, 4, split=attn.KV_SPLIT_SIZE)):
            assert_same_bits(a, b, f"{mode}: dispatch vs torch")


def test_rejects_bad_split_size():
    P = Problem([5], 2, 1, 16, torch.float32)
    with pytest.raises(ValueError):
        P.call("triton", [(0, 5, 5)], 4, split=KV_TILE + 1)
    with pytest.raises(ValueError):
        P.call("torch", [(0, 5, 5)], 4, split=KV_TILE // 2)


# --------------------------------------------------------------------------
# GPU: realistic sizes (bf16, head_dim 128, 32 q heads / 8 kv heads)
# --------------------------------------------------------------------------
GPU_HQ, GPU_HKV, GPU_D = 32, 8, 128


@pytest.mark.gpu
def test_gpu_matches_reference():
    lengths = [1, 17, 1000, 4096, 3000]
    P = Problem(lengths, GPU_HQ, GPU_HKV, GPU_D, torch.bfloat16, seed=1)
    items = [(0, 1, 1), (1, 17, 17), (2, 1000, 1000), (3, 4096, 300), (4, 3000, 1), (None, 0, 1)]
    for split in (attn.KV_SPLIT_SIZE, 128):
        outs = P.call("triton", items, 16, split=split)
        for (s, L, n), o in zip(items, outs):
            if s is None:
                assert (bits(o) == 0).all()
                continue
            torch.testing.assert_close(o.double(), P.reference(s, L, n), atol=2e-2, rtol=2e-2)
    dec = [(s, L, 1) for s, L in enumerate(lengths)]
    for parallel in (False, True):
        for (s, L, n), o in zip(dec, P.call("triton", dec, 16, decode_parallel=parallel)):
            torch.testing.assert_close(o.double(), P.reference(s, L, n), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_prefill_chunked_decode_same_bits():
    L = 4096 - 37  # not a multiple of block, tile or split
    P = Problem([L], GPU_HQ, GPU_HKV, GPU_D, torch.bfloat16, seed=2)
    full = by_position(P.call("triton", [(0, L, L)], 16), [(0, L, L)])

    def check(table, what):
        for key, o in table.items():
            assert_same_bits(o, full[key], f"{what} at position {key[1]}")

    for chunk in (1000, 512, 333, 37):
        done = 0
        while done < L:
            c = min(chunk, L - done)
            done += c
            check(by_position(P.call("triton", [(0, done, c)], 16), [(0, done, c)]), f"chunk {chunk}")
    # Token-by-token decode at every position, batched 64 decode rows a call
    # (covers BLOCK_M 16 decode tiles vs 128-row prefill tiles), with both
    # decode variants.
    for parallel in (False, True):
        for lo in range(0, L, 64):
            items = [(0, p + 1, 1) for p in range(lo, min(L, lo + 64))]
            outs = P.call("triton", items, 16, decode_parallel=parallel, share_blocks=True)
            check(by_position(outs, items),
                  f"decode parallel={parallel}")


@pytest.mark.gpu
def test_gpu_batch_composition_same_bits():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 4096, (64,), generator=g).tolist()
    lengths[0] = 2500
    P = Problem(lengths, GPU_HQ, GPU_HKV, GPU_D, torch.bfloat16, seed=3)
    targets = [(0, 2500, 300), (0, 2500, 1)]
    for target in targets:
        alone = P.call("triton", [target], 16)[0]
        for trial in range(3):
            others = []
            for s in range(1, 64):
                L = lengths[s]
                n = 1 if target[2] == 1 else [1, min(L, 64), L][torch.randint(0, 3, (1,), generator=g).item()]
                others.append((s, L, n))
            slot = torch.randint(0, 64, (1,), generator=g).item()
            items = others[:slot] + [target] + others[slot:]
            outs = P.call("triton", items, 16, seed=trial, decode_parallel=None)
            assert_same_bits(outs[slot], alone, f"{target} trial {trial} slot {slot}")


@pytest.mark.gpu
def test_gpu_cuda_graph_decode():
    """Decode (parallel splits) captured in a CUDA graph and replayed with new
    lengths gives the same bits as eager calls."""
    lengths = [4000, 100, 2048]
    P = Problem(lengths, GPU_HQ, GPU_HKV, GPU_D, torch.bfloat16, seed=4)
    bs, width, nblk = 16, 256, 2048
    dev = "cuda"
    k_cache = torch.randn(nblk, bs, GPU_HKV, GPU_D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(nblk - 1, device=dev)[: 4 * width].view(4, width).int() + 1
    q = torch.randn(4, GPU_HQ, GPU_D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(5, dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([4000, 100, 2048, 0], dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    kw = dict(max_query_len=1, max_seq_len=width * bs, decode_parallel_splits=True)
    attn.paged_attention_triton(q, k_cache, v_cache, block_table, cu, seq_lens, P.scale, out, **kw)  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.paged_attention_triton(q, k_cache, v_cache, block_table, cu, seq_lens, P.scale, out, **kw)
    for new_lens in ([4000, 100, 2048, 0], [17, 4096, 1, 0], [1, 2, 3, 0]):
        seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager = attn.paged_attention_triton(q, k_cache, v_cache, block_table, cu, seq_lens, P.scale,
                                     max_query_len=1, max_seq_len=width * bs,
                                     decode_parallel_splits=False)
        assert_same_bits(out, eager, f"graph replay {new_lens}")
        assert (bits(out[3]) == 0).all()
