"""graphtrain's modules import one another without a circle, deferred imports inside functions
included (a circle hidden in a function still ties the two modules together), and the pair that
once formed one (profile measures, report writes) each imports alone."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graphtrain"


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The graphtrain modules `name` imports anywhere in its text. A package's own ancestors are
    left out: Python has them imported before the module runs, so they add no dependency."""
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            # `from a import b`: the module a.b where b is one, else a itself
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names)
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {m for m in found if m in modules and m != name and m not in ancestors}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (a → … → a) by depth-first search, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        state[node] = "done"
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (circle := visit(start)):
            return circle
    return None


def test_the_walk_sees_a_circle_made_of_deferred_imports(tmp_path):
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None
    # profile → report was a deferred import inside a function: the walk reads those too
    path = tmp_path / "x.py"
    path.write_text("import numpy\n\ndef f():\n    from graphtrain import y\n    from . import z\n")
    modules = dict.fromkeys(["graphtrain", "graphtrain.x", "graphtrain.y", "graphtrain.z"])
    assert imports_of("graphtrain.x", path, modules) == {"graphtrain.y", "graphtrain.z"}


def test_no_import_circle_in_graphtrain():
    graph = import_graph()
    assert {"graphtrain.profile", "graphtrain.report", "graphtrain.training"} <= set(graph)
    assert "graphtrain.profile" in graph["graphtrain.report"]  # the walk does see imports
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " → ".join(circle)


@pytest.mark.parametrize("module", ["graphtrain.profile", "graphtrain.report"])
def test_module_imports_alone(module):
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
