"""Launch configurations of the training backwards' kernels on the GPU, side by side.

    python benchmarks/kernels/backward_sweep.py [recurrence,mamba2,gdn,gdn_blocks,gdn_walk] [--bf16-only]

- The chunk recurrence (vllm/kernels/chunk_recurrence.py) at Qwen3-Next's GDN training dims
  (32 heads x 160 chunks of 64, K = V = 128): forward and backward time for each (V tile,
  warps, stages) of the forward walk and the backward walk, and dot precision (the backward's
  per-chunk parts at BACKWARD_PARTS_CONFIG); the configs it keeps are FORWARD_CONFIG /
  BACKWARD_WALK_CONFIG there.
- Mamba-2's fused backward (vllm/kernels/mamba2_backward.py) at Nemotron-H's dims (128 heads of
  64, 8 groups, d_state 128, chunk 128, 1 x 8,192 tokens, bf16): each kernel's (warps,
  stages) in turn (LAUNCH there), the dx kernel's row blocks (ROW_BLOCK), and whether a
  config changes any bit.
- GDN's fused backward (vllm/kernels/gdn_backward.py) at Qwen3-Next's dims (1 x 10,240, bf16):
  each per-chunk kernel's warps in turn (WARPS there), with T from the forward as training
  runs it ("prep": the backward building T itself); "gdn_blocks" the block widths and warps
  of the prep and the final kernels together (PREP_COLUMNS, FINAL_OUT_V_BLOCK, FINAL_WU_BLOCK
  and WARPS there), each kernel's own time and the backward's; "gdn_walk" the backward walk's
  (V tile, warps, stages) (WALK_CONFIG).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton

from vllm.kernels import chunk_recurrence as cr
from vllm.kernels import mamba2_backward as mb


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=30) * 1e3


BF16_ONLY = "--bf16-only" in sys.argv


def recurrence_sweep() -> None:
    B, H, nC, C, K, V = 1, 32, 160, 64, 128, 128
    u = torch.randn(B, H, nC, C, V, device="cuda")
    w, kd = (torch.randn(B, H, nC, C, K, device="cuda") * 0.05 for _ in range(2))
    e = torch.rand(B, H, nC, device="cuda")
    gs, gv = torch.randn(B, H, nC, K, V, device="cuda"), torch.randn_like(u)
    bf16_in = tuple(x.bfloat16() for x in (u, w, kd))
    saved = cr.FORWARD_CONFIG.copy(), cr.BACKWARD_WALK_CONFIG.copy()
    try:
        for prec in ("bf16", "tf32x3"):
            configs = ((32, 4, 1), (32, 4, 2), (32, 4, 3), (32, 4, 4), (32, 8, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2))
            for cfg in configs if prec == "bf16" or not BF16_ONLY else ():
                cr.FORWARD_CONFIG[prec] = cr.BACKWARD_WALK_CONFIG[prec] = cfg
                try:
                    states, vn = cr.recurrence_forward_triton(u, w, kd, e, prec)
                    f = bench(lambda: cr.recurrence_forward_triton(u, w, kd, e, prec))
                    # as the GDN backward runs it with bf16 dots: bfloat16 in and out
                    f16 = bench(lambda: cr.recurrence_forward_triton(*bf16_in, e, prec, vn_dtype=torch.bfloat16,
                                                                     states_dtype=torch.bfloat16))
                    b = bench(lambda: cr.recurrence_backward_triton(w, kd, e, states, vn, gs, gv, prec))
                    print(f"recurrence {prec} V tile {cfg[0]} warps {cfg[1]} stages {cfg[2]}: forward {f:.0f} us "
                          f"(bfloat16 in and out {f16:.0f}), backward {b:.0f} us", flush=True)
                except triton.runtime.errors.OutOfResources as ex:
                    print(f"recurrence {prec} V tile {cfg[0]} warps {cfg[1]} stages {cfg[2]}: does not fit "
                          f"({str(ex)[:70]})", flush=True)
    finally:
        cr.FORWARD_CONFIG.update(saved[0])
        cr.BACKWARD_WALK_CONFIG.update(saved[1])


def mamba2_launch() -> None:
    """Each final kernel's (warps, stages) in turn, the others at LAUNCH's, and whether any
    config changes a bit of the result (it should not: tiles and dots are the same)."""
    T, H, P, G, N = 8192, 128, 64, 8, 128
    x, dy = (torch.randn(T, H, P, device="cuda").bfloat16() for _ in range(2))
    Bm, Cm = (torch.randn(T, G, N, device="cuda").bfloat16() for _ in range(2))
    dt = torch.randn(T, H, device="cuda") - 2
    dt_bias, D = 0.5 * torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    A_log = torch.log(0.5 + 4 * torch.rand(H, device="cuda"))
    saved, saved_rows = dict(mb.LAUNCH["bf16"]), mb.ROW_BLOCK

    def step():
        return mb.mamba2_backward_triton(x, dt, dt_bias, A_log, Bm, Cm, D, dy, 1e-3, [0, T], 128)
    base = step()
    print(f"mamba2 backward at {saved}: {bench(step):.0f} us", flush=True)
    try:
        for kernel in ("dcb", "dbc", "dx", "prep"):
            for cfg in ((4, 1), (4, 2), (8, 1), (8, 2), (8, 3), (16, 1), (16, 2)):
                mb.LAUNCH["bf16"].update(saved)
                mb.LAUNCH["bf16"][kernel] = cfg
                try:
                    same = all(torch.equal(a, b) for a, b in zip(step(), base))
                    print(f"mamba2 backward, {kernel} at {cfg[0]} warps / {cfg[1]} stages: {bench(step):.0f} us"
                          f"{'' if same else ' (bits differ)'}", flush=True)
                except triton.runtime.errors.OutOfResources as ex:
                    print(f"mamba2 backward, {kernel} at {cfg}: does not fit ({str(ex)[:70]})", flush=True)
        mb.LAUNCH["bf16"].update(saved)
        for rows in (32, 64, 128):
            mb.ROW_BLOCK = rows
            same = all(torch.equal(a, b) for a, b in zip(step(), base))
            print(f"mamba2 backward, dx kernel in row blocks of {rows}: {bench(step):.0f} us"
                  f"{'' if same else ' (bits differ)'}", flush=True)
    finally:
        mb.LAUNCH["bf16"].update(saved)
        mb.ROW_BLOCK = saved_rows


def _gdn_case():
    """Qwen3-Next's dims, 1 x 10,240 tokens, bf16: the backward with T from the forward (as
    training runs it) and building T itself, as two callables."""
    from vllm.kernels import gdn_backward as gb
    from vllm.kernels.gdn_chunk import gdn_chunk_triton
    from vllm.testing.chunked_scan import step_metadata
    T, HK, HV, K, V, C = 10240, 16, 32, 128, 128, 64
    q, k = (F.normalize(torch.randn(T, HK, K, device="cuda"), dim=-1).bfloat16() for _ in range(2))
    v, do = (torch.randn(T, HV, V, device="cuda").bfloat16() for _ in range(2))
    g, beta = -0.6 * torch.rand(T, HV, device="cuda"), torch.rand(T, HV, device="cuda")
    md = step_metadata([0], [T])
    plan = md.chunk_plan(C, True)
    t_out = torch.empty((plan.num_chunks, HV, C, C), dtype=torch.bfloat16, device="cuda")
    gdn_chunk_triton(q, k, v, g, beta, K ** -0.5, md, None, chunk_size=C, aligned=True, t_out=t_out)

    def t_saved():
        return gb.gdn_backward_triton(q, k, v, g, beta, do, [0, T], K ** -0.5, chunk_size=C, t_saved=t_out,
                                      t_chunks=plan.seq_chunks)

    def t_built():
        return gb.gdn_backward_triton(q, k, v, g, beta, do, [0, T], K ** -0.5, chunk_size=C)
    return t_saved, t_built


def gdn_warps() -> None:
    """Each per-chunk kernel's warps in turn (bf16 dots), the others at WARPS's: the training
    step's backward (T from the forward), and for "prep" the backward building T itself."""
    from vllm.kernels import gdn_backward as gb
    t_saved, t_built = _gdn_case()
    saved = dict(gb.WARPS["bf16"])
    print(f"gdn backward at {saved}: T saved {bench(t_saved):.0f} us, T built {bench(t_built):.0f} us", flush=True)
    try:
        for kernel in saved:
            if kernel == "out_grad" and gb.OUTPUT_GRADS_IN_WALK["bf16"]:
                continue   # the walk takes the output gradients itself: that kernel does not run
            step, which = (t_built, "T built") if kernel == "prep" else (t_saved, "T saved")
            for warps in (2, 4, 8):
                gb.WARPS["bf16"].update(saved)
                gb.WARPS["bf16"][kernel] = warps
                try:
                    print(f"gdn backward ({which}), {kernel} at {warps} warps: {bench(step):.0f} us", flush=True)
                except triton.runtime.errors.OutOfResources as ex:
                    print(f"gdn backward ({which}), {kernel} at {warps} warps: does not fit ({str(ex)[:70]})",
                          flush=True)
    finally:
        gb.WARPS["bf16"].update(saved)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def gdn_blocks() -> None:
    """The block widths and warps of the prep (PREP_COLUMNS: w, u and kd's column block; T
    saved and T built) and of the final kernels (FINAL_OUT_V_BLOCK: the output kernel's loop
    over V; FINAL_WU_BLOCK: the w / u kernel's over K and V), bf16
    dots: the kernel's own GPU time (torch profiler), the whole backward's, and whether any
    gradient bit moves against the defaults. First the backward's GPU time per kernel."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from scan_bench import kernel_times, report

    from vllm.kernels import gdn_backward as gb
    t_saved, t_built = _gdn_case()
    report("gdn backward kernels (T saved)", kernel_times(t_saved))
    report("gdn backward kernels (T built)", kernel_times(t_built))
    warps0, cols0 = dict(gb.WARPS["bf16"]), dict(gb.PREP_COLUMNS["bf16"])
    vb0, wu0 = gb.FINAL_OUT_V_BLOCK["bf16"], gb.FINAL_WU_BLOCK["bf16"]
    ref = {"saved": t_saved(), "built": t_built()}

    def restore():
        gb.WARPS["bf16"].update(warps0)
        gb.PREP_COLUMNS["bf16"].update(cols0)
        gb.FINAL_OUT_V_BLOCK["bf16"], gb.FINAL_WU_BLOCK["bf16"] = vb0, wu0

    def setting(kernel, block, warps):
        restore()
        gb.WARPS["bf16"][kernel] = warps
        if kernel == "final_out":
            gb.FINAL_OUT_V_BLOCK["bf16"] = block
        elif kernel == "final_wu":
            gb.FINAL_WU_BLOCK["bf16"] = block
        else:
            gb.PREP_COLUMNS["bf16"][kernel] = block

    # the final kernels first; the prep building T is not run at 32 columns: at 4 warps it
    # faulted with an illegal memory access on the H100 (Triton 3.6), which ends the process
    runs = [(kernel, "saved", b, w) for kernel in ("final_out", "final_wu") for b in (32, 64) for w in (4, 8)]
    runs += [("prep_t_saved", "saved", b, w) for b in (32, 64, 128) for w in (2, 4, 8)]
    runs += [("prep", "built", b, w) for b in (64, 128) for w in (2, 4, 8)]
    try:
        for kernel, which, block, warps in runs:
            step = t_saved if which == "saved" else t_built
            setting(kernel, block, warps)
            label = f"gdn backward (T {which}), {kernel} at {block} wide, {warps} warps"
            try:
                same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(step(), ref[which]))
                key = kernel if kernel.startswith("final") else "prep"
                own = sum(t for name, t in kernel_times(step).items() if key in name)
                print(f"{label}: kernel {own:.0f} us, backward {bench(step):.0f} us, "
                      f"{'same bits' if same else 'bits differ'}", flush=True)
            except triton.runtime.errors.OutOfResources as ex:
                print(f"{label}: does not fit ({str(ex)[:70]})", flush=True)
    finally:
        restore()


def gdn_walk() -> None:
    """The backward walk's (V tile, warps, stages) (WALK_CONFIG), bf16 dots, T saved: the
    walk's own GPU time, the group sums' and the final kernels', the whole backward's, and
    how far each gradient moves from the defaults' (max |a - b| / max |b|)."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from scan_bench import kernel_times

    from vllm.kernels import gdn_backward as gb
    t_saved, _ = _gdn_case()
    walk0 = gb.WALK_CONFIG["bf16"]
    ref = t_saved()
    try:
        for cfg in ((32, 4, 2), (32, 4, 3), (32, 8, 2), (64, 4, 2), (64, 8, 2), (16, 4, 2), (16, 4, 3)):
            gb.WALK_CONFIG["bf16"] = cfg
            label = f"gdn backward, walk {cfg}"
            try:
                out = t_saved()
                moved = " ".join(f"{(a.float() - b.float()).abs().max().item() / b.float().abs().max().item():.1e}"
                                 for a, b in zip(out, ref))
                times = kernel_times(t_saved)
                own = {key: sum(t for name, t in times.items() if key in name)
                       for key in ("walk", "group_sum", "final_out", "final_wu")}
                print(f"{label}: backward {bench(t_saved):.0f} us, " + ", ".join(f"{k} {v:.0f}" for k, v in own.items())
                      + f"; moved (q k v g beta) {moved}", flush=True)
            except triton.runtime.errors.OutOfResources as ex:
                print(f"{label}: does not fit ({str(ex)[:70]})", flush=True)
    finally:
        gb.WALK_CONFIG["bf16"] = walk0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    parts = args[0].split(",") if args else ["recurrence", "mamba2", "gdn"]
    if "recurrence" in parts:
        recurrence_sweep()
    if "mamba2" in parts:
        mamba2_launch()
    if "gdn" in parts:
        gdn_warps()
    if "gdn_blocks" in parts:
        gdn_blocks()
    if "gdn_walk" in parts:
        gdn_walk()
