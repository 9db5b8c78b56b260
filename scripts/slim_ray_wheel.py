"""Build the ray wheel the offline GPU machine installs for the Ray benchmark
(`STEPS=rlray bash benchmarks/gpu_suite.sh`): a device call carries at most 64 MiB, and
ray's cp312 wheel is about 72 MB. This drops what a local `vllm train --backend ray` never
loads (the Java jar, the dashboard's web client) and writes the wheel, with the
dependencies the GPU machine lacks (jsonschema and its own), into .whl/ray/ (git-ignored).

    python scripts/slim_ray_wheel.py [--version 2.52.0]
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

DROP = ("ray/jars/", "ray/dashboard/client/build/")
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64"]
MISSING_THERE = ["jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "attrs"]


def slim(src: str, dst: str) -> None:
    """Copy the wheel without the DROP folders, their RECORD lines removed too."""
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
        for info in zi.infolist():
            if info.filename.startswith(DROP):
                continue
            data = zi.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line + "\n" for line in data.decode().splitlines() if not line.startswith(DROP)).encode()
            zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="2.52.0")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".whl",
                                                   "ray"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", *PLATFORM]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, "-d", tmp, f"ray=={args.version}"], check=True)
        (src,) = glob.glob(os.path.join(tmp, "ray-*.whl"))
        dst = os.path.join(args.out, os.path.basename(src))
        slim(src, dst)
    subprocess.run([*pip, "-d", args.out, *MISSING_THERE], check=True)
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(args.out, "*.whl")))
    print(f"{args.out}: {size / 2**20:.1f} MiB of wheels (a device call carries 64 MiB with the tree)")


if __name__ == "__main__":
    main()
