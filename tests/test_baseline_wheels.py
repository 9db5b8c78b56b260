"""scripts/mamba_ssm_triton_wheel.py: the Mamba-2 benchmark's baseline wheel keeps mamba_ssm's
Triton ops and drops what imports its CUDA extensions."""
from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("mamba_ssm_triton_wheel",
                                                  os.path.join(REPO, "scripts", "mamba_ssm_triton_wheel.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sdist(path: str) -> None:
    files = {
        "mamba_ssm/__init__.py": "from mamba_ssm.ops.selective_scan_interface import selective_scan_fn\n",
        "mamba_ssm/ops/selective_scan_interface.py": "import selective_scan_cuda\n",
        "mamba_ssm/utils/torch.py": "X = 1\n",
        "mamba_ssm/ops/triton/__init__.py": "",
        "mamba_ssm/ops/triton/ssd_combined.py": "from mamba_ssm.utils.torch import X\nVALUE = X + 1\n",
        "mamba_ssm/ops/triton/mamba3/__init__.py": "import tilelang\n",
        "setup.py": "raise SystemExit\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"mamba_ssm-9.9/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_wheel_keeps_the_triton_ops_importable(tmp_path):
    _sdist(str(tmp_path / "mamba_ssm-9.9.tar.gz"))
    whl = _load().build(str(tmp_path / "mamba_ssm-9.9.tar.gz"), "9.9", str(tmp_path))
    names = zipfile.ZipFile(whl).namelist()
    assert "mamba_ssm/ops/triton/ssd_combined.py" in names and "mamba_ssm/ops/__init__.py" in names
    assert not any("selective_scan_interface" in n or "mamba3" in n or "setup.py" in n for n in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    whl], check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-c", "from mamba_ssm.ops.triton.ssd_combined import VALUE; print(VALUE)"],
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "2"
