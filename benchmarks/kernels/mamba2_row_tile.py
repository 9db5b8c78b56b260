"""The Mamba-2 output kernel's row tile (vllm/kernels/mamba2_chunk.py, ROW_TILE) on the H200.

    PYTHONPATH=$PYTHONPATH:/tmp/mamba_site python benchmarks/kernels/mamba2_row_tile.py [--tiles 16,32,64]

A chunk's rows are computed in tiles of ROW_TILE rows, and a decode step computes only the
tile holding its new row: a small tile keeps decode cheap, a large one gives prefill's dots
more rows (mamba_ssm's chunk scan takes 64-128). The tile is one constant for every path, so
the invariance holds at any value (each row's arithmetic is the same in every tile); the bits
change with it, so a new value needs the gate. Per tile: prefill 4 x 2,048 and decode 256 x 1
(CUDA graph) at Nemotron-H's dims beside mamba_ssm where it imports, and whether invariant
decode rows still equal one prefill's (benchmarks/kernels/mamba2.py's cases).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mamba2 as m2  # noqa: E402

from vllm.kernels import mamba2_chunk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", default="16,32,64", help="ROW_TILE values to run, comma-separated")
    tiles = [int(t) for t in ap.parse_args().tiles.split(",")]
    saved = mamba2_chunk.ROW_TILE
    print("row tile   prefill inv   prefill mamba_ssm   decode inv   decode mamba_ssm   decode rows differing (inv)")
    try:
        for tile in tiles:
            mamba2_chunk.ROW_TILE = tile
            pre, dec, bits = m2.prefill_case(), m2.decode_case(), m2.bits_check()
            print(f"{tile:8d}   {pre['invariant']:11.1f}   {pre.get('mamba_ssm', float('nan')):17.1f}   "
                  f"{dec['invariant']:10.1f}   {dec.get('mamba_ssm', float('nan')):16.1f}   {bits}", flush=True)
    finally:
        mamba2_chunk.ROW_TILE = saved


if __name__ == "__main__":
    main()
