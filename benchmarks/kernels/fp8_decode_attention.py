"""Decode attention over an FP8 KV cache vs the bf16 cache, side by side on the same
sequences: the FP8 read is the dequantization of the step's blocks into the model-dtype copy
(vllm/kernels/cache_dequant.py) followed by the bf16 attention kernel, so it must give the
bf16 cache's bits when that cache holds the round-tripped values (checked, printed).

    python benchmarks/kernels/fp8_decode_attention.py [--num-seqs 256] [--contexts 512,2048,8192]

Columns: the bf16 kernel alone, the FP8 read (dequantization + kernel) and the
dequantization alone, in us (median GPU time), and the rate at which each consumes the
context's cache bytes (K + V payload, plus the fp32 scales of the FP8 cache).
"""
from __future__ import annotations

import argparse

import torch
import triton

from vllm.kernels import fp8
from vllm.kernels.attention import paged_attention_triton
from vllm.kernels.cache_dequant import dequant_kv_blocks_triton

H, HKV, D, BS = 32, 8, 128, 16


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--contexts", default="512,2048,8192")
    args = ap.parse_args()
    print(f"{'context':>8}{'seqs':>6}{'bf16 us':>10}{'fp8 us':>10}{'dequant us':>12}{'bf16 TB/s':>11}{'fp8 TB/s':>10}"
          f"{'fp8/bf16':>10}{'same bits':>11}")
    for L in map(int, args.contexts.split(",")):
        n = max(1, min(args.num_seqs, (1 << 21) // L))  # keep the cache within ~16 GB of bf16
        nb = n * -(-L // BS)
        g = torch.Generator(device="cuda").manual_seed(L)
        k = torch.randn(nb, BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(nb, BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        kq, ks = fp8.quantize_kv(k)
        vq, vs = fp8.quantize_kv(v)
        krt, vrt = fp8.dequantize_kv(kq, ks, torch.bfloat16), fp8.dequantize_kv(vq, vs, torch.bfloat16)
        kd, vd = torch.empty_like(k), torch.empty_like(v)
        table = torch.randperm(nb, device="cuda", generator=g).int().view(n, -1)
        q = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        cu = torch.arange(n + 1, device="cuda", dtype=torch.int32)
        sl = torch.full((n,), L, device="cuda", dtype=torch.int32)
        common = dict(max_query_len=1, max_seq_len=L)
        ref = lambda: paged_attention_triton(q, krt, vrt, table, cu, sl, D ** -0.5, **common)
        deq = lambda: dequant_kv_blocks_triton(kq, vq, ks, vs, kd, vd, table, sl, L)

        def f8():
            deq()
            return paged_attention_triton(q, kd, vd, table, cu, sl, D ** -0.5, **common)

        t16, t8, tdq = bench(ref), bench(f8), bench(deq)
        same = torch.equal(ref().view(torch.int16), f8().view(torch.int16))
        b16 = 2 * n * L * HKV * D * 2
        b8 = 2 * n * L * HKV * (D + 4)
        print(f"{L:>8}{n:>6}{t16:>10.1f}{t8:>10.1f}{tdq:>12.1f}{b16 / t16 / 1e6:>11.2f}{b8 / t8 / 1e6:>10.2f}"
              f"{t16 / t8:>10.2f}{str(same):>11}")
        print(f"fp8 decode attention: context {L}, {n} seqs: fp8 read {t16 / t8:.2f}x the bf16 cache's speed, "
              f"bits equal to the bf16 cache of the round trip: {same}")


if __name__ == "__main__":
    main()
