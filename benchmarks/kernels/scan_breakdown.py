"""Where a Gated DeltaNet or Mamba-2 step spends its GPU time, kernel by kernel (H200).

    python benchmarks/kernels/scan_breakdown.py [--only gdn|mamba2]

Times every kernel of the invariant and the fast path with the torch profiler (mean GPU
time per call over 20 calls) for: decode 256 x 1 with every sequence at the same offset in
its chunk (0, 31: the decode path, the new row's 16-row tile from the cached state, the state
kernel idle; 63 completes the chunk: the whole-chunk path, folded by the state kernel) and
spread over the grid, with the T cache's stamps missed (T solved from row 1) and hit (the
engine's decode: earlier rows of T = (I + A)^-1 read back), and prefill 5 x 2,048;
Mamba-2: decode 256 x 1 with every
sequence at offset 0, 63 or 127 of its 128-row chunk (127 completes the chunk: the state kernel
folds it, the other offsets leave the state to the output kernel) and spread over the grid,
invariant and fast, prefill 4 x 2,048 and the training forward 1 x 8,192 (no cache), each
beside mamba_ssm's kernels where it imports (PYTHONPATH=$PYTHONPATH:/tmp/mamba_site). Same dims
as gdn.py and mamba2.py.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mamba2  # noqa: E402
from gdn import C, SCALE, inputs, ours, state  # noqa: E402
from scan_bench import decode_metadata, kernel_times, metadata, prefill_metadata, report  # noqa: E402

from vllm.kernels.gdn_ops import gdn_recurrent_triton  # noqa: E402
from vllm.kernels.mamba2_ops import selective_state_update_triton  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("gdn", "mamba2"), default=None, help="one recurrence's rows only")
    only = ap.parse_args().only
    if only != "mamba2":
        gdn_rows()
    if only != "gdn":
        mamba2_rows()


def gdn_rows(n: int = 256) -> None:
    x = inputs(n, 2)
    print("== GDN kernel breakdown (us per call, GPU time; 'T cached': the rows of T before the new token come "
          "from the state, as in the engine)")
    for off in (0, 31, 63, None):
        if off is None:
            md, label = decode_metadata(n, C), "spread"
        else:
            md, label = metadata([2048 + off] * n, [1] * n, list(range(1, n + 1)), host=False), f"offset {off}"
        for cached in (False, True):
            st = state(n + 1, True, md if cached else None)
            report(f"decode {n}x1 invariant, {label}{', T cached' if cached else ''}",
                   kernel_times(lambda: ours(True)(*x, SCALE, md, st)))
    st = state(n + 1, False)
    md = decode_metadata(n, C)
    report(f"decode {n}x1 fast (recurrence)", kernel_times(lambda: gdn_recurrent_triton(*x, SCALE, md, st)))
    xp = inputs(5 * 2048, 1)
    mdp = prefill_metadata(5, 2048)
    for name, aligned in (("invariant", True), ("fast", False)):
        st = state(6, aligned)
        report(f"prefill 5x2048 {name}", kernel_times(lambda: ours(aligned)(*xp, SCALE, mdp, st)))


def mamba2_rows(n: int = 256) -> None:
    print("== Mamba-2 kernel breakdown (us per call, GPU time)")
    xm = mamba2.inputs(n, 2)
    pm = mamba2.params()
    for off in (0, 63, 127, None):
        if off is None:
            mdm, label = decode_metadata(n, mamba2.C), "spread"
        else:
            mdm, label = metadata([2048 + off] * n, [1] * n, list(range(1, n + 1)), host=False), f"offset {off}"
        st = mamba2.state(n + 1, True)
        report(f"mamba2 decode {n}x1 invariant, {label}",
               kernel_times(lambda: mamba2.ours(True)(xm[0], xm[1], pm[0], pm[1], xm[2], xm[3], pm[2], mamba2.DT_MIN,
                                                      mdm, st)))
    st = mamba2.state(n + 1, False)
    mdm = decode_metadata(n, mamba2.C)
    report(f"mamba2 decode {n}x1 fast (ssu)",
           kernel_times(lambda: selective_state_update_triton(xm[0], xm[1], pm[0], pm[1], xm[2], xm[3], pm[2],
                                                              mamba2.DT_MIN, mdm, st)))
    xp = mamba2.inputs(4 * 2048, 1)
    mdp = prefill_metadata(4, 2048)
    for name, aligned in (("invariant", True), ("fast", False)):
        st = mamba2.state(5, aligned)
        report(f"mamba2 prefill 4x2048 {name}",
               kernel_times(lambda: mamba2.ours(aligned)(xp[0], xp[1], pm[0], pm[1], xp[2], xp[3], pm[2],
                                                         mamba2.DT_MIN, mdp, st)))
    if mamba2.ssm_chunk is not None:
        A = -torch.exp(pm[1].float())
        kw = dict(D=pm[2].float(), dt_bias=pm[0].float(), dt_softplus=True, dt_limit=(mamba2.DT_MIN, float("inf")))
        cu = mdp.cu_seqlens.long()
        seq_idx = torch.repeat_interleave(torch.arange(4, device=cu.device, dtype=torch.int32), 2048)[None]
        report("mamba2 prefill 4x2048 mamba_ssm",
               kernel_times(lambda: mamba2.ssm_chunk(xp[0][None], xp[1][None], A, xp[2][None], xp[3][None], mamba2.C,
                                                     seq_idx=seq_idx, cu_seqlens=cu, return_varlen_states=True,
                                                     **kw)))
    xt = mamba2.inputs(8192, 0)
    mdt = metadata([0], [8192])
    report("mamba2 train fwd 1x8192 invariant",
           kernel_times(lambda: mamba2.ours(True)(xt[0], xt[1], pm[0], pm[1], xt[2], xt[3], pm[2], mamba2.DT_MIN, mdt,
                                                  None)))
    if mamba2.ssm_chunk is not None:
        with torch.no_grad():
            report("mamba2 train fwd 1x8192 mamba_ssm",
                   kernel_times(lambda: mamba2.ssm_chunk(xt[0][None], xt[1][None], A, xt[2][None], xt[3][None],
                                                         mamba2.C, **kw)))


if __name__ == "__main__":
    main()
