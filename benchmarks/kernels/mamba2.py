"""Mamba-2 scan per-layer cost on the H200: the invariant mode against the native forms.

    python benchmarks/kernels/mamba2.py [--json-out F] [--cases train,prefill,decode]
    python benchmarks/kernels/mamba2.py --backward   (the trainer's backward against the fused kernels)

Nemotron-H's Mamba-2 dims (128 heads of 64, d_state 128, 8 groups, chunk 128, bf16), the
cases benchmarks/kernels/gdn.py measures for Gated DeltaNet:

- train: forward + backward of the scan over 1 x 8,192 tokens;
- prefill: 4 x 2,048 tokens from position 0, states written to the cache;
- decode: 256 sequences x 1 token at positions spread over the chunk grid, states in the cache.

Columns: ours invariant (the chunked form on the absolute grid; decode recomputes its partial
chunk from the rows its state kept), ours fast (our native form: step-grid chunks, the
selective state update for decode), and mamba_ssm's `mamba_chunk_scan_combined` /
`selective_state_update` where `mamba_ssm` imports (else `-`). The ratio column is invariant /
native (mamba_ssm where present, else our fast mode). Decode is timed inside a CUDA graph (as
the engine replays it). Also printed: whether invariant decode rows equal the prefill's rows bit
for bit, and how many fast-mode decode rows differ from fast prefill rows.

    python benchmarks/kernels/mamba2.py --bits-vs OTHER.py

instead compares this tree's scan with another copy of vllm/kernels/mamba2_chunk.py (say the
last commit's, `git show HEAD:vllm/kernels/mamba2_chunk.py > OTHER.py`) bit for bit at these
dims, on the same inputs and cache contents: a change to the kernels that must keep every bit
(tiling, what a step computes or stores) is checked with it.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm import bench_graph  # noqa: E402
from scan_bench import (DEV, bench, decode_metadata, decode_rows_differing, main, metadata,  # noqa: E402
                        optional_baseline, prefill_metadata)

from vllm.kernels.mamba2_chunk import Mamba2ChunkScanFn, mamba2_chunk_triton  # noqa: E402
from vllm.kernels.mamba2_ops import selective_state_update_triton  # noqa: E402

H, P, G, N, C = 128, 64, 8, 128, 128
DT_MIN = 1e-3

ssm_update, ssm_chunk = optional_baseline("mamba_ssm.ops.triton.selective_state_update.selective_state_update",
                                          "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined")


def params():
    g = torch.Generator(device=DEV).manual_seed(99)
    dt = torch.exp(torch.rand(H, device=DEV, generator=g) * (np.log(0.1) - np.log(1e-3)) + np.log(1e-3))
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(torch.bfloat16)
    A_log = torch.log(torch.arange(1, H + 1, device=DEV, dtype=torch.float32)).to(torch.bfloat16)
    D = torch.ones(H, device=DEV, dtype=torch.bfloat16)
    return dt_bias, A_log, D


def inputs(T: int, seed: int):
    """(x, dt, B, C) as the layer passes them: views of one projection row."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    row = (torch.randn(T, H * P + 2 * G * N + H, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    x = row[:, :H * P].view(T, H, P)
    B = row[:, H * P:H * P + G * N].view(T, G, N)
    Cm = row[:, H * P + G * N:H * P + 2 * G * N].view(T, G, N)
    dt = row[:, H * P + 2 * G * N:]
    return x, dt, B, Cm


def state(num_slots: int, aligned: bool) -> dict:
    st = {"ssm": torch.randn(num_slots, H, P, N, device=DEV) * 0.1}
    if aligned:
        st.update(buf_x=(torch.randn(num_slots, C, H, P, device=DEV) * 0.5).to(torch.bfloat16),
                  buf_B=(torch.randn(num_slots, C, G, N, device=DEV) * 0.5).to(torch.bfloat16),
                  buf_dt=torch.rand(num_slots, C, H, device=DEV) * 0.05,
                  ssm_rounded=st["ssm"].to(torch.bfloat16))  # as the state kernel writes it with "ssm"
    return st


def ours(aligned: bool):
    return functools.partial(mamba2_chunk_triton, chunk_size=C, aligned=aligned)


