"""How Triton kernels are launched, whatever Triton's version: every launch names its
floating-point contraction (docs/numerics.md), and the CPU interpreter takes the kernels'
masks (vllm/kernels/interpreter_masks.py)."""
from __future__ import annotations

import ast
import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launches(path: str):
    """(line, kernel, keywords, starred names) of every `kernel[grid](...)` call in a file."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id.startswith("_") \
                and node.func.value.id.endswith("_kernel"):
            starred = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
            yield node.lineno, node.func.value.id, [k.arg for k in node.keywords if k.arg], starred


def _dicts_setting_fp_fusion(path: str) -> set[str]:
    """Names assigned `dict(..., enable_fp_fusion=...)` anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "dict" \
                and any(k.arg == "enable_fp_fusion" for k in node.value.keywords):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_every_launch_names_its_fp_fusion():
    """Triton 3.9 warns that the default contraction turns off in 3.10: a kernel's bits must not
    follow a library default, so each launch sets enable_fp_fusion itself, or passes a dict
    built in the same file with it."""
    missing, seen = [], 0
    for root, _, files in os.walk(os.path.join(REPO, "vllm")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            dicts_with_it = _dicts_setting_fp_fusion(path)
            for line, kernel, keywords, starred in _launches(path):
                seen += 1
                if "enable_fp_fusion" not in keywords and not set(starred) & dicts_with_it:
                    missing.append(f"{os.path.relpath(path, REPO)}:{line} {kernel}")
    assert seen > 40, seen  # the walk found the launches
    assert not missing, "launches without enable_fp_fusion:\n" + "\n".join(missing)


triton = pytest.importorskip("triton")


def test_interpreter_takes_a_scalar_flag_in_a_mask():
    """`(rows < n) & (flag != 0)` with a runtime scalar flag: the interpreter builds int32 data
    for it, which Triton 3.9's interpreted loads and stores refuse without the bool masks."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter's behaviour (TRITON_INTERPRET=1)")
    import triton.language as tl

    import vllm.kernels  # noqa: F401  (installs the interpreter's bool masks)

    @triton.jit
    def copy_head(x_ptr, out_ptr, n, flag, BLOCK: tl.constexpr):
        rows = tl.arange(0, BLOCK)
        m = (rows < n) & (flag != 0)
        tl.store(out_ptr + rows, tl.load(x_ptr + rows, mask=m, other=-1.0), mask=rows < BLOCK)

    x = torch.arange(8, dtype=torch.float32)
    for flag, want in ((1, [0, 1, 2, -1, -1, -1, -1, -1]), (0, [-1] * 8)):
        out = torch.zeros(8)
        copy_head[(1,)](x, out, 3, flag, BLOCK=8)
        assert out.tolist() == want
