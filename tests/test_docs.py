"""What the README and docs/ tell a user to type exists in the code."""
from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
IMPORT = re.compile(r"^\s*(from (?:vllm|training)[\w.]* import [\w, ]+|import (?:vllm|training)[\w.]*)\s*$", re.M)


def _imports():
    for page in PAGES:
        for line in IMPORT.findall(open(page).read()):
            yield os.path.relpath(page, ROOT), line.strip()


@pytest.mark.parametrize("page,line", list(_imports()))
def test_documented_imports_exist(page, line):
    exec(line, {})


def test_the_pattern_finds_documented_imports():
    """The import check above is not vacuous: the docs do show imports."""
    assert any(line.startswith("from vllm") for _, line in _imports())


def test_training_docs_contract_check_runs(tiny_qwen3):
    """The contract comparison docs/training.md shows, run as written: compatible
    contracts pass, a fast engine's contract is refused with a ValueError."""
    import warnings

    from vllm import LLM

    text = open(os.path.join(ROOT, "docs", "training.md")).read()
    snippet = [ln.strip() for ln in text.splitlines() if ln.startswith("    ") and "check_compatible(" in ln]
    assert len(snippet) == 1, "docs/training.md shows one contract check as code"
    llm = LLM(tiny_qwen3, device="cpu")
    exec(snippet[0], {"llm": llm, "policy": llm.policy()})
    fast = LLM(tiny_qwen3, device="cpu", numerics="fast")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fast-policy warning is tested in test_training.py
        fast_policy = fast.policy()
    with pytest.raises(ValueError, match="numerical"):
        exec(snippet[0], {"llm": llm, "policy": fast_policy})
