"""The K-leaf tree GEMM of tensor parallelism at TP=1 against today's invariant GEMM and
cuBLAS, on Qwen3-8B's row-parallel shapes (o_proj, down_proj) over M.

For every (shape, M) it times: the fused tree kernel with G leaves (`tree_linear_triton`,
float32 out, rounded to bf16 as the layer does), the invariant GEMM (`invariant_matmul`,
bf16 out) and cuBLAS (`F.linear`), in CUDA graphs, and checks the tree's bits against one
invariant GEMM per leaf added by `tree_sum`. It prints tree / invariant (the target: at
most 1.05) and tree / cuBLAS (times: > 1 means the tree is slower), and writes every timing
to --json-out.

    python benchmarks/kernels/tp_tree.py [--leaves 8] [--shapes o,down] [--json-out tp_tree.json]
    python benchmarks/kernels/tp_tree.py --sweep    # every candidate tile per M (to set TREE_GPU_CONFIGS)
    python benchmarks/kernels/tp_tree.py --sweep --sweep-impls tmah,tmar   # some impls, beside the table's
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from gemm import bench_graph  # noqa: E402
from json_out import write_json_out  # noqa: E402

from vllm.kernels.leaf_tree import _tree_config, tree_linear_leafwise, tree_linear_triton  # noqa: E402
from vllm.kernels.matmul import invariant_matmul  # noqa: E402

SHAPES = {"o": (4096, 4096), "down": (12288, 4096)}  # name: (K, N)
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SWEEP_MS = [1, 16, 32, 64, 256, 1024, 4096, 16384]   # 32: the table's 64-row entry costs 1.9-2.5x there
# (impl, BM, BN, BK, warps, stages). "tmar" / "plainr" (one K loop over all leaves, the waiting
# subtrees in registers: four float32 tiles live at 8 leaves) are listed only where they do
# not spill, read offline for sm_90 at 8 leaves (ptxas -v on the recorded launches): none of
# 64x128 at 4 warps nor 128x128 fits; 16x64x128 "tmar" spills 12 bytes.
CANDIDATES = [("tmar", 16, 32, 128, 4, 4), ("tmar", 16, 32, 256, 4, 4), ("tmar", 64, 16, 128, 4, 4),
              ("tmar", 64, 32, 128, 4, 4), ("tmar", 64, 32, 128, 4, 6), ("tmar", 64, 32, 256, 4, 3),
              ("tmar", 64, 64, 128, 4, 4), ("tmar", 128, 32, 128, 4, 4), ("tmar", 64, 128, 64, 8, 4),
              ("tmar", 128, 64, 64, 8, 4), ("tmar", 128, 64, 128, 8, 3),
              ("plainr", 16, 16, 256, 4, 4), ("plainr", 16, 32, 128, 4, 4), ("plainr", 16, 32, 128, 4, 6),
              ("plainr", 16, 32, 256, 4, 4), ("plainr", 16, 32, 512, 4, 3), ("plainr", 16, 64, 256, 4, 4),
              ("plainr", 32, 32, 256, 4, 4),
              # 32-row tiles for M = 32 (the table's 64-row entry costs 1.9-2.5x there; offline:
              # 48-168 registers, no spill)
              ("plainr", 32, 32, 128, 4, 4), ("plainr", 32, 16, 256, 4, 4), ("plainr", 32, 64, 128, 4, 4),
              ("tmar", 32, 32, 128, 4, 4), ("tmar", 32, 16, 256, 4, 4), ("tmar", 32, 64, 128, 4, 4),
              # the hybrid: one K loop, the counter's top level in the L2 scratch, which leaves
              # registers for a 128 x 128 tile (offline, 8 leaves: 255 registers, a 56-byte spill)
              ("tmah", 128, 128, 64, 8, 3), ("tmah", 128, 128, 64, 8, 4),
              # at 2 or 4 leaves (tp_leaves for TP <= 2 / <= 4) "tmar" keeps 128 x 128 in registers
              # (offline: 153 / 205 registers, no spill; at 8 leaves it spills 312 bytes)
              ("tmar", 128, 128, 64, 8, 3), ("tmar", 128, 128, 64, 8, 4)]


def _time_graph(fn) -> float:
    """Milliseconds per call of `fn`, calls captured in one CUDA graph (gemm.bench_graph)."""
    return bench_graph(lambda i: fn(), 20) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaves", type=int, default=8)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--sweep", action="store_true", help="time every candidate tile per M (bits checked for each)")
    ap.add_argument("--sweep-ms", default=",".join(map(str, SWEEP_MS)))
    ap.add_argument("--sweep-impls", default=None,
                    help="comma-separated impls whose candidates the sweep times (default: all); the table's "
                         "own config is timed either way")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    if args.sweep:
        return sweep(args)
    rows = []
    print(f"{'shape':>6} {'M':>6} {'tree ms':>9} {'inv ms':>9} {'cublas ms':>9} {'tree/inv':>9} {'tree/cublas':>11} bits")
    for name, K, N, M, x, w in _problems(args.shapes, args.ms):
        same = torch.equal(tree_linear_triton(x, w, args.leaves).view(torch.int32),
                           tree_linear_leafwise(x, w, args.leaves).view(torch.int32))
        t_tree = _time_graph(lambda: tree_linear_triton(x, w, args.leaves).to(torch.bfloat16))
        t_inv = _time_graph(lambda: invariant_matmul(x, w))
        t_cub = _time_graph(lambda: F.linear(x, w))
        rows.append({"shape": name, "K": K, "N": N, "M": M, "leaves": args.leaves, "tree_ms": t_tree,
                     "invariant_ms": t_inv, "cublas_ms": t_cub, "bits_equal_leafwise": same})
        print(f"{name:>6} {M:>6} {t_tree:9.4f} {t_inv:9.4f} {t_cub:9.4f} {t_tree / t_inv:9.3f} "
              f"{t_tree / t_cub:11.3f} {'ok' if same else 'DIFFER'}")
    write_json_out(args.json_out, rows)


def _problems(shapes: str, ms: str):
    """(name, K, N, M, x, w) for every shape and M: random bf16 operands on the GPU."""
    for name in shapes.split(","):
        K, N = SHAPES[name]
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        for M in map(int, ms.split(",")):
            yield name, K, N, M, torch.randn(M, K, device="cuda", dtype=torch.bfloat16), w


def sweep(args) -> None:
    rows = []
    print(f"{'shape':>6} {'M':>6} {'inv ms':>8} {'table':>32} {'ms':>8} {'best':>32} {'ms':>8} {'best/inv':>8}")
    for name, K, N, M, x, w in _problems(args.shapes, args.sweep_ms):
        ref = tree_linear_leafwise(x, w, args.leaves).view(torch.int32)
        t_inv = _time_graph(lambda: invariant_matmul(x, w))
        times = {}
        table = _tree_config(M, args.leaves, K // args.leaves)
        impls = set(args.sweep_impls.split(",")) if args.sweep_impls else None
        for cfg in [c for c in CANDIDATES if impls is None or c[0] in impls] + [table]:
            if cfg in times:
                continue
            try:
                out = tree_linear_triton(x, w, args.leaves, config=cfg)
            except Exception as err:  # noqa: BLE001 -- e.g. OutOfResources (shared memory): not a candidate
                print(f"{name} M={M} {cfg}: {type(err).__name__}")
                continue
            if not torch.equal(out.view(torch.int32), ref):
                print(f"{name} M={M} {cfg}: bits DIFFER from one GEMM per leaf")
                continue
            times[cfg] = _time_graph(lambda: tree_linear_triton(x, w, args.leaves, config=cfg))
        if not times:
            print(f"{name:>6} {M:>6} no candidate ran")
            continue
        best = min(times, key=times.get)
        rows.append({"shape": name, "M": M, "invariant_ms": t_inv, "leaves": args.leaves,
                     "times": {",".join(map(str, c)): t for c, t in times.items()}})
        print(f"{name:>6} {M:>6} {t_inv:8.4f} {str(table):>32} {times.get(table, float('nan')):8.4f} "
              f"{str(best):>32} {times[best]:8.4f} {times[best] / t_inv:8.3f}", flush=True)
    write_json_out(args.json_out, rows)


if __name__ == "__main__":
    main()
