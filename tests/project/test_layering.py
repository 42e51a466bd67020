"""The package's layers: utils → distributed → context → opt_lib → search → accelerate.

A module imports only from its own layer or lower ones, the module-level import graph has no cycle,
nothing under ``atorch/`` imports the test helpers in ``atorch/testing``, and imports inside
functions are left only for optional backends (they must not be needed to import atorch).
Checked statically with ``ast``, so the check itself imports nothing.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "atorch"

LAYERS = ["utils", "distributed", "context", "opt_lib", "search", "accelerate"]
# longest prefix wins; a package's __init__ is listed by its package name
LAYER_OF_PREFIX = {
    "atorch.errors": "utils", "atorch.utils": "utils", "atorch.kernels": "utils", "atorch.models": "utils",
    "atorch.common": "utils", "atorch.data": "utils",
    "atorch.distributed": "distributed",
    "atorch.auto.strategy": "context", "atorch.auto.model_context": "context", "atorch.auto.stages": "context",
    "atorch.auto.optimizer": "context", "atorch.auto.optimizer_kernels": "context",
    "atorch.auto.gradients": "context", "atorch.auto.dryrun": "context", "atorch.auto.errors": "context",
    "atorch.auto.loss_probe": "context", "atorch.auto.given_model": "context", "atorch.auto.no_sync": "context",
    "atorch.auto.loss_items": "context",
    "atorch.checkpoint": "context", "atorch.auto.checkpointing": "context",
    "atorch.auto.opt_lib": "opt_lib", "atorch.auto.apply": "opt_lib",
    "atorch.auto.search": "search", "atorch.plan": "search", "atorch.cost_model": "search",
    "atorch.auto.accelerate": "accelerate", "atorch.auto": "accelerate", "atorch": "accelerate",
}
TESTING = "atorch.testing"
# packages that may be imported inside a function: optional backends atorch runs without
OPTIONAL_BACKENDS = ("deepspeed", "transformer_engine", "flash_attn", "matplotlib", "transformers", "fairscale")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> str | None:
    if module == TESTING or module.startswith(TESTING + "."):
        return None
    for prefix in sorted(LAYER_OF_PREFIX, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYER_OF_PREFIX[prefix]
    raise AssertionError(f"{module} is in no layer: add it to LAYER_OF_PREFIX")


def _targets(node: ast.AST, importer: str) -> list[str]:
    """atorch modules an import statement loads (``from pkg import submodule`` counts as the submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = importer.split(".")
        package = package[: len(package) - node.level + (1 if MODULES[importer].name == "__init__.py" else 0)]
        base = ".".join(package + ([base] if base else []))
    out = []
    for alias in node.names:
        full = f"{base}.{alias.name}"
        out.append(full if full in MODULES else base)
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or (
        isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")


def imports(module: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(module-level imports, imports inside functions) as (target, line)."""
    tree = ast.parse(MODULES[module].read_text())
    top, inner = [], []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue  # annotations only: never executed
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(child, module):
                    (inner if in_function else top).append((target, child.lineno))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return top, inner


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_points_up_and_nothing_imports_the_test_helpers():
    problems = []
    for module in MODULES:
        mine = layer_of(module)
        top, inner = imports(module)
        for target, line in top + inner:
            if not target.startswith("atorch"):
                continue
            theirs = layer_of(target)
            if mine is None:
                continue  # atorch/testing may use everything
            if theirs is None:
                problems.append(f"{module}:{line} imports the test helpers {target}")
            elif LAYERS.index(theirs) > LAYERS.index(mine):
                problems.append(f"{module}:{line} ({mine}) imports {target} ({theirs}), a higher layer")
    assert not problems, "\n".join(problems)


def test_imports_inside_functions_only_load_optional_backends():
    problems = []
    for module in MODULES:
        for target, line in imports(module)[1]:
            if target.split(".")[0] not in OPTIONAL_BACKENDS:
                problems.append(f"{module}:{line} imports {target} inside a function")
    assert not problems, "\n".join(problems)


def test_module_level_import_graph_has_no_cycle():
    graph = {m: sorted({t for t, _ in imports(m)[0] if t in MODULES and t != m}) for m in MODULES}
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in graph[node]:
            if state.get(target) == 1:
                cycle = stack[stack.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module)


def test_each_overloaded_word_names_one_thing():
    """docs/architecture.md "Words": a class named *Layout* is a tensor x pipeline layout of the search;
    no class is a *Planner* (that word is ``atorch.plan``'s alone); the word "planner" appears in no
    module outside ``atorch/plan`` (torch's own ``torch.distributed.checkpoint.planner`` aside)."""
    problems = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            if "Layout" in node.name and not module.startswith("atorch.auto.search"):
                problems.append(f"{module}.{node.name}: 'layout' is the search's tensor x pipeline sizes")
            if "Planner" in node.name:
                problems.append(f"{module}.{node.name}: 'planner' is atorch.plan alone")
        if not module.startswith("atorch.plan") and re.search(r"(?<![.\w])planners?\b", path.read_text(), re.I):
            problems.append(f"{module} says 'planner' outside atorch/plan")
    assert not problems, "\n".join(problems)


def test_a_process_launch_without_the_multirank_marker_fails(tmp_path):
    """tests/conftest.py keeps ``-m "not multirank"`` exact: run on a file of its own, an unmarked test
    that starts ranks (spawned or forked) fails naming the marker, and the same test marked passes."""
    import shutil
    import subprocess
    import sys

    shutil.copy(ROOT.parent / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_spawn.py").write_text(
        "import pytest\nimport torch.multiprocessing as mp\n\n"
        "@pytest.mark.parametrize('method', ['spawn', 'forkserver'])\n"
        "def test_unmarked(method):\n    mp.get_context(method)\n\n"
        "@pytest.mark.multirank\ndef test_marked():\n    mp.get_context('forkserver')\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "markers=multirank",
                           str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "2 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    for method in ("spawn", "forkserver"):
        assert f"test_unmarked[{method}] starts ranks but is not marked multirank" in done.stdout, done.stdout