def train_case(T: int = 8192) -> dict:
    x, dt, B, Cm = inputs(T, 0)
    dt_bias, A_log, D = params()
    dy = torch.randn(T, H, P, device=DEV).to(torch.bfloat16)
    md = metadata([0], [T])
    out = {}
    for name, aligned in (("invariant", True), ("fast", False)):
        leaves = [t.detach().clone().requires_grad_() for t in (x, dt, dt_bias, A_log, B, Cm, D)]

        def step(leaves=leaves, aligned=aligned):
            y = Mamba2ChunkScanFn.apply(ours(aligned), *leaves, DT_MIN, md, C)
            y.backward(dy)
        out[name] = bench(step)
        out[name + "_fwd"] = bench(lambda aligned=aligned: ours(aligned)(x, dt, dt_bias, A_log, B, Cm, D, DT_MIN, md,
                                                                          None))
    if ssm_chunk is not None:
        A = -torch.exp(A_log.float())
        args = lambda: (x[None], dt[None], A, B[None], Cm[None], C)  # noqa: E731
        kw = dict(D=D.float(), dt_bias=dt_bias.float(), dt_softplus=True, dt_limit=(DT_MIN, float("inf")))
        with torch.no_grad():
            out["mamba_ssm_fwd"] = bench(lambda: ssm_chunk(*args(), **kw))
        leaves = [t.detach().clone().contiguous().requires_grad_() for t in (x, dt, B, Cm)]

        def ssm_step():
            y = ssm_chunk(leaves[0][None], leaves[1][None], A, leaves[2][None], leaves[3][None], C, **kw)
            y.backward(dy[None])
        out["mamba_ssm"] = bench(ssm_step)
    return out


def train_forward(T: int = 8192) -> float:
    """The invariant forward alone at the train shape (no cache), us."""
    x, dt, B, Cm = inputs(T, 0)
    dt_bias, A_log, D = params()
    md = metadata([0], [T])
    return bench(lambda: ours(True)(x, dt, dt_bias, A_log, B, Cm, D, DT_MIN, md, None))


def prefill_case(n: int = 4, L: int = 2048) -> dict:
    x, dt, B, Cm = inputs(n * L, 1)
    dt_bias, A_log, D = params()
    md = prefill_metadata(n, L)
    out = {}
    for name, aligned in (("invariant", True), ("fast", False)):
        st = state(n + 1, aligned)
        out[name] = bench(lambda aligned=aligned, st=st: ours(aligned)(x, dt, dt_bias, A_log, B, Cm, D, DT_MIN, md, st))
    if ssm_chunk is not None:
        cu = md.cu_seqlens.long()
        seq_idx = torch.repeat_interleave(torch.arange(n, device=DEV, dtype=torch.int32), L)[None]
        A = -torch.exp(A_log.float())
        out["mamba_ssm"] = bench(lambda: ssm_chunk(x[None], dt[None], A, B[None], Cm[None], C, D=D.float(),
                                                   dt_bias=dt_bias.float(), dt_softplus=True,
                                                   dt_limit=(DT_MIN, float("inf")), seq_idx=seq_idx, cu_seqlens=cu,
                                                   return_varlen_states=True))
    return out


def decode_case(n: int = 256) -> dict:
    x, dt, B, Cm = inputs(n, 2)
    dt_bias, A_log, D = params()
    md = decode_metadata(n, C)
    out = {}
    st_inv, st_fast = state(n + 1, True), state(n + 1, False)
    out["invariant"] = bench_graph(lambda i: ours(True)(x, dt, dt_bias, A_log, B, Cm, D, DT_MIN, md, st_inv), 20)
    out["fast"] = bench_graph(lambda i: selective_state_update_triton(x, dt, dt_bias, A_log, B, Cm, D, DT_MIN, md,
                                                                       st_fast), 20)
    if ssm_update is not None:
        h0 = st_fast["ssm"][1:].clone()
        A = (-torch.exp(A_log.float()))[:, None, None].expand(H, P, N)
        dtx = dt[:, :, None].expand(n, H, P)
        dtb = dt_bias.float()[:, None].expand(H, P)
        Dx = D.float()[:, None].expand(H, P)
        out["mamba_ssm"] = bench_graph(lambda i: ssm_update(h0, x, dtx, A, B, Cm, D=Dx, dt_bias=dtb, dt_softplus=True),
                                       20)
    return out


def bits_check() -> dict:
    """Invariant: a prefill's rows == the same tokens fed one decode step at a time (after a
    prefill of the first 100); fast: how many such rows differ."""
    x, dt, B, Cm = inputs(300, 3)
    prm = params()

    def step(aligned, lo, hi, md, st):
        args = (x[lo:hi], dt[lo:hi], prm[0], prm[1], B[lo:hi], Cm[lo:hi], prm[2], DT_MIN, md, st)
        if md.max_query_len == 1 and not aligned:
            return selective_state_update_triton(*args)
        return ours(aligned)(*args)
    return decode_rows_differing(step, functools.partial(state, 2))


