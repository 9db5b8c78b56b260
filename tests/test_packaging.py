"""setup.py says the truth: the torch / triton this suite runs on lie in the declared
(tested) range, and every third-party module the package imports is declared."""
from __future__ import annotations

import ast
import importlib.metadata
import os
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_kwargs() -> dict:
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}


def _requirements() -> dict[str, Requirement]:
    kw = _setup_kwargs()
    reqs = [Requirement(r) for r in kw["install_requires"]]
    reqs += [Requirement(r) for extra in kw["extras_require"].values() for r in extra]
    return {canonicalize_name(r.name): r for r in reqs}


@pytest.mark.parametrize("dist", ["torch", "triton"])
def test_running_versions_are_in_the_declared_range(dist):
    req = _requirements()[dist]
    assert req.specifier, f"setup.py must bound {dist} to the tested range"
    assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), f"{dist} needs an upper bound"
    have = Version(importlib.metadata.version(dist))
    assert req.specifier.contains(have, prereleases=True), (
        f"{dist} {have} is outside setup.py's tested range {req.specifier}: run the suite on it, then widen the range")


def _third_party_imports() -> set[str]:
    mods = set()
    for top in ("vllm", "training"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for fn in files:
                if not fn.endswith(".py"):
                    continue
                tree = ast.parse(open(os.path.join(dirpath, fn)).read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        mods.update(a.name.split(".")[0] for a in node.names)
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        mods.add(node.module.split(".")[0])
    return {m for m in mods if m not in sys.stdlib_module_names and m not in ("vllm", "training", "__future__")}


def test_every_imported_package_is_declared():
    mods = _third_party_imports()
    assert {"torch", "triton", "transformers"} <= mods  # the scan sees the package's imports
    dists = importlib.metadata.packages_distributions()
    declared = set(_requirements())
    missing = {m: dists.get(m, [m]) for m in mods
               if not any(canonicalize_name(d) in declared for d in dists.get(m, [m]))}
    assert not missing, f"imported but not declared in setup.py: {missing}"
