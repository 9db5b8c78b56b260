"""Decode attention with an FP8 KV cache vs the bf16 cache: the same paged kernel, the same
sequences, measured side by side. Bandwidth counts the bytes the cache holds for the
context (K + V payload, plus the fp32 scales of the FP8 cache), so it is the rate at which
the kernel consumes context; the FP8 row's time ratio is the speed-up decode gets.

    python benchmarks/kernels/fp8_decode_attention.py [--num-seqs 256] [--contexts 512,2048,8192] [--sweep]

--sweep: also time each cache under every (num_warps, num_stages) of SWEEP for the decode
launch (attention.DECODE_NUM_WARPS / DECODE_NUM_WARPS_FP8 / DECODE_NUM_STAGES), checking each
computes the shipped launch's bits, and print the best per cache.
"""
from __future__ import annotations

import argparse

import torch
import triton

from vllm.kernels import attention, fp8
from vllm.kernels.attention import paged_attention_triton

H, HKV, D, BS = 32, 8, 128, 16
SWEEP = [(4, 3), (2, 2), (2, 3), (2, 4), (1, 2), (1, 3), (1, 4)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--sweep", action="store_true", help="time every decode launch config of SWEEP")
    args = ap.parse_args()
    sweep_rows = []
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
        if args.sweep:
            shipped = (attention.DECODE_NUM_WARPS, attention.DECODE_NUM_WARPS_FP8, attention.DECODE_NUM_STAGES)
            y16, y8 = ref().view(torch.int16), f8().view(torch.int16)
            for w, st in SWEEP:
                attention.DECODE_NUM_WARPS, attention.DECODE_NUM_WARPS_FP8, attention.DECODE_NUM_STAGES = w, w, st
                try:
                    same = torch.equal(ref().view(torch.int16), y16) and torch.equal(f8().view(torch.int16), y8)
                    c16, c8 = bench(ref), bench(f8)
                except Exception as err:  # noqa: BLE001 -- a launch that does not fit: say so, go on
                    print(f"    w{w} s{st}: {type(err).__name__}")
                    continue
                finally:
                    attention.DECODE_NUM_WARPS, attention.DECODE_NUM_WARPS_FP8, attention.DECODE_NUM_STAGES = shipped
                sweep_rows.append((L, w, st, c16, c8, same))
                print(f"    w{w} s{st}: bf16 {c16:.1f} us  fp8 {c8:.1f} us  fp8 vs shipped bf16 {t16 / c8:.2f}x"
                      f"  same bits {same}")
    if sweep_rows:
        for col, name in ((3, "bf16"), (4, "fp8")):
            totals = {}
            for r in sweep_rows:
                totals[(r[1], r[2])] = totals.get((r[1], r[2]), 0.0) + r[col]
            (w, st), tot = min(totals.items(), key=lambda kv: kv[1])
            print(f"fp8 decode sweep best ({name} cache): num_warps={w} num_stages={st}, "
                  f"sum {tot:.0f} us over contexts; all bits same: {all(r[5] for r in sweep_rows)}")


if __name__ == "__main__":
    main()