def bits_cases() -> dict:
    """The cases --bits-vs and the output kernel's sweep compare bit for bit: prefills from
    position 0 with partial last chunks, a step resuming chunks mid-way with several rows (cache
    from random contents), decode 256 x 1 spread over the grid and at offsets 0, 15, 16, 127,
    and the trainer's call (no cache). name -> (tokens, metadata, with a cache)."""
    n = 256
    lens = [2048, 300, 77, 1000]
    cases = {
        "prefill": (sum(lens), metadata([0] * 4, lens, [1, 2, 3, 4]), True),
        "resume mid-chunk": (341, metadata([100, 500, 1000], [40, 300, 1], [1, 2, 3]), True),
        "decode spread": (n, decode_metadata(n, C), True),
        "trainer": (sum(lens), metadata([0] * 4, lens), False),
    }
    for off in (0, 15, 16, 127):
        cases[f"decode offset {off}"] = (n, metadata([2048 + off] * n, [1] * n, list(range(1, n + 1)), host=False),
                                         True)
    return cases


def scan_outputs(fn) -> dict:
    """fn (a mamba2_chunk_triton) on every bits case in both modes, from the same inputs and
    starting cache: (mode, case) -> (y, cache tensors after the step)."""
    prm = params()
    out = {}
    for aligned in (True, False):
        for name, (T, md, cached) in bits_cases().items():
            if not aligned and md.max_query_len == 1:
                continue  # fast mode decodes with the selective state update
            x, dt, B, Cm = inputs(T, 7)
            torch.manual_seed(11)  # the same starting cache for every fn
            st = state(257, aligned) if cached else None
            y = fn(x, dt, *prm[:2], B, Cm, prm[2], DT_MIN, md, st, chunk_size=C, aligned=aligned)
            out["invariant" if aligned else "fast", name] = (y, st or {})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def compare_outputs(a: dict, b: dict, keys=None, quiet: bool = False) -> int:
    """Prints a line per case (unless quiet): same bits, or which outputs differ; returns how many
    cases differ. keys: the cache tensors to compare (default: all of a's)."""
    differ = 0
    for case, (ya, sa) in a.items():
        yb, sb = b[case]
        bad = [k for k in (keys or sa) if k in sa and not torch.equal(_bits(sa[k]), _bits(sb[k]))]
        if not torch.equal(_bits(ya), _bits(yb)):
            bad.insert(0, f"y ({int((_bits(ya) != _bits(yb)).sum())} elements)")
        if not quiet:
            print(f"{case[0]:<10}{case[1]:<20}" + ("same bits" if not bad else "DIFFER: " + ", ".join(bad)))
        differ += bool(bad)
    return differ


def bits_vs(path: str) -> int:
    """This tree's mamba2_chunk_triton against the one in `path` on bits_cases(); returns the
    number of cases that differ."""
    spec = importlib.util.spec_from_file_location("mamba2_chunk_other", path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    ours_out = scan_outputs(mamba2_chunk_triton)
    keys = {k for _, st in ours_out.values() for k in st}
    # a copy that predates the rounded state leaves it as it found it
    if "ssm_rounded" not in getattr(other, "BUFFERS", ()):
        keys.discard("ssm_rounded")
    return compare_outputs(ours_out, scan_outputs(other.mamba2_chunk_triton), sorted(keys))


def backward_case(T: int = 8192) -> None:
    """The backward alone at the train shape: autograd of mamba2_reference in float32 against
    the fused kernels of vllm/kernels/mamba2_backward.py (the trainer's path on a GPU), their
    distance from float64 autograd, the fused kernels' GPU time per kernel, at the bf16 dots a
    bf16 model's backward takes beside the 3xTF32 of a float32 one."""
    from scan_bench import backward_report

    from vllm.kernels.chunk_scan import reference_grads
    from vllm.kernels.mamba2_backward import mamba2_backward_triton
    from vllm.kernels.mamba2_chunk import mamba2_reference
    x, dt, B, Cm = inputs(T, 0)
    dt_bias, A_log, D = params()
    xs = (x, dt, dt_bias, A_log, B, Cm, D)
    # seeded: the distances from float64 (dA_log above all: a long sum with cancellation) move
    # with the gradient drawn
    dy = torch.randn(T, H, P, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5)).to(torch.bfloat16)
    cu = [0, T]

    def ref_step(d=dy):
        return reference_grads(lambda *a: mamba2_reference(*a, DT_MIN, cu, C), xs, [True] * 7, d)

    def fused():
        return mamba2_backward_triton(*xs, dy, DT_MIN, cu, C)

    backward_report(T, ref_step, fused, ref_step(dy.double()), "x dt dt_bias A_log B C D".split())

if __name__ == "__main__":
    if "--backward" in sys.argv:
        backward_case()
        sys.exit(0)
    if len(sys.argv) == 3 and sys.argv[1] == "--bits-vs":
        sys.exit(1 if bits_vs(sys.argv[2]) else 0)
    main(__doc__, "Mamba-2, one layer ({device}, 128 heads x 64, d_state 128, 8 groups, C 128, bf16; us, median)",
         {"train 1x8192 fwd+bwd": train_case, "prefill 4x2048": prefill_case, "decode 256x1": decode_case},
         bits_check, "mamba_ssm")
