"""The layout holds: only ``pytest_ddphooks/plugin/`` imports pytest, and no module imports
one that imports it back (in the package and in the reference trainer)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pytest_ddphooks", "reference_trainer")


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of ``known`` that ``name`` imports anywhere (functions and TYPE_CHECKING
    blocks included: an import put off to run time is still an import)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_one_that_imports_it_back(package: str) -> None:
    modules = _modules(package)
    # a package's __init__ re-exports its modules; importing a module runs its parents first,
    # which is not an import of the module's own
    graph = {
        name: {t for t in _imports(name, path, set(modules)) if not name.startswith(t + ".")}
        for name, path in modules.items()
    }
    assert _cycles(graph) == []


def test_only_the_plugin_package_imports_pytest() -> None:
    core = [name for name in _modules("pytest_ddphooks") if not name.startswith("pytest_ddphooks.plugin")]
    script = f"""
import importlib, importlib.abc, sys

class NoPytest(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("pytest", "_pytest", "pluggy"):
            raise ImportError(f"{{name}} imported outside pytest_ddphooks/plugin")
        return None

sys.meta_path.insert(0, NoPytest())
for name in {core!r}:
    importlib.import_module(name)
print("imported", len({core!r}))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"imported {len(core)}"


def test_the_plugin_package_is_where_pytest_is_imported() -> None:
    modules = _modules("pytest_ddphooks")
    importing = {
        name
        for name, path in modules.items()
        if any(
            isinstance(node, (ast.Import, ast.ImportFrom))
            and any(
                (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
                in ("pytest", "_pytest")
                for alias in node.names
            )
            for node in ast.walk(ast.parse(path.read_text()))
        )
    }
    assert importing and all(name.startswith("pytest_ddphooks.plugin") for name in importing), importing
