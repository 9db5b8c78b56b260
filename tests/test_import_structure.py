"""The vllm package's import structure, read from the source with `ast` (nothing is imported).

Every import statement counts: module level, and inside functions and methods (a lazy
import that closes a cycle is still a cycle, only hidden until the function runs). An
import names its target module: `import a.b` and `from a import b` (b a module) depend on
a.b, `from a.b import name` on a.b. Packages imported on the way (`a` for `a.b`) are not
counted: importing any submodule runs them, so counting them would make every package
and its submodules one cycle.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> dict[str, str]:
    mods = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "vllm")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: str, mods: dict[str, str]) -> dict[str, int]:
    """{imported vllm module: line} for every import statement in the file."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in mods:
                    found.setdefault(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                target = f"{module}.{alias.name}"
                if target in mods:
                    found.setdefault(target, node.lineno)
                elif module in mods:
                    found.setdefault(module, node.lineno)
    found.pop(name, None)
    return found


def _graph() -> dict[str, dict[str, int]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_among_vllm_modules():
    graph = _graph()
    assert len(graph) > 50 and "vllm.kernels.ops" in graph  # the walk found the package
    cycles = _cycles(graph)
    detail = ["; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in comp for b in sorted(graph[a]) if b in comp)
              for comp in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_cycle_finder_sees_function_level_and_relative_imports(tmp_path):
    """The finder itself: imports inside functions and relative imports are edges, and a
    cycle closed by one is reported."""
    mods = {"vllm.p": str(tmp_path / "p" / "__init__.py"), "vllm.p.a": str(tmp_path / "p" / "a.py"),
            "vllm.p.b": str(tmp_path / "p" / "b.py")}
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("")
    (tmp_path / "p" / "a.py").write_text("from . import b\n")
    (tmp_path / "p" / "b.py").write_text("def f():\n    from vllm.p.a import g\n    return g\n")
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert graph["vllm.p.a"] == {"vllm.p.b": 1} and graph["vllm.p.b"] == {"vllm.p.a": 2}
    assert _cycles(graph) == [["vllm.p.a", "vllm.p.b"]]


def test_forward_context_is_read_through_its_public_api():
    """Only vllm/forward_context.py touches its module state (`_LOCAL`, the per-thread context)."""
    offenders = []
    for name, path in _modules().items():
        if name == "vllm.forward_context":
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        offenders += [f"{name}:{n.lineno}" for n in ast.walk(tree)
                      if isinstance(n, ast.Attribute) and n.attr in ("_LOCAL", "_current")]
    assert not offenders, offenders


def test_worker_reaches_kernels_only_through_the_op_shim():
    """No kernel choice in the worker: it calls the op shim (which dispatches through the
    numerics table) and the start-up self-check, never a kernel module directly."""
    graph = _graph()
    allowed = {"vllm.kernels.ops", "vllm.kernels.selfcheck"}
    direct = {(w, m) for w in graph if w.startswith("vllm.worker.")
              for m in graph[w] if m.startswith("vllm.kernels.") and m not in allowed}
    assert not direct, sorted(direct)
