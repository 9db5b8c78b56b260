"""The MoE expert GEMMs on Qwen3-30B-A3B's shapes (128 experts, top 8, hidden 2048,
moe_intermediate 768), bf16, timed in CUDA graphs side by side over T = 1 .. 16384 tokens:

* invariant: our grouped Triton GEMM (rows sorted by expert, blocks never mixing experts,
  `acc = tl.dot(a, b, acc)` along K), gather of token rows inside the kernel;
* grouped_mm: torch._grouped_mm (CUTLASS) on expert-sorted rows (the `fast` baseline),
  including its row gather (absent if this torch lacks it);
* loop: one cuBLAS F.linear per expert on its gathered rows (per-expert row lists
  computed on the host beforehand, outside the timing).

Per T it times the up (gate_up) GEMM, the down GEMM, and the whole expert block (route
-> up -> SiLU-and-mul -> down -> merge), for uniform routing and for "crowded" routing
(every token on the same 8 experts), and checks bits: our rows at every T equal the same
rows at the largest T, and equal the dense invariant GEMM on that row. Prints
ratios (baseline time / ours: > 1 means ours is faster). --sweep times candidate tiles
(they must all give the same bits) to tune kernels/moe.py MOE_GPU_CONFIGS.

    python benchmarks/kernels/moe_gemm.py [--ts 1,16,256,4096] [--sweep] [--json-out moe_gemm.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from vllm.kernels import moe as K
from vllm.kernels import ops
from vllm.kernels.matmul import invariant_matmul

E, TOPK, H, I = 128, 8, 2048, 768
TS = [1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SWEEP = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 4, 3), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
         (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 4, 3), (64, 256, 64, 8, 3), (128, 128, 64, 8, 3),
         (128, 128, 64, 4, 4), (128, 256, 64, 8, 3)]


def bench_graph(call, reps: int = 8) -> float:
    """us per call of `call()`, `reps` calls captured in one CUDA graph (no host time)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    t = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3
    del graph
    return t / reps


def routing(T: int, crowded: bool, gen) -> torch.Tensor:
    if crowded:
        return torch.arange(TOPK, device="cuda").expand(T, TOPK).contiguous()
    return torch.argsort(torch.rand(T, E, generator=gen, device="cuda"), dim=-1)[:, :TOPK].contiguous()


