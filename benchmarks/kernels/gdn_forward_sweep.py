"""The Gated DeltaNet forward kernels' tiles, warps and T form (vllm/kernels/gdn_chunk.py) against
training-forward, prefill and decode time.

    PYTHONPATH=$PYTHONPATH:/tmp/fla_site python benchmarks/kernels/gdn_forward_sweep.py \\
        [--configs "STATE_BLOCK_V_MAX=64 STATE_NUM_WARPS=8 STATE_MAX_REGISTERS=255;..."]

Each config (`;`-separated) sets some of gdn_chunk's tunables (NAME=VALUE, space-separated) over
the module's defaults; the first config ("" = the defaults) is the bits reference. The V tiles,
warps, stages and register caps only change speed (a row's arithmetic is the same: bits equal
the reference); PREP_NUM_WARPS may change T's bits (the same on every path: "inv rows" must
stay 0). Per config: the training forward 1 x 10,240 (no cache), prefill
5 x 2,048 and decode 256 x 1 (CUDA graph) at Qwen3-Next's dims beside fla where it imports,
invariant decode rows differing from one prefill's, and elements whose bits differ from the
first config on gdn.py's real-dims schedules (outputs / states). Offline sm_90 registers of the
configs below: benchmarks/NOTES.md ("Next GPU session").
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gdn  # noqa: E402
from scan_bench import bench, metadata, swept, sweep_configs  # noqa: E402

from vllm.kernels import gdn_chunk  # noqa: E402

DEFAULT = ";".join([
    "",                                                               # the defaults: the bits reference
    "PREP_MAX_REGISTERS=168",
    "STATE_BLOCK_V_MAX=16",                                            # twice the walks of one long sequence
    "STATE_NUM_STAGES=4",
    "OUT_BLOCK_V_MAX=128 OUT_NUM_WARPS=8",
])


def train_forward(T: int = 10240) -> float:
    x = gdn.inputs(T, 0)
    md = metadata([0], [T])
    return bench(lambda: gdn.ours(True)(*x, gdn.SCALE, md, None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT, help="';'-separated configs of NAME=VALUE; the first is the "
                    "bits reference")
    configs = sweep_configs(gdn_chunk, ap.parse_args().configs)
    print(f"{'train fwd':>9}{'prefill':>9}{'fla':>9}{'decode':>9}{'fla':>9}{'inv rows':>10}{'outs/states differ':>20}"
          f"   config   (us; inv rows: invariant decode rows differing from a prefill's, of 200)")
    ref = None
    with swept(gdn_chunk, configs) as apply:
        for cfg in configs:
            label = apply(cfg)
            first = cfg is configs[0]   # fla beside the first config only
            # timed before the bits schedules: fla's fused recurrence faulted (illegal address)
            # when it ran after them in one process
            pre, dec, inv = gdn.prefill_case(others=first), gdn.decode_case(others=first), gdn.bits_check()
            fwd = train_forward()
            out = gdn.schedule_outputs(gdn_chunk.gdn_chunk_triton)
            if ref is None:
                ref, differ = out, "-"
            else:
                d = gdn.outputs_differing(ref, out)
                differ = f"{sum(r['outputs'] for r in d.values())}/{sum(r['states'] for r in d.values())}"
            print(f"{fwd:9.1f}{pre['invariant']:9.1f}{pre.get('fla', float('nan')):9.1f}{dec['invariant']:9.1f}"
                  f"{dec.get('fla', float('nan')):9.1f}{inv['invariant']:>10}{differ:>20}   {label}", flush=True)

if __name__ == "__main__":
    main()
