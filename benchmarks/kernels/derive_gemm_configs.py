"""Turn a `gemm.py --sweep --json-out` result into the per-shape config table that
`vllm.kernels.matmul` loads for this device (vllm/kernels/tuned/gemm_<device>.json).

For every swept (K, N) and M it keeps the fastest candidate; an M between two swept
values uses the next larger one's choice. Tile choices never change bits (the sweep
verified every candidate against the others), so this file is about speed only.

    python benchmarks/kernels/derive_gemm_configs.py sweep.json --device h200
"""
from __future__ import annotations

import argparse
import json
import os


def merge(runs: list[list[dict]]) -> list[dict]:
    """Several sweeps of the same shapes -> one, keeping each candidate's fastest time
    (interference only ever adds time, so the minimum is the better estimate)."""
    merged: dict[tuple, dict] = {}
    for rows in runs:
        for row in rows:
            key = (row["K"], row["N"], row["M"])
            if key not in merged:
                merged[key] = {**row, "timings": list(row.get("timings", []))}
                continue
            into = merged[key]
            into["cublas_us"] = min(into["cublas_us"], row["cublas_us"])
            best = {json.dumps(cfg): t for t, cfg in into["timings"]}
            for t, cfg in row.get("timings", []):
                k = json.dumps(cfg)
                best[k] = min(t, best.get(k, t))
            into["timings"] = sorted((t, json.loads(k)) for k, t in best.items())
    return list(merged.values())


def derive(rows: list[dict]) -> dict[str, list]:
    shapes: dict[str, list] = {}
    for row in sorted(rows, key=lambda r: (r["K"], r["N"], r["M"])):
        timings = row.get("timings")
        if not timings:
            continue
        best_us, cfg = timings[0]
        shapes.setdefault(f"{row['K']},{row['N']}", []).append([row["M"], *cfg, round(best_us, 2), row["cublas_us"]])
    out = {}
    for shape, entries in shapes.items():
        table = [e[:7] for e in entries]
        table[-1][0] = 1 << 62  # the largest swept M's choice covers everything above it
        out[shape] = table
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweep_json", nargs="+", help="one or more sweep results (merged: fastest time per candidate)")
    ap.add_argument("--device", required=True, help="file suffix, e.g. h200 (torch device name, lower case)")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "vllm", "kernels", "tuned"))
    args = ap.parse_args()
    runs = []
    for path in args.sweep_json:
        with open(path) as f:
            runs.append(json.load(f))
    rows = merge(runs)
    shapes = derive(rows)
    path = os.path.join(args.out_dir, f"gemm_{args.device}.json")
    with open(path, "w") as f:
        json.dump({"device": args.device, "source": [os.path.basename(p) for p in args.sweep_json],
                   "shapes": shapes}, f, indent=1)
    print(f"wrote {path}: {len(shapes)} shapes")


if __name__ == "__main__":
    main()
