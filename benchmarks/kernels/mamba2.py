"""Mamba-2 scan per-layer cost on the H200: the invariant mode against the native forms.

    python benchmarks/kernels/mamba2.py [--json-out F]

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
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np
import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm import bench_graph  # noqa: E402

from vllm.forward_context import StateMetadata  # noqa: E402
from vllm.kernels.mamba2_chunk import Mamba2ChunkScanFn, mamba2_chunk_triton  # noqa: E402
from vllm.kernels.mamba2_ops import selective_state_update_triton  # noqa: E402

H, P, G, N, C = 128, 64, 8, 128, 128
DEV = "cuda"
DT_MIN = 1e-3

try:
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update as ssm_update
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as ssm_chunk
except Exception as err:  # noqa: BLE001 -- an optional baseline
    print(f"mamba_ssm not available ({type(err).__name__}: {err}); the native column is our fast mode")
    ssm_chunk = ssm_update = None


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


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


def metadata(start_pos, q_lens, slots=None, host=True) -> StateMetadata:
    cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    return StateMetadata(torch.tensor(cu, dtype=torch.int32, device=DEV),
                         torch.tensor(start_pos, dtype=torch.int32, device=DEV),
                         None if slots is None else torch.tensor(slots, dtype=torch.int32, device=DEV),
                         int(max(q_lens)), np.asarray(start_pos) if host else None,
                         np.asarray(q_lens) if host else None)


def state(num_slots: int, aligned: bool) -> dict:
    st = {"ssm": torch.randn(num_slots, H, P, N, device=DEV) * 0.1}
    if aligned:
        st.update(buf_x=(torch.randn(num_slots, C, H, P, device=DEV) * 0.5).to(torch.bfloat16),
                  buf_B=(torch.randn(num_slots, C, G, N, device=DEV) * 0.5).to(torch.bfloat16),
                  buf_dt=torch.rand(num_slots, C, H, device=DEV) * 0.05)
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


def prefill_case(n: int = 4, L: int = 2048) -> dict:
    x, dt, B, Cm = inputs(n * L, 1)
    dt_bias, A_log, D = params()
    md = metadata([0] * n, [L] * n, list(range(1, n + 1)))
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
    rng = np.random.default_rng(0)
    pos = (2048 + rng.integers(0, 4 * C, n)).tolist()  # every offset within a chunk occurs
    md = metadata(pos, [1] * n, list(range(1, n + 1)), host=False)
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
    T = 300
    x, dt, B, Cm = inputs(T, 3)
    prm = params()
    res = {}
    for name, aligned in (("invariant", True), ("fast", False)):
        whole = ours(aligned)(x, dt, prm[0], prm[1], B, Cm, prm[2], DT_MIN, metadata([0], [T], [1]), state(2, aligned))
        st = state(2, aligned)
        rows = [ours(aligned)(x[:100], dt[:100], prm[0], prm[1], B[:100], Cm[:100], prm[2], DT_MIN,
                              metadata([0], [100], [1]), st)]
        for p in range(100, T):
            md = metadata([p], [1], [1], host=False)
            one = (x[p:p + 1], dt[p:p + 1], prm[0], prm[1], B[p:p + 1], Cm[p:p + 1], prm[2], DT_MIN, md, st)
            rows.append(ours(True)(*one) if aligned else selective_state_update_triton(*one))
        dec = torch.cat(rows)
        res[name] = int((whole.view(torch.int16) != dec.view(torch.int16)).flatten(1).any(1).sum())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    results = {"train 1x8192 fwd+bwd": train_case(), "prefill 4x2048": prefill_case(), "decode 256x1": decode_case()}
    b = bits_check()
    print("\n== Mamba-2, one layer (H200, 128 heads x 64, d_state 128, 8 groups, C 128, bf16; us, median)")
    print(f"{'case':<24}{'invariant':>12}{'fast':>12}{'mamba_ssm':>12}{'inv/native':>12}{'inv/fast':>10}")
    for case, r in results.items():
        native = r.get("mamba_ssm", r["fast"])
        ref = f"{r['mamba_ssm']:.1f}" if "mamba_ssm" in r else "-"
        print(f"{case:<24}{r['invariant']:>12.1f}{r['fast']:>12.1f}{ref:>12}{r['invariant'] / native:>12.2f}"
              f"{r['invariant'] / r['fast']:>10.2f}")
    t = results["train 1x8192 fwd+bwd"]
    fwd_ref = f", mamba_ssm {t['mamba_ssm_fwd']:.1f}" if "mamba_ssm_fwd" in t else ""
    print(f"train forward alone: invariant {t['invariant_fwd']:.1f}, fast {t['fast_fwd']:.1f}{fwd_ref} us")
    print(f"decode rows after a 100-token prefill vs one 300-token prefill, rows differing of 200: "
          f"invariant {b['invariant']}, fast {b['fast']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"results": results, "bits": b}, f, indent=1)


if __name__ == "__main__":
    main()
