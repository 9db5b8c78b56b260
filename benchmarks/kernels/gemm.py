"""Invariant GEMM vs cuBLAS on Qwen3-8B's shapes over M = 1 .. 16384.

For every (shape, M) it times cuBLAS (F.linear), our kernel with the shipped
config table, and (with --sweep) a list of candidate tile configs -- for
M >= 128 also in the persistent TMA variant (impl="tma") -- checking that every
candidate gives the same bits as the table's choice (neither tile shape nor
the load path may change bits). Prints ratios (cuBLAS time / ours: > 1 means faster).

    python benchmarks/kernels/gemm.py [--sweep] [--shapes qkv,o,gate_up,down,lm_head]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from vllm.kernels.matmul import invariant_matmul, pick_config

SHAPES = {  # name: (K, N)
    "qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096), "lm_head": (4096, 151936),
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

CANDIDATES = {
    # bucket upper M -> candidate (BM, BN, BK, warps, stages)
    16: [(16, 32, 256, 4, 4), (16, 64, 256, 4, 4), (16, 64, 128, 4, 5), (16, 128, 128, 4, 4), (16, 32, 512, 4, 3), (16, 64, 512, 8, 3)],
    32: [(32, 32, 256, 4, 4), (32, 64, 256, 4, 4), (32, 64, 128, 4, 5), (32, 128, 128, 4, 4), (16, 64, 256, 4, 4)],
    64: [(64, 64, 128, 4, 4), (64, 64, 256, 4, 3), (64, 128, 128, 4, 4), (32, 64, 256, 4, 4), (64, 32, 256, 4, 4)],
    128: [(64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (128, 64, 128, 4, 4), (64, 64, 128, 4, 4), (128, 128, 64, 8, 3)],
    256: [(128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4)],
    512: [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (64, 256, 64, 8, 3)],
    1 << 62: [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3)],
}


def bucket(m: int) -> int:
    for b in sorted(CANDIDATES):
        if m <= b:
            return b
    raise AssertionError


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    best_by_bucket: dict[int, dict] = {}
    for name in args.shapes.split(","):
        K, N = SHAPES[name]
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        out_dtype = torch.float32 if name == "lm_head" else torch.bfloat16
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t_cublas = bench(lambda: F.linear(x, w))
            ref = invariant_matmul(x, w, out_dtype=out_dtype)
            t_ours = bench(lambda: invariant_matmul(x, w, out_dtype=out_dtype))
            row = {"shape": name, "M": M, "K": K, "N": N, "cublas_us": t_cublas, "ours_us": t_ours,
                   "config": pick_config(M), "ratio": t_cublas / t_ours}
            if args.sweep:
                view = torch.int32 if out_dtype == torch.float32 else torch.int16
                best = (t_ours, pick_config(M))
                impls = ("plain", "tma") if M >= 128 else ("plain",)
                for cfg in CANDIDATES[bucket(M)]:
                    for impl in impls:
                        try:
                            out = invariant_matmul(x, w, out_dtype=out_dtype, config=cfg, impl=impl)
                        except Exception as err:  # e.g. out of shared memory
                            print(f"  {name} M={M} cfg={cfg} {impl}: {type(err).__name__}")
                            continue
                        if not torch.equal(out.view(view), ref.view(view)):
                            print(f"  !! {name} M={M} cfg={cfg} {impl} CHANGES BITS")
                            row.setdefault("bit_mismatch", []).append((cfg, impl))
                            continue
                        t = bench(lambda: invariant_matmul(x, w, out_dtype=out_dtype, config=cfg, impl=impl))
                        if t < best[0]:
                            best = (t, (cfg, impl))
                row["best_us"], row["best_config"] = best
                row["best_ratio"] = t_cublas / best[0]
                agg = best_by_bucket.setdefault(bucket(M), {})
                agg[best[1]] = agg.get(best[1], 0) + 1
            rows.append(row)
            tb = row["cublas_us"] * 1e-6
            print(f"{name:8s} M={M:6d} cublas {t_cublas:9.1f} us ({2 * M * K * N / tb / 1e12:6.1f} TF/s, "
                  f"{(N * K * 2 + M * K * 2) / tb / 1e12:5.2f} TB/s)  ours {t_ours:9.1f} us  x{row['ratio']:.2f}"
                  + (f"  best {row['best_us']:.1f} us x{row['best_ratio']:.2f} {row['best_config']}" if args.sweep else ""),
                  flush=True)
    print("\n== invariant GEMM / cuBLAS speed ratio (cuBLAS time / ours; >1 = faster than cuBLAS)")
    names = args.shapes.split(",")
    print("M".rjust(6) + "".join(n.rjust(10) for n in names))
    for M in map(int, args.ms.split(",")):
        print(str(M).rjust(6) + "".join(f"{next(r['ratio'] for r in rows if r['shape'] == n and r['M'] == M):10.2f}" for n in names))
    if args.sweep:
        print("best configs by bucket:", {b: sorted(v.items(), key=lambda kv: -kv[1])[:3] for b, v in best_by_bucket.items()})
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
