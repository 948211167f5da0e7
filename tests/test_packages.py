"""The top-level packages form layers: no two import each other, and runtime imports none of ours.

Read from the source with `ast`, imports inside functions included (a deferred import is still
a dependency), so a loop fails here even where no import order would ever trip over it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))


def _imported_modules(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module  # relative imports stay inside their package


def package_imports() -> dict[str, dict[str, list[str]]]:
    """{package: {package it imports: ["path:line", ...]}}, across packages only."""
    graph: dict[str, dict[str, list[str]]] = {p: defaultdict(list) for p in PACKAGES}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for lineno, module in _imported_modules(tree):
                target = module.partition(".")[0]
                if target in graph and target != package:
                    graph[package][target].append(f"{path.relative_to(ROOT)}:{lineno}")
    return graph


def _loop_through(graph, start: str) -> list[str] | None:
    """The shortest chain of imports from `start` back to itself, or None."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for package in frontier:
            for target in graph[package]:
                if target == start:
                    return paths[package] + [start]
                if target not in paths:
                    paths[target] = paths[package] + [target]
                    following.append(target)
        frontier = following
    return None


def test_the_packages_are_found():
    assert {"runtime", "actors", "kernels", "prefix_store", "gateway", "bench", "tests"} <= set(PACKAGES)


def test_no_package_imports_another_that_imports_it_back():
    graph = package_imports()
    loops: dict[frozenset[str], str] = {}
    for package in PACKAGES:
        loop = _loop_through(graph, package)
        if loop is not None and frozenset(loop) not in loops:  # a -> b -> a and b -> a -> b once
            sites = [f"  {a} -> {b}: {', '.join(graph[a][b])}" for a, b in zip(loop, loop[1:])]
            loops[frozenset(loop)] = " -> ".join(loop) + "\n" + "\n".join(sites)
    assert not loops, "package import loops:\n" + "\n".join(loops.values())


def test_runtime_imports_no_other_package_of_ours():
    imports = package_imports()["runtime"]
    assert not imports, "runtime imports " + "; ".join(f"{p} at {', '.join(s)}" for p, s in imports.items())
