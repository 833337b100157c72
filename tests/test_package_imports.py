"""Every module of the package imports, and no two modules import each other, even indirectly.

The import graph is read from the source, with every import counted: module level, inside
functions and under ``TYPE_CHECKING`` (a cycle hidden in a function or a type-only import is
still a knot a reader has to untie).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import deepinfer


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package rooted at ``root``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that the module ``name`` (source at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]  # ``from . import x``
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    u = stack.pop()
                    on_stack.discard(u)
                    comp.append(u)
                    if u == v:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return cycles


def package_graph(root: Path) -> dict[str, set[str]]:
    files = module_files(root)
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


ROOT = Path(deepinfer.__file__).parent


def test_every_module_imports():
    names = sorted(n for n in module_files(ROOT) if not n.endswith(".__main__"))  # (those run)
    assert "deepinfer.kv.build" in names and "deepinfer.kv.tiers.tier_io" in names
    for name in names:
        importlib.import_module(name)


def test_no_import_cycle():
    graph = package_graph(ROOT)
    assert graph["deepinfer.engine"] >= {"deepinfer.kv.build", "deepinfer.scheduler"}
    assert import_cycles(graph) == []


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = package_graph(pkg)
    assert graph["pkg.d"] == {"pkg.a"} and graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"}
    assert import_cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
