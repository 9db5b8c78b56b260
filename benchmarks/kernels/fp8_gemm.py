"""FP8 block-scaled invariant GEMM vs bf16 invariant GEMM vs bf16 cuBLAS, over M, at Qwen3-8B
shapes (N, K from benchmarks/configs/qwen3-8b.json), measured side by side in one run.

Columns: microseconds per call (triton.testing.do_bench median) of
  fp8 gemm   - vllm.kernels.fp8_gemm.fp8_gemm_triton on pre-quantized activations (the GEMM alone)
  fp8 linear - the layer's op: activation quantization + the GEMM
  bf16 inv   - vllm.kernels.matmul.invariant_matmul
  cuBLAS     - torch.matmul in bf16
and the ratio bf16 inv / fp8 gemm (target >= 1.5 for M >= 1024). Each shape also checks
that the FP8 GEMM's rows do not depend on M (row block 0..15 of every M equals M=16's bits).

    python benchmarks/kernels/fp8_gemm.py [--ms 1,16,...] [--sweep]   # --sweep: try tile configs
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from vllm.kernels import fp8
from vllm.kernels.fp8_gemm import GEMM_CONFIG, fp8_gemm_triton, fp8_linear_triton
from vllm.kernels.matmul import invariant_matmul

MS = [1, 16, 64, 256, 1024, 2048, 4096, 8192]
SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=w, num_stages=s)
         for bm in (64, 128) for bn in (128, 256) for w in (4, 8) for s in (3, 4)]


def shapes(cfg_path: str) -> dict[str, tuple[int, int]]:
    with open(cfg_path) as f:
        c = json.load(f)
    h, hd = c["hidden_size"], c["head_dim"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    return {"qkv": (h, qkv), "o": (c["num_attention_heads"] * hd, h),
            "gate_up": (h, 2 * c["intermediate_size"]), "down": (c["intermediate_size"], h)}


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "qwen3-8b.json"))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--sweep", action="store_true", help="time every tile config of SWEEP at M >= 1024")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    torch.manual_seed(0)
    rows = []
    print(f"FP8 GEMM config: {GEMM_CONFIG}")
    print(f"{'shape':<8}{'M':>6}{'fp8 gemm':>10}{'fp8 lin':>10}{'bf16 inv':>10}{'cuBLAS':>10}"
          f"{'inv/fp8':>9}{'cublas/fp8':>11}{'TFLOP/s fp8':>12}")
    for name, (K, N) in shapes(args.config).items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        wq, ws = fp8.quantize_weight(w)
        x_all = torch.randn(max(ms), K, device="cuda", dtype=torch.bfloat16)
        ref_rows = fp8_gemm_triton(*fp8.quantize_act(x_all[:16]), wq, ws, None, torch.bfloat16).view(torch.int16)
        invariant = True
        for M in ms:
            x = x_all[:M]
            xq, xs = fp8.quantize_act(x)
            y = fp8_gemm_triton(xq, xs, wq, ws, None, torch.bfloat16)
            head = y[:16].view(torch.int16)
            invariant &= torch.equal(head, ref_rows[:head.shape[0]])
            t8 = bench(lambda: fp8_gemm_triton(xq, xs, wq, ws, None, torch.bfloat16))
            tl8 = bench(lambda: fp8_linear_triton(x, wq, ws, None))
            tinv = bench(lambda: invariant_matmul(x, w))
            tcb = bench(lambda: torch.matmul(x, w.t()))
            r = dict(shape=name, M=M, K=K, N=N, fp8_us=t8, fp8_linear_us=tl8, bf16_invariant_us=tinv, cublas_us=tcb)
            rows.append(r)
            print(f"{name:<8}{M:>6}{t8:>10.1f}{tl8:>10.1f}{tinv:>10.1f}{tcb:>10.1f}{tinv / t8:>9.2f}{tcb / t8:>11.2f}"
                  f"{2 * M * N * K / t8 / 1e6:>12.0f}")
            if args.sweep and M >= 1024:
                for cfg in SWEEP:
                    try:
                        t = bench(lambda: fp8_gemm_triton(xq, xs, wq, ws, None, torch.bfloat16, config=cfg))
                    except Exception as err:  # noqa: BLE001 -- a config that does not compile/fit
                        print(f"    sweep {cfg}: {type(err).__name__}")
                        continue
                    print(f"    sweep {cfg}: {t:.1f} us ({tinv / t:.2f}x bf16 inv)")
        print(f"fp8 bits: {name} rows 0..15 equal across M = {invariant}")
    big = [r for r in rows if r["M"] >= 1024]
    if big:
        worst = min(r["bf16_invariant_us"] / r["fp8_us"] for r in big)
        print(f"fp8 summary: min (bf16 invariant / fp8) over M >= 1024 = {worst:.2f} (target >= 1.5)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
