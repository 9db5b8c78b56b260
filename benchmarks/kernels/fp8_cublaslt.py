"""cuBLASLt's block-scaled FP8 GEMM (vllm/kernels/fp8_cublaslt.py) against the Triton FP8 GEMM
and the bf16 invariant GEMM, at Qwen3-8B shapes, in one run:

1. correctness: against the float32 product of the dequantized operands;
2. bits: whether each M's rows equal the largest M's rows (a batch-
   invariant kernel), whether every algorithm cuBLAS offers computes the same bits, and
   whether they equal the Triton kernel's;
3. speed, in CUDA graphs: bf16 invariant / cuBLASLt fp8 and bf16 invariant / Triton fp8;
4. every ranked algorithm timed at --algo-ms (a table could pick the fastest).

Read: "cublaslt bits: ... rows equal across M = True; every algorithm same bits = True;
== triton = True" per shape, and the "cublaslt summary" line (target >= 1.5 at M >= 1024).

    python benchmarks/kernels/fp8_cublaslt.py [--ms 1,16,...] [--json-out F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import fp8_gemm as bench_mod  # noqa: E402  (this folder: shapes, weight copies, graph timer)
from vllm.kernels import fp8, fp8_cublaslt  # noqa: E402
from vllm.kernels.fp8_gemm import fp8_gemm_triton  # noqa: E402
from vllm.kernels.matmul import invariant_matmul  # noqa: E402

MS = [16, 64, 256, 1024, 2048, 4096, 8192]
CHECK_MS = [4, 8, 12, 16, 64, 100, 128, 192, 256, 1000, 1024, 1028, 2048, 4096, 8192]  # cuBLAS: M % 4 == 0


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


def correctness(shp) -> dict:
    """cuBLASLt against the float32 product of the dequantized operands: the error of the
    bf16 output only when cuBLAS reads the scales in the layouts the module gives it (the
    other three (activation, weight) layout combinations measured 10-30% off)."""
    K, N = shp["gate_up"]
    M = 256
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wq, ws = fp8.quantize_weight(w)
    xq, xs = fp8.quantize_act(x)
    ref = torch.nn.functional.linear(fp8.dequantize_act(xq, xs, torch.float32),
                                     fp8.dequantize_weight(wq, ws, torch.float32))
    y = fp8_cublaslt.fp8_gemm_cublaslt(xq, xs, wq, ws, torch.float32)
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    print(f"cublaslt vs dequantized float32 product: max |err| / max |y| = {err:.2e}", flush=True)
    return {"max_rel_err": err}


def bits(shp) -> dict:
    out = {}
    for name, (K, N) in shp.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        wq, ws = fp8.quantize_weight(w)
        x = torch.randn(max(CHECK_MS), K, device="cuda", dtype=torch.bfloat16)
        xq, xs = fp8.quantize_act(x)
        full = fp8_cublaslt.fp8_gemm_cublaslt(xq, xs, wq, ws, torch.bfloat16)
        tri = fp8_gemm_triton(xq, xs, wq, ws, None, torch.bfloat16)
        same_m, cfgs = True, {}
        refused = []
        for M in CHECK_MS:
            try:
                y = fp8_cublaslt.fp8_gemm_cublaslt(xq[:M].clone(), xs[:M].clone(), wq, ws, torch.bfloat16)
            except fp8_cublaslt.CublasLtError as e:
                refused.append(M)
                print(f"  {name} M={M}: {e}", flush=True)
                continue
            eq = torch.equal(y.view(torch.int16), full[:M].view(torch.int16))
            same_m &= eq
            p = fp8_cublaslt.plan(0, M, N, K, K, torch.bfloat16)
            cfgs[M] = p.config()
            if not eq:
                print(f"  {name} M={M}: rows differ from M={max(CHECK_MS)} (max {ulp_diff(y, full[:M])} ulp)", flush=True)
        # every ranked algorithm at two sizes
        algos_same = True
        for M in (256, 4096):
            p = fp8_cublaslt.plan(0, M, N, K, K, torch.bfloat16)
            for i in range(1, len(p.candidates)):
                y = fp8_cublaslt.fp8_gemm_cublaslt(xq[:M].clone(), xs[:M].clone(), wq, ws, torch.bfloat16, algo_index=i)
                eq = torch.equal(y.view(torch.int16), full[:M].view(torch.int16))
                algos_same &= eq
                if not eq:
                    print(f"  {name} M={M} algo #{i} {p.config(p.candidates[i])}: differs "
                          f"({ulp_diff(y, full[:M])} ulp)", flush=True)
        eq_tri = torch.equal(full.view(torch.int16), tri.view(torch.int16))
        frac = (full.view(torch.int16) == tri.view(torch.int16)).float().mean().item()
        out[name] = dict(refused_ms=refused, rows_equal_across_m=same_m, all_algos_same=algos_same, equal_triton=eq_tri,
                         equal_triton_fraction=frac, max_ulp_vs_triton=ulp_diff(full, tri),
                         configs={str(m): c for m, c in cfgs.items()})
        print(f"cublaslt bits: {name} rows equal across M = {same_m}; every algorithm same bits = {algos_same}; "
              f"== triton = {eq_tri} ({frac:.4f} of elements, max {ulp_diff(full, tri)} ulp)", flush=True)
        print(f"  algos by M: " + "; ".join(f"{m}:{c.get('id')}/{c.get('tile')}/{c.get('stages')}/{c.get('cluster')}"
                                            for m, c in cfgs.items()), flush=True)
    return out


def speed(shp, ms) -> list[dict]:
    bench_mod.GRAPH = True
    rows = []
    print(f"{'shape':<8}{'M':>6}{'bf16 inv':>10}{'triton':>10}{'cublaslt':>10}{'inv/tri':>9}{'inv/lt':>9}"
          f"{'TFLOP/s lt':>11}", flush=True)
    for name, (K, N) in shp.items():
        cp = bench_mod.weight_copies(N, K)
        n = len(cp)
        x_all = torch.randn(max(ms), K, device="cuda", dtype=torch.bfloat16)
        for M in ms:
            x = x_all[:M]
            xq, xs = fp8.quantize_act(x)
            xs_lt = xs.t().contiguous().t()
            tinv = bench_mod.bench(lambda i: invariant_matmul(x, cp[i % n][0]))
            ttri = bench_mod.bench(lambda i: fp8_gemm_triton(xq, xs, cp[i % n][1], cp[i % n][2], None, torch.bfloat16))
            try:
                fp8_cublaslt.fp8_gemm_cublaslt(xq, xs_lt, cp[0][1], cp[0][2], torch.bfloat16)
            except fp8_cublaslt.CublasLtError:
                print(f"{name:<8}{M:>6}  cublaslt refuses", flush=True)
                continue
            tlt = bench_mod.bench(lambda i: fp8_cublaslt.fp8_gemm_cublaslt(xq, xs_lt, cp[i % n][1], cp[i % n][2],
                                                                           torch.bfloat16))
            rows.append(dict(shape=name, M=M, bf16_invariant_us=tinv, triton_us=ttri, cublaslt_us=tlt))
            print(f"{name:<8}{M:>6}{tinv:>10.1f}{ttri:>10.1f}{tlt:>10.1f}{tinv / ttri:>9.2f}{tinv / tlt:>9.2f}"
                  f"{2 * M * N * K / tlt / 1e6:>11.0f}", flush=True)
    big = [r for r in rows if r["M"] >= 1024]
    if big:
        print(f"cublaslt summary: min (bf16 invariant / cublaslt fp8) over M >= 1024 = "
              f"{min(r['bf16_invariant_us'] / r['cublaslt_us'] for r in big):.2f}, max "
              f"{max(r['bf16_invariant_us'] / r['cublaslt_us'] for r in big):.2f}; triton min "
              f"{min(r['bf16_invariant_us'] / r['triton_us'] for r in big):.2f} (target >= 1.5)", flush=True)
    return rows


def algos(shp, ms) -> dict:
    """Every algorithm cuBLAS ranks for a shape and M, timed in graphs (they all compute the
    same bits: `bits` checks it), so a table may pick the fastest."""
    bench_mod.GRAPH = True
    out = {}
    for name, (K, N) in shp.items():
        cp = bench_mod.weight_copies(N, K)
        n = len(cp)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xq, xs = fp8.quantize_act(x)
            xs = xs.t().contiguous().t()
            try:
                p = fp8_cublaslt.plan(0, M, N, K, K, torch.bfloat16, 0, (cp[0][2].data_ptr(), xs.data_ptr()))
            except fp8_cublaslt.CublasLtError as e:
                print(f"algos {name} M={M}: {e}", flush=True)
                continue
            times = []
            for i in range(len(p.candidates)):
                t = bench_mod.bench(lambda j, i=i: fp8_cublaslt.fp8_gemm_cublaslt(xq, xs, cp[j % n][1], cp[j % n][2],
                                                                                  torch.bfloat16, algo_index=i))
                times.append((t, i, p.config(p.candidates[i])))
            out[f"{name}/{M}"] = [dict(us=t, index=i, config=c) for t, i, c in times]
            best = min(times)
            print(f"algos {name} M={M}: " + "; ".join(f"#{i} {t:.1f}us id{c.get('id')} tile{c.get('tile')} "
                                                      f"st{c.get('stages')} cl{c.get('cluster')} sw{c.get('swizzle')}"
                                                      f" co{c.get('custom')}" for t, i, c in times)
                  + f"  -> best #{best[1]} ({times[0][0] / best[0]:.2f}x the first)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/qwen3-8b.json")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--algo-ms", default="", help="time every ranked algorithm at these M (e.g. 256,1024,4096)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    shp = bench_mod.shapes(args.config)
    print(f"cuBLASLt {fp8_cublaslt.version()}, torch {torch.__version__}", flush=True)
    res = {"correctness": correctness(shp)}
    res["bits"] = bits(shp)
    res["speed"] = speed(shp, list(map(int, args.ms.split(","))))
    if args.algo_ms:
        res["algos"] = algos(shp, list(map(int, args.algo_ms.split(","))))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
