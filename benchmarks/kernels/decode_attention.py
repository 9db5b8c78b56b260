"""Decode attention as the engine runs it: why does it move fewer bytes/s than the kernel benchmark?

The engine's profile (benchmarks/profile_kernels.py) showed ~2 TB/s for 256-sequence decode
steps at contexts 512-768, while benchmarks/kernels/attention.py measured 3.1-3.7 TB/s at
contexts that are whole splits (512, 2048). This script separates the suspects:
context length (a partial last split), the size of the cache the blocks are scattered over
(TLB reach: the engine's cache is ~100 GB), launch parameters (warps/stages; speed only),
and parallel splits (same bits). Every variant's output is compared bit for bit with the
default launch.

    python benchmarks/kernels/decode_attention.py [--big-cache-gib 80]
"""
from __future__ import annotations

import argparse

import torch
import triton

from vllm.kernels import attention as A

H, HKV, D, BS = 32, 8, 128, 16


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def make_inputs(lens, cache_blocks: int):
    blocks = [-(-n // BS) for n in lens]
    need = sum(blocks) + 1
    cache_blocks = max(cache_blocks, need)
    kc = torch.empty(cache_blocks, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty(cache_blocks, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    # random blocks anywhere in the cache (the engine's free list after some churn)
    chosen = torch.randperm(cache_blocks - 1, device="cuda")[: need - 1] + 1
    kc[chosen] = torch.randn(len(chosen), BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc[chosen] = torch.randn(len(chosen), BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    off = 0
    for i, b in enumerate(blocks):
        table[i, :b] = chosen[off:off + b].int()
        off += b
    q = torch.randn(len(lens), H, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)
    sl = torch.tensor(lens, device="cuda", dtype=torch.int32)
    return q, kc, vc, table, cu, sl


def run(q, kc, vc, table, cu, sl, max_seq_len, warps, stages, splits=None):
    old = A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES
    A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES = warps, stages
    try:
        return A.paged_attention(q, kc, vc, table, cu, sl, D ** -0.5, max_query_len=1, max_seq_len=max_seq_len,
                                 decode_parallel_splits=splits)
    finally:
        A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES = old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--big-cache-gib", type=float, default=80.0)
    ap.add_argument("--contexts", default="512,528,640,768,mixed")
    args = ap.parse_args()
    n = args.num_seqs
    block_bytes = BS * HKV * D * 2 * 2  # k + v
    big_blocks = int(args.big_cache_gib * 2**30 / block_bytes)
    variants = [(4, 3, None), (4, 2, None), (4, 4, None), (8, 3, None), (8, 2, None), (2, 3, None), (4, 3, True)]
    print(f"== decode attention, {n} seqs, H={H} Hkv={HKV} D={D} block {BS}; us (TB/s); bits vs default")
    print(f"{'context':>8} {'cache':>7} " + " ".join(f"{f'w{w}s{s}' + ('+split' if sp else ''):>16}" for w, s, sp in variants))
    g = torch.Generator().manual_seed(0)
    for ctx in args.contexts.split(","):
        if ctx == "mixed":
            lens = torch.randint(513, 769, (n,), generator=g).tolist()
        else:
            lens = [int(ctx)] * n
        for cache_name, cache_blocks in (("small", 0), ("big", big_blocks)):
            q, kc, vc, table, cu, sl = make_inputs(lens, cache_blocks)
            kv_bytes = sum(lens) * HKV * D * 2 * 2
            ref = run(q, kc, vc, table, cu, sl, 784, 4, 3)
            cells = []
            for w, s, sp in variants:
                out = run(q, kc, vc, table, cu, sl, 784, w, s, sp)
                same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                t = bench(lambda: run(q, kc, vc, table, cu, sl, 784, w, s, sp))
                cells.append(f"{t:7.1f} ({kv_bytes / t / 1e6:4.2f}){'' if same else '!'}")
            print(f"{ctx:>8} {cache_name:>7} " + " ".join(f"{c:>16}" for c in cells), flush=True)
            del q, kc, vc, table
            torch.cuda.empty_cache()
    print("('!' = bits differ from the default launch: must never appear)")


if __name__ == "__main__":
    main()
