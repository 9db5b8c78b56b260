"""Decode attention with an FP8 KV cache vs the bf16 cache: the same paged kernel, the same
sequences, measured side by side. Bandwidth counts the bytes the cache holds for the
context (K + V payload, plus the fp32 scales of the FP8 cache), so it is the rate at which
the kernel consumes context; the FP8 row's time ratio is the speed-up decode gets.

    python benchmarks/kernels/fp8_decode_attention.py [--num-seqs 256] [--contexts 512,2048,8192]
"""
from __future__ import annotations

import argparse

import torch
import triton

from vllm.kernels import fp8
from vllm.kernels.attention import paged_attention_triton

H, HKV, D, BS = 32, 8, 128, 16


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--contexts", default="512,2048,8192")
    args = ap.parse_args()
    print(f"{'context':>8}{'bf16 us':>10}{'fp8 us':>10}{'bf16 TB/s':>11}{'fp8 TB/s':>10}{'speed-up':>10}{'max |diff|':>12}")
    for L in map(int, args.contexts.split(",")):
        n = max(1, min(args.num_seqs, (1 << 21) // L))  # keep the cache within ~16 GB of bf16
        nb = n * -(-L // BS)
        g = torch.Generator(device="cuda").manual_seed(L)
        k = torch.randn(nb, BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(nb, BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        kq, ks = fp8.quantize_kv(k)
        vq, vs = fp8.quantize_kv(v)
        table = torch.randperm(nb, device="cuda", generator=g).int().view(n, -1)
        q = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        cu = torch.arange(n + 1, device="cuda", dtype=torch.int32)
        sl = torch.full((n,), L, device="cuda", dtype=torch.int32)
        common = dict(max_query_len=1, max_seq_len=L)
        ref = lambda: paged_attention_triton(q, k, v, table, cu, sl, D ** -0.5, **common)
        f8 = lambda: paged_attention_triton(q, kq, vq, table, cu, sl, D ** -0.5, k_scale=ks, v_scale=vs, **common)
        t16, t8 = bench(ref), bench(f8)
        diff = (ref().float() - f8().float()).abs().max().item()
        b16 = 2 * n * L * HKV * D * 2
        b8 = 2 * n * L * HKV * (D + 4)
        print(f"{L:>8}{t16:>10.1f}{t8:>10.1f}{b16 / t16 / 1e6:>11.2f}{b8 / t8 / 1e6:>10.2f}{t16 / t8:>10.2f}{diff:>12.2e}")
        print(f"fp8 decode attention: context {L}, {n} seqs: fp8 {t16 / t8:.2f}x the bf16 cache's speed")


if __name__ == "__main__":
    main()
