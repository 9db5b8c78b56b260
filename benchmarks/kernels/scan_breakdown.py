"""Where a Gated DeltaNet or Mamba-2 step spends its GPU time, kernel by kernel (H200).

    python benchmarks/kernels/scan_breakdown.py

Times every kernel of the invariant and the fast path with the torch profiler (mean GPU
time per call over 20 calls) for: decode 256 x 1 with every sequence at the same offset in
its chunk (0, 31: the decode path, the new row's 16-row tile from the cached state, the state
kernel idle; 63 completes the chunk: the whole-chunk path, folded by the state kernel) and
spread over the grid, with the T cache's stamps missed (T solved from row 1) and hit (the
engine's decode: earlier rows of T = (I + A)^-1 read back), and prefill 5 x 2,048;
Mamba-2: decode 256 x 1 with every
sequence at offset 0, 63 or 127 of its 128-row chunk (127 completes the chunk: the state kernel
folds it, the other offsets leave the state to the output kernel) and spread over the grid,
invariant and fast, and prefill 4 x 2,048. Same dims as gdn.py and mamba2.py.
"""
from __future__ import annotations

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
    n = 256
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


if __name__ == "__main__":
    main()
