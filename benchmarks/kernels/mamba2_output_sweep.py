"""The Mamba-2 forward kernels' tiles and warps (vllm/kernels/mamba2_chunk.py) against prefill and decode time.

    PYTHONPATH=$PYTHONPATH:/tmp/mamba_site python benchmarks/kernels/mamba2_output_sweep.py \
        [--configs "ROW_TILE=16 OUT_K_BLOCK=128 OUT_NUM_WARPS=8;OUT_BLOCK_N_MAX=128;..."]

Each config (`;`-separated) sets some of mamba2_chunk's tunables (NAME=VALUE, space-separated)
over the module's defaults; the first config ("" = the defaults) is the bits reference. Every
tunable here keeps the invariance (a row's arithmetic depends on its place in the chunk only);
whether the bits change is printed against the first config on benchmarks/kernels/mamba2.py's
bits cases (every mode and case: prefill, resume, decode spread and at tile edges, trainer).
Per config: the training forward 1 x 8,192 (no cache: one sequence's state walk over 64
chunks), prefill 4 x 2,048 and decode 256 x 1 (CUDA graph) at Nemotron-H's dims beside
mamba_ssm where it imports, and whether invariant decode rows still equal one prefill's.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mamba2 as m2  # noqa: E402
from scan_bench import swept, sweep_configs  # noqa: E402

from vllm.kernels import mamba2_chunk  # noqa: E402

DEFAULT = ";".join([
    "",                                                   # the defaults: the bits reference
    "ROW_TILE=16 OUT_K_BLOCK=128 OUT_NUM_WARPS=8 OUT_BLOCK_N_MAX=64",   # the whole-chunk M x
    "STATE_BLOCK_N_MAX=128 STATE_NUM_WARPS=8",            # the whole-N walk
    "STATE_NUM_STAGES=1",                                 # the walk without prefetch
    "STATE_NUM_WARPS=2",
    "STATE_BLOCK_P_MAX=32",                               # 4x the walks of the whole state
    "STATE_BLOCK_P_MAX=32 STATE_NUM_WARPS=2",
    "STATE_PROGRAMS=2048",                                # more programs a (head, tile) pair
    "STATE_PROGRAMS=512",
])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT, help="';'-separated configs of NAME=VALUE; the first is the "
                    "bits reference")
    configs = sweep_configs(mamba2_chunk, ap.parse_args().configs)
    print(f"{'train fwd':>9}{'prefill':>9}{'mamba_ssm':>11}{'decode':>9}{'mamba_ssm':>11}{'inv rows':>10}"
          f"{'cases differ':>14}   config   (us; inv rows: invariant decode rows differing from a prefill's, of 200)")
    ref = None
    with swept(mamba2_chunk, configs) as apply:
        for cfg in configs:
            label = apply(cfg)
            out = m2.scan_outputs(mamba2_chunk.mamba2_chunk_triton)
            differ = "-" if ref is None else m2.compare_outputs(ref, out, quiet=True)
            ref = ref or out
            pre, dec, inv = m2.prefill_case(), m2.decode_case(), m2.bits_check()
            fwd = m2.train_forward()
            print(f"{fwd:9.1f}{pre['invariant']:9.1f}{pre.get('mamba_ssm', float('nan')):11.1f}{dec['invariant']:9.1f}"
                  f"{dec.get('mamba_ssm', float('nan')):11.1f}{inv['invariant']:>10}{differ:>14}   {label}", flush=True)

if __name__ == "__main__":
    main()
