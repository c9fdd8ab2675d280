"""The layers of docs/architecture.md, enforced on every module's imports (deferred ones inside
functions included, as tests/test_imports.py reads them):

    libs ← kernels ← rows (stages, peers) ← runners (training, ladder, sweep, speedrun, …) ← cli

A module imports nothing from a layer above its own: rows never import runners, and runners
never import the CLI. The CLI itself imports nothing from graphtrain.libs (it reaches the GPU
through the rows and the trainer), and only graphtrain.libs touches the CUDA APIs: no other module
imports the `cuda` package (cuda.bindings, cuda.pathfinder, cuda.core) or opens a shared library
with ctypes. Every other module (config, plan, recipe, reference, data, environment, …) is shared:
any layer may import it, and it imports no row, runner or CLI, so a new module that does must
be given its layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_imports import PACKAGE, import_graph, module_files

LIBS, KERNELS, SHARED, ROWS, RUNNERS, CLI = "libs", "kernels", "shared", "rows", "runners", "cli"
# What each layer may not import. Shared modules sit beside libs and kernels: libs import
# errors, phases and files; environment asks libs for versions; plan and recipe take ceil_div.
ABOVE = {LIBS: {KERNELS, ROWS, RUNNERS, CLI}, KERNELS: {ROWS, RUNNERS, CLI}, SHARED: {ROWS, RUNNERS, CLI},
         ROWS: {RUNNERS, CLI}, RUNNERS: {CLI}, CLI: set()}

# graphtrain.packed trains many models on the persistent rung's device pieces at once: a row of
# the sweep (which runs it) and of the jax-vmap peer (which checks a pack with it).
ROW_MODULES = {"graphtrain.packed"}
RUNNER_MODULES = {"graphtrain.training", "graphtrain.ladder", "graphtrain.sweep", "graphtrain.speedrun",
                  "graphtrain.data_parallel", "graphtrain.workers", "graphtrain.cluster"}
CLI_MODULES = {"graphtrain.cli", "graphtrain.__main__"}

# The process's entry point, not the CLI: before graphtrain.cli and numpy are imported it starts
# CUDA on a thread of its own and loads NVRTC there (graphtrain.__main__'s docstring), which is
# graphtrain.libs' work, called directly so that nothing else is imported first.
CLI_MAY_IMPORT_LIBS = {"graphtrain.__main__"}

# ctypes calls that open a shared library; `ctypes.CDLL(None)` opens none (it is the process's own
# symbols: graphtrain.capture flushes libc's stdio buffers through it) and is allowed anywhere.
LIBRARY_OPENERS = {"CDLL", "PyDLL", "LoadLibrary", "dlopen"}


def layer_of(module: str) -> str:
    if module == "graphtrain.libs" or module.startswith("graphtrain.libs."):
        return LIBS
    if module == "graphtrain.kernels" or module.startswith("graphtrain.kernels."):
        return KERNELS
    if module.startswith(("graphtrain.stages", "graphtrain.peers")) or module in ROW_MODULES:
        return ROWS
    if module in RUNNER_MODULES:
        return RUNNERS
    if module in CLI_MODULES:
        return CLI
    return SHARED


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer above the importer's, as "a (layer) → b (layer)"."""
    found = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            mine, theirs = layer_of(module), layer_of(other)
            if theirs in ABOVE[mine]:
                found.append(f"{module} ({mine}) → {other} ({theirs})")
    return found


def cli_imports_of_libs(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} → {other}" for module, imported in sorted(graph.items())
            if layer_of(module) == CLI and module not in CLI_MAY_IMPORT_LIBS
            for other in sorted(imported) if layer_of(other) == LIBS]


