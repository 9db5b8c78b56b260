"""Host time per GEMM launch (us), with the GPU kept busy so the host never waits.

Eager invariant GEMMs at small M measured 20-60 us slower than inside CUDA graphs
(benchmarks/NOTES.md) while cuBLAS lost ~4 us: this splits our launch into
its parts -- the `invariant_matmul` wrapper, the Triton launcher of the plain kernel, and
the TMA path (host tensor descriptors) -- next to `F.linear`.

    python benchmarks/kernels/launch_overhead.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
import triton

from vllm.kernels import matmul


def host_us(fn, calls: int = 200) -> float:
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    for _ in range(4):  # ~10 ms of queued GPU work: the launches below never wait for the GPU
        busy @ busy
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return dt


def main() -> None:
    K, N, M = 4096, 4096, 16
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    cfg = ("plain", 16, 64, 256, 4, 4)
    _, bm, bn, bk, warps, stages = cfg

    def raw_plain():
        matmul._invariant_matmul_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
            x, w, c, c, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), c.stride(0), c.stride(1),
            HAS_BIAS=False, BM=bm, BN=bn, BK=bk, GROUP_M=8, EVEN_K=True, SPLITS=1, SPLIT_STEPS=K // bk,
            num_warps=warps, num_stages=stages)

    def descriptors():
        from triton.tools.tensor_descriptor import TensorDescriptor
        return (TensorDescriptor.from_tensor(x, [16, 64]), TensorDescriptor.from_tensor(w, [64, 64]),
                TensorDescriptor.from_tensor(c, [16, 64]))

    rows = [
        ("F.linear (cuBLAS)", lambda: F.linear(x, w)),
        ("pick_config only", lambda: matmul.pick_config(M, N, K)),
        ("TensorDescriptor x3 only", descriptors),
        ("raw Triton launch, plain kernel", raw_plain),
        ("invariant_matmul, table config", lambda: matmul.invariant_matmul(x, w)),
        ("invariant_matmul, plain", lambda: matmul.invariant_matmul(x, w, config=cfg)),
        ("invariant_matmul, tma", lambda: matmul.invariant_matmul(x, w, config=("tma", 16, 64, 256, 4, 4))),
    ]
    print(f"== host time per call, M={M} K={K} N={N} (GPU kept busy)")
    for name, fn in rows:
        print(f"{name:<36}{host_us(fn):8.1f} us")


if __name__ == "__main__":
    main()
