""".ci/run proves the README: it runs the README's two commands verbatim, in a fresh venv."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ci_commands() -> dict[str, str]:
    text = open(os.path.join(ROOT, ".ci", "run")).read()
    return dict(re.findall(r"^(INSTALL_CMD|TEST_CMD)='([^']*)'$", text, re.M))


def _readme_commands() -> list[str]:
    # the "Two commands" section's indented code lines
    section = open(os.path.join(ROOT, "README.md")).read().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_ci_runs_the_readme_commands_verbatim():
    ci = _ci_commands()
    assert set(ci) == {"INSTALL_CMD", "TEST_CMD"}, ci
    assert _readme_commands()[:2] == [ci["INSTALL_CMD"], ci["TEST_CMD"]]


def test_ci_uses_a_fresh_venv_and_runs_both_commands():
    text = open(os.path.join(ROOT, ".ci", "run")).read()
    body = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    code = "\n".join(body)
    assert re.search(r"python3? -m venv \"\$WORK/venv\"", code) and 'source "$WORK/venv/bin/activate"' in code
    assert "mktemp -d" in code  # a new directory each run, never a reused environment
    # the install runs before the tests, both inside the venv (after activation)
    act, inst, test = (code.index(s) for s in ('activate"', 'bash -c "$INSTALL_CMD"', 'bash -c "$TEST_CMD"'))
    assert act < inst < test


def test_ci_runs_in_a_fresh_copy_of_the_checkout():
    """What earlier runs left in this checkout (runs/, caches) must not change the result:
    the commands run in a copy of the files git tracks or would track."""
    text = open(os.path.join(ROOT, ".ci", "run")).read()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "git ls-files -z --cached --others --exclude-standard" in code
    assert code.index('cd "$WORK/src"') < code.index('bash -c "$INSTALL_CMD"')