def loop_calls(x, w, ids, a_from_tokens: bool):
    """Per-expert cuBLAS loop with host-side row lists (prepared outside the timing)."""
    flat = ids.reshape(-1)
    groups = []
    for e in torch.unique(flat).tolist():
        rows = (flat == e).nonzero(as_tuple=True)[0]
        groups.append((e, rows // TOPK if a_from_tokens else rows, rows))
    out = torch.empty(flat.numel(), w.shape[1], dtype=x.dtype, device=x.device)

    def call():
        for e, src, dst in groups:
            out.index_copy_(0, dst, F.linear(x.index_select(0, src), w[e]))
        return out
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default=",".join(map(str, TS)))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_gemm.py needs a CUDA device")
    ts = [int(t) for t in args.ts.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen, device="cuda") * 0.02).bfloat16()
    router = (torch.randn(E, H, generator=gen, device="cuda") * 0.02).bfloat16()
    xmax = torch.randn(max(ts), H, generator=gen, device="cuda").bfloat16()
    has_gmm = hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability()[0] >= 9
    rows, bad = [], 0
    full_ids = routing(max(ts), False, gen)
    full = K.experts_grouped_triton(xmax, w13, w2, full_ids, ops.silu_and_mul)
    print(f"{'T':>6} {'routing':>8} {'gemm':>6} {'ours us':>9} {'gmm us':>9} {'loop us':>9} {'gmm/ours':>9} {'loop/ours':>9}")
    for crowded in (False, True):
        for T in ts:
            x = xmax[:T].contiguous()
            ids = full_ids[:T].contiguous() if not crowded else routing(T, True, gen)
            # ---- bits: rows at this T == the same rows at max T; == the dense invariant GEMM
            if not crowded:
                y = K.experts_grouped_triton(x, w13, w2, ids, ops.silu_and_mul)
                same = torch.equal(y.view(torch.int32), full[:T].view(torch.int32))
                bad += not same
                if not same:
                    print(f"  BITS DIFFER: T={T} rows vs the same rows at T={max(ts)}")
            plan = K.make_plan(ids, E, K.pick_moe_config(T * TOPK, E)[0])
            h = K.grouped_gemm(x, w13, plan, a_indexed=True, a_div=TOPK, c_indexed=False)
            t0, s0 = 0, 0
            dense = invariant_matmul(x[t0:t0 + 1].clone(), w13[ids[t0, s0]])
            if not torch.equal(dense.view(torch.int16), h[plan.pos_of_pair[t0 * TOPK + s0]][None].view(torch.int16)):
                bad += 1
                print(f"  BITS DIFFER: T={T} grouped row vs the dense invariant GEMM")
            act = ops.silu_and_mul(h)
            order = torch.argsort(ids.reshape(-1))
            counts = torch.zeros(E, dtype=torch.int32, device="cuda").scatter_add_(
                0, ids.reshape(-1), torch.ones(T * TOPK, dtype=torch.int32, device="cuda"))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            xs_act = act.index_select(0, plan.pos_of_pair)  # sorted-by-pair rows for the baselines
            res = {"T": T, "routing": "crowded" if crowded else "uniform"}
            for gemm in ("up", "down", "block"):
                if gemm == "up":
                    ours = lambda: K.grouped_gemm(x, w13, plan, a_indexed=True, a_div=TOPK, c_indexed=False)  # noqa: E731
                    gmm = lambda: torch._grouped_mm(x.index_select(0, order // TOPK), w13.transpose(1, 2), offs=offs)  # noqa: E731
                    loop = loop_calls(x, w13, ids, True)
                elif gemm == "down":
                    ours = lambda: K.grouped_gemm(act, w2, plan, a_indexed=False, c_indexed=True,  # noqa: E731
                                                  num_c_rows=T * TOPK, out_dtype=torch.float32)
                    gmm = lambda: torch._grouped_mm(xs_act.index_select(0, order), w2.transpose(1, 2), offs=offs)  # noqa: E731
                    loop = loop_calls(xs_act, w2, ids, False)
                else:
                    def ours():
                        r = K.route_invariant(invariant_matmul(x, router, out_dtype=torch.float32), TOPK, True)
                        return K.merge_slots_triton(K.experts_grouped_triton(x, w13, w2, r.ids, ops.silu_and_mul),
                                                    r.weights, x.dtype)

                    def gmm():
                        r = K.route_fast(F.linear(x, router).float(), TOPK, True)
                        return K.merge_fast(K.experts_torch_grouped_mm(x, w13, w2, r.ids, ops.silu_and_mul), r.weights,
                                            x.dtype)
                    r0 = K.route_fast(F.linear(x, router).float(), TOPK, True)
                    inner = loop_calls(x, w13, r0.ids, True)  # routing fixed on the host: GEMMs + merge only

                    def loop(inner=inner, r0=r0):
                        h_ = inner()
                        y_ = torch.empty(T * TOPK, H, dtype=x.dtype, device="cuda")
                        flat = r0.ids.reshape(-1)
                        for e in torch.unique(flat).tolist():
                            rows_ = (flat == e).nonzero(as_tuple=True)[0]
                            y_.index_copy_(0, rows_, F.linear(ops.silu_and_mul(h_.index_select(0, rows_)), w2[e]))
                        return K.merge_fast(y_.view(T, TOPK, H), r0.weights, x.dtype)
                reps = max(2, min(16, int(2e4 // max(T, 1))))
                t_ours = bench_graph(ours, reps)
                t_gmm = bench_graph(gmm, reps) if has_gmm else float("nan")
                try:
                    t_loop = bench_graph(loop, 1) if gemm != "block" else triton.testing.do_bench(loop, warmup=3, rep=30) * 1e3
                except RuntimeError:  # a host read inside the capture: time it eagerly
                    t_loop = triton.testing.do_bench(loop, warmup=3, rep=30) * 1e3
                res[gemm] = {"ours_us": t_ours, "grouped_mm_us": t_gmm, "loop_us": t_loop}
                print(f"{T:>6} {res['routing']:>8} {gemm:>6} {t_ours:>9.1f} {t_gmm:>9.1f} {t_loop:>9.1f} "
                      f"{t_gmm / t_ours:>9.2f} {t_loop / t_ours:>9.2f}", flush=True)
            rows.append(res)
    print(f"\nbits: {'all rows identical across T and equal to the dense kernel' if not bad else f'{bad} MISMATCHES'}")
    print("(block: loop is timed eagerly with routing fixed beforehand: it needs the expert counts on the host)")
    sweep = []
    if args.sweep:
        print("\n== sweep (up GEMM, uniform routing): candidates must agree bit for bit")
        for T in ts:
            x, ids = xmax[:T].contiguous(), full_ids[:T].contiguous()
            ref, line = None, []
            for cfg in SWEEP:
                plan = K.make_plan(ids, E, cfg[0])
                try:
                    c = K.grouped_gemm(x, w13, plan, a_indexed=True, a_div=TOPK, c_indexed=False, config=cfg)
                except Exception as err:  # noqa: BLE001 -- a tile that does not fit is reported, not fatal
                    line.append(f"{cfg}: {type(err).__name__}")
                    continue
                got = c.index_select(0, plan.pos_of_pair)
                if ref is None:
                    ref = got
                elif not torch.equal(got.view(torch.int16), ref.view(torch.int16)):
                    bad += 1
                    line.append(f"{cfg}: BITS DIFFER")
                    continue
                t = bench_graph(lambda plan=plan, cfg=cfg: K.grouped_gemm(x, w13, plan, a_indexed=True, a_div=TOPK,
                                                                           c_indexed=False, config=cfg), 4)
                sweep.append({"T": T, "config": cfg, "us": t})
                line.append(f"{cfg}: {t:.1f}")
            print(f"T={T}: " + "; ".join(line), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows, "sweep": sweep, "bit_mismatches": bad}, f, indent=1)


if __name__ == "__main__":
    main()