def cuda_api_uses(path: Path) -> list[str]:
    """Where the module at `path` imports the `cuda` package or opens a shared library through
    ctypes (a call named CDLL, PyDLL, LoadLibrary or dlopen, unless its argument is None)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [f"line {node.lineno}: import {name}" for name in names if name.split(".")[0] == "cuda"]
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            opens_the_process = (len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
                                 and node.args[0].value is None)
            if called in LIBRARY_OPENERS and not opens_the_process:
                found.append(f"line {node.lineno}: {called}(…)")
    return found


# --------------------------------------------------------------------------------------------
# the checks see a violation


def test_the_checks_see_each_kind_of_violation(tmp_path):
    assert upward_imports({"graphtrain.stages.graphs": {"graphtrain.speedrun"}}) == [
        "graphtrain.stages.graphs (rows) → graphtrain.speedrun (runners)"]
    assert upward_imports({"graphtrain.peers.torch_graph": {"graphtrain.cli"}}) != []
    assert upward_imports({"graphtrain.libs.cuda": {"graphtrain.kernels"}}) != []
    assert upward_imports({"graphtrain.kernels.head": {"graphtrain.stages.base"}}) != []
    assert upward_imports({"graphtrain.config": {"graphtrain.stages"}}) != []  # a shared module
    assert upward_imports({"graphtrain.sweep": {"graphtrain.cli"}}) != []
    assert upward_imports({"graphtrain.speedrun": {"graphtrain.stages.cnn_device", "graphtrain.libs.cuda",
                                                   "graphtrain.sweep", "graphtrain.recipe"}}) == []
    assert cli_imports_of_libs({"graphtrain.cli": {"graphtrain.libs.cuda", "graphtrain.training"}}) == [
        "graphtrain.cli → graphtrain.libs.cuda"]
    path = tmp_path / "x.py"
    path.write_text("import ctypes\nimport numpy\n\ndef f():\n    from cuda.bindings import driver\n"
                    "    import cuda.pathfinder\n    ctypes.CDLL('libcublas.so')\n    ctypes.cdll.LoadLibrary('x')\n"
                    "    ctypes.CDLL(None).fflush(None)\n    ctypes.sizeof(ctypes.c_int)\n")
    assert cuda_api_uses(path) == ["line 5: import cuda.bindings", "line 6: import cuda.pathfinder",
                                   "line 7: CDLL(…)", "line 8: LoadLibrary(…)"]


# --------------------------------------------------------------------------------------------
# graphtrain keeps them


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    graph = import_graph()
    # the walk sees a deferred import in a function: the trainer's of CUDA (begin_first_uses)
    assert "graphtrain.libs.cuda" in graph["graphtrain.training"]
    return graph


def test_every_layer_has_modules(graph):
    layers = {layer_of(module) for module in graph}
    assert layers == {LIBS, KERNELS, SHARED, ROWS, RUNNERS, CLI}
    assert (RUNNER_MODULES | CLI_MODULES | ROW_MODULES) <= set(graph)  # no stale name above


def test_no_module_imports_from_a_layer_above_its_own(graph):
    """Rows never import runners or the CLI; kernels no rows; libs no kernels; …"""
    found = upward_imports(graph)
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_rows_import_no_runner(graph):
    """The rule as docs/architecture.md states it, by name: no module under graphtrain.stages or
    graphtrain.peers imports speedrun, sweep, ladder or the CLI."""
    runners = {"graphtrain.speedrun", "graphtrain.sweep", "graphtrain.ladder", "graphtrain.cli"}
    found = [f"{module} → {other}" for module, imported in sorted(graph.items())
             if module.startswith(("graphtrain.stages", "graphtrain.peers")) for other in sorted(imported & runners)]
    assert not found, "rows importing runners:\n" + "\n".join(found)


def test_the_row_registry_names_rows_only():
    """graphtrain.stages imports its rows by name (importlib), which the walk cannot see: every
    class that trains a model and every pack is a row's (the speedrun's rows among them: the
    classes that train the cnn)."""
    from graphtrain.config import MODELS
    from graphtrain.stages import REGISTRY, Trainer

    targets = {f"{spec.name} {model}{' --gpus' * dp}": trainer.target for spec in REGISTRY for model in MODELS
               for dp in (False, True) if isinstance(trainer := spec.trainer(model, dp), Trainer)}
    targets |= {f"{spec.name} pack": spec.pack.target for spec in REGISTRY if spec.pack}
    targets |= {f"{spec.name} cnn pack": spec.pack_cnn.target for spec in REGISTRY if spec.pack_cnn}
    outside = {name: target for name, target in targets.items() if layer_of(target.split(":")[0]) != ROWS}
    assert len(targets) > len(REGISTRY) and not outside, outside


def test_the_cli_imports_nothing_from_libs(graph):
    found = cli_imports_of_libs(graph)
    assert not found, "the CLI importing graphtrain.libs:\n" + "\n".join(found)


def test_only_libs_touch_the_cuda_apis():
    found = [f"{name} {use}" for name, path in sorted(module_files().items()) if layer_of(name) != LIBS
             for use in cuda_api_uses(path)]
    assert not found, "CUDA APIs used outside graphtrain.libs:\n" + "\n".join(found)
    # and libs do use them: the check reads what it should
    assert cuda_api_uses(PACKAGE / "libs" / "cuda.py") and cuda_api_uses(PACKAGE / "libs" / "shared_lib.py")
