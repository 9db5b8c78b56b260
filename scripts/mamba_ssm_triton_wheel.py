"""Build the Mamba-2 benchmark's native baseline for the offline GPU machine: a pure-Python
wheel of mamba_ssm's Triton SSD ops (the chunked scan with its backward,
`mamba_chunk_scan_combined`, and `selective_state_update`) from the registry's sdist,
without the package's CUDA extensions (`selective_scan_cuda`, which its top-level
`__init__` imports and the GPU machine cannot build). Written to .whl/ (git-ignored);
`benchmarks/gpu_suite.sh` installs it off the tests' path, for `benchmarks/kernels/mamba2.py`.

    python scripts/mamba_ssm_triton_wheel.py [--version 2.3.2.post1]
"""
from __future__ import annotations

import argparse
import base64
import glob
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

# what the Triton SSD ops import: the package's torch utilities and ops/triton (not mamba3)
KEEP = ("mamba_ssm/utils/torch.py", "mamba_ssm/utils/determinism.py", "mamba_ssm/ops/triton/")
SKIP = ("mamba_ssm/ops/triton/mamba3/",)
EMPTY_INITS = ("mamba_ssm/__init__.py", "mamba_ssm/utils/__init__.py", "mamba_ssm/ops/__init__.py")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build(sdist: str, version: str, out_dir: str) -> str:
    files: dict[str, bytes] = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name.split("/", 1)[1] if "/" in member.name else member.name
            if member.isfile() and name.endswith(".py") and name.startswith(KEEP) and not name.startswith(SKIP):
                files[name] = tar.extractfile(member).read()
    if "mamba_ssm/ops/triton/ssd_combined.py" not in files:
        raise SystemExit(f"{sdist}: no mamba_ssm/ops/triton/ssd_combined.py")
    files["mamba_ssm/__init__.py"] = (f'__version__ = "{version}"  # Triton ops only: no CUDA extensions, '
                                      f'no modules\n').encode()
    for name in EMPTY_INITS[1:]:
        files.setdefault(name, b"")
    dist = f"mamba_ssm-{version}.dist-info"
    files[f"{dist}/METADATA"] = (f"Metadata-Version: 2.1\nName: mamba_ssm\nVersion: {version}\n"
                                 "Summary: mamba_ssm's Triton SSD ops only (benchmark baseline)\n").encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: vllm-parity\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(_record_line(n, d) + "\n" for n, d in sorted(files.items())) + f"{dist}/RECORD,,\n"
    path = os.path.join(out_dir, f"mamba_ssm-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in sorted(files.items()):
            zf.writestr(name, data)
        zf.writestr(f"{dist}/RECORD", record)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="2.3.2.post1")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".whl"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # the sdist's metadata step runs its setup.py: without build isolation, and told to
        # skip the CUDA build it would otherwise attempt
        subprocess.run([sys.executable, "-m", "pip", "download", f"mamba-ssm=={args.version}", "--no-deps",
                        "--no-binary", ":all:", "--no-build-isolation", "-d", tmp], check=False,
                       stdout=subprocess.DEVNULL, env={**os.environ, "MAMBA_SKIP_CUDA_BUILD": "TRUE"})
        sdists = glob.glob(os.path.join(tmp, "mamba_ssm-*.tar.gz"))
        if not sdists:
            raise SystemExit(f"pip could not download the mamba-ssm {args.version} sdist")
        print(build(sdists[0], args.version, args.out))


if __name__ == "__main__":
    main()
