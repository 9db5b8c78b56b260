"""Does page-locking a staging buffer stall the engine's GPU steps? (how a weight update
stages a checkpoint in host memory, vllm/weight_sync/staging.py)

    python benchmarks/pinned_staging.py [--gib 8] [--piece-mib 64]

A background thread page-locks --gib GiB of host memory in 1 GiB buckets while the main
thread runs "steps" (a small matmul and a synchronize, as a decode step would) and records
how long each took. Per way of pinning: the longest step and the 99th percentile against
the steps before pinning began, the time to pin, and the host-to-device bandwidth of a copy
out of the pinned memory (a copy spanning several separately registered pieces must still
run at the pinned rate, or piecewise registration is no win).

Ways: `torch` (torch.empty(pin_memory=True): cudaHostAlloc, the GIL held), `register`
(ordinary memory, then one cudaHostRegister per bucket, the GIL released), `pieces`
(ordinary memory, one cudaHostRegister per --piece-mib piece: on the H200 a copy spanning
two registrations fails with "invalid argument", so the staging registers whole buffers).
"""
from __future__ import annotations

import argparse
import threading
import time

import torch

GIB = 1 << 30


def _register(buf: torch.Tensor, piece: int) -> None:
    cudart = torch.cuda.cudart()
    base, n = buf.data_ptr(), buf.numel()
    for off in range(0, n, piece):
        err = cudart.cudaHostRegister(base + off, min(piece, n - off), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")


def _unregister(buf: torch.Tensor, piece: int) -> None:
    cudart = torch.cuda.cudart()
    for off in range(0, buf.numel(), piece):
        cudart.cudaHostUnregister(buf.data_ptr() + off)


def pin(way: str, gib: int, piece: int) -> list[torch.Tensor]:
    bufs = []
    for _ in range(gib):
        if way == "torch":
            bufs.append(torch.empty(GIB, dtype=torch.uint8, pin_memory=True))
        else:
            b = torch.empty(GIB, dtype=torch.uint8)
            b[::4096].zero_()   # fault the pages in first, as a staged read would
            _register(b, GIB if way == "register" else piece)
            bufs.append(b)
    return bufs


def steps_while(fn) -> tuple[list[float], float]:
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    done = threading.Event()
    out: dict = {}

    def run():
        t0 = time.perf_counter()
        out["bufs"] = fn()
        out["s"] = time.perf_counter() - t0
        done.set()

    times = []
    th = threading.Thread(target=run)
    th.start()
    while not done.is_set():
        t0 = time.perf_counter()
        (a @ a).sum().item()
        times.append(time.perf_counter() - t0)
    th.join()
    return times, out["s"], out["bufs"]


def h2d_gbps(src: torch.Tensor) -> float:
    dst = torch.empty(src.numel(), dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * src.numel() / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--piece-mib", type=int, default=64)
    ap.add_argument("--ways", default="torch,register,pieces")
    args = ap.parse_args()
    piece = args.piece_mib << 20
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    base = []
    for _ in range(200):
        t0 = time.perf_counter()
        (a @ a).sum().item()
        base.append(time.perf_counter() - t0)
    base.sort()
    print(f"steps with nothing pinning: median {base[100] * 1e3:.3f} ms, max {base[-1] * 1e3:.3f} ms")
    print(f"{'way':<10} {'pin s':>7} {'steps':>6} {'max step ms':>12} {'p99 ms':>8} {'H2D GB/s':>9} pinned")
    for way in args.ways.split(","):
        times, pin_s, bufs = steps_while(lambda: pin(way, args.gib, piece))
        times.sort()
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        gbps = h2d_gbps(bufs[0])
        print(f"{way:<10} {pin_s:7.2f} {len(times):6d} {times[-1] * 1e3:12.1f} {p99 * 1e3:8.2f} {gbps:9.1f} "
              f"{bufs[0].is_pinned()}", flush=True)
        if way != "torch":
            for b in bufs:
                _unregister(b, GIB if way == "register" else piece)
        del bufs
    pageable = torch.empty(GIB, dtype=torch.uint8)
    print(f"pageable (not pinned) H2D: {h2d_gbps(pageable):.1f} GB/s")


if __name__ == "__main__":
    main()
