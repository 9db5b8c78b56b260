"""Decode attention as the engine runs it: why does it move fewer bytes/s than the kernel benchmark?

The engine's profile (benchmarks/profile_kernels.py) showed ~2 TB/s for 256-sequence decode
steps at contexts 512-768, while benchmarks/kernels/attention.py measured 3.1-3.7 TB/s at
contexts that are whole splits (512, 2048). This script separates the suspects:
context length (a partial last split), the size of the cache the blocks are scattered over
(TLB reach: the engine's cache is ~100 GB), launch parameters (warps/stages; speed only),
and parallel splits (same bits). Every variant's output is compared bit for bit with the
shipped launch.

    python benchmarks/kernels/decode_attention.py [--cache-gib 80] [--contexts 512,2048,mixed]
"""
from __future__ import annotations

import argparse

import torch
import triton

from vllm.kernels import attention as A

H, HKV, D, BS = 32, 8, 128, 16


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def make_inputs(lens, cache_blocks: int, q_len: int = 1, seed: int = 0):
    """Caches [blocks, BS, HKV, D] as the engine allocates them, each sequence's blocks
    scattered over the whole cache."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-n // BS) for n in lens]
    need = sum(blocks) + 1
    cache_blocks = max(cache_blocks, need)
    shape = (cache_blocks, BS, HKV, D)
    kc = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    # random blocks anywhere in the cache (the engine's free list after some churn)
    chosen = torch.randperm(cache_blocks - 1, device="cuda", generator=g)[: need - 1] + 1
    kc[chosen] = torch.randn(len(chosen), BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc[chosen] = torch.randn(len(chosen), BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    off = 0
    for i, b in enumerate(blocks):
        table[i, :b] = chosen[off:off + b].int()
        off += b
    q = torch.randn(len(lens) * q_len, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32) * q_len
    sl = torch.tensor(lens, device="cuda", dtype=torch.int32)
    return q, kc, vc, table, cu, sl


def run(q, kc, vc, table, cu, sl, max_q, max_seq_len, warps=4, stages=3, splits=None):
    old = A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES
    A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES = warps, stages
    try:
        return A.paged_attention_triton(q, kc, vc, table, cu, sl, D ** -0.5, max_query_len=max_q, max_seq_len=max_seq_len,
                                 decode_parallel_splits=splits)
    finally:
        A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES = old


# (label, run kwargs): launch parameters and parallel splits, all speed only
VARIANTS = [
    ("w4s3 (shipped)", {}),
    ("w4s4", {"stages": 4}),
    ("w8s3", {"warps": 8}),
    ("w2s3", {"warps": 2}),
    ("parallel splits", {"splits": True}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--cache-gib", type=float, default=40.0)
    ap.add_argument("--contexts", default="512,528,640,768,mixed")
    args = ap.parse_args()
    n = args.num_seqs
    block_bytes = BS * HKV * D * 2 * 2  # k + v
    cache_blocks = int(args.cache_gib * 2**30 / block_bytes)
    print(f"== decode attention, {n} seqs, H={H} Hkv={HKV} D={D} block {BS}, blocks scattered over "
          f"{args.cache_gib:.0f} GiB; us (TB/s); '!' = bits differ from the first column (must never appear)")
    print(f"{'context':>8} " + " ".join(f"{v[0]:>16}" for v in VARIANTS))
    g = torch.Generator().manual_seed(0)
    for ctx in args.contexts.split(","):
        lens = torch.randint(513, 769, (n,), generator=g).tolist() if ctx == "mixed" else [int(ctx)] * n
        kv_bytes = sum(lens) * HKV * D * 2 * 2
        # the engine's graphs pass max_model_len (784 in the throughput runs) as the bound; it
        # must bound every context, or parallel splits past it are never merged
        msl = max(784, max(lens))
        cells, ref = [], None
        q, kc, vc, table, cu, sl = make_inputs(lens, cache_blocks)
        for label, kw in VARIANTS:
            out = run(q, kc, vc, table, cu, sl, 1, msl, **kw)
            ref = out if ref is None else ref
            same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
            t = bench(lambda: run(q, kc, vc, table, cu, sl, 1, msl, **kw))
            cells.append(f"{t:7.1f} ({kv_bytes / t / 1e6:4.2f}){'' if same else '!'}")
        del q, kc, vc, table
        torch.cuda.empty_cache()
        print(f"{ctx:>8} " + " ".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
