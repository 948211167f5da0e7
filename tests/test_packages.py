"""The top-level packages form layers: no two import each other, and runtime imports none of ours;
inside a package, no two modules import each other either.

Read from the source with `ast`, imports inside functions and under `TYPE_CHECKING` included (a
deferred or a type-only import is still a dependency), so a loop fails here even where no import
order would ever trip over it.
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


# Loops inside a package that are left to their owners: each may shrink, none may grow, and one that is
# gone must leave this table (so that it cannot come back unnoticed).
KNOWN_LOOPS = {
    "kernels": ({"kernels.cpu_gemm", "kernels.cpu_native", "kernels.decode_layers", "kernels.packed_linear",
                 "kernels.paged_attention_cpu", "kernels.quant_linear", "kernels.quant_amx", "kernels.shm_all_reduce"},
                "the C library's loader declares decode_layers' and shm_all_reduce's argument structs and times "
                "paged_attention_cpu's prefetch as it loads; packed_linear hands many bf16 rows to quant_amx's "
                "launcher"),
    "runtime": ({"runtime.actor", "runtime.cell", "runtime.codec", "runtime.connection", "runtime.messages",
                 "runtime.outbox", "runtime.pipe", "runtime.ref", "runtime.remoting", "runtime.seal",
                 "runtime.system", "runtime.turns"},
                "the actor, its cell, refs, the system and the wire name each other's types (pipe and "
                "turns name their cell's type only, as annotations)"),
}


def _modules() -> dict[str, Path]:
    """{dotted module name: its file}; a package's __init__.py is the package's own name."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def module_imports() -> dict[str, dict[str, list[str]]]:
    """{module: {module of the same package it imports: ["path:line", ...]}}. `from a.b import c` is an
    import of the module a.b.c where there is one, else of a.b."""
    modules = _modules()
    graph: dict[str, dict[str, list[str]]] = {m: defaultdict(list) for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module and name.partition(".")[0] == module.partition(".")[0]:
                    graph[module][name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return graph


def _reachable(graph, start: str) -> set[str]:
    seen, frontier = {start}, [start]
    while frontier:
        following = []
        for module in frontier:
            for target in graph[module]:
                if target not in seen:
                    seen.add(target)
                    following.append(target)
        frontier = following
    return seen


def module_loops(graph) -> list[set[str]]:
    """Each set of modules that import one another, round a loop (the graph's cycles, grouped)."""
    reach = {m: _reachable(graph, m) for m in graph}
    loops: list[set[str]] = []
    for m in sorted(graph):
        loop = {t for t in reach[m] if m in reach[t]}
        if len(loop) > 1 and loop not in loops:
            loops.append(loop)
    return loops


def _report(graph, loops) -> str:
    """Each loop as its shortest chain of imports, with the sites of each import."""
    report = []
    for loop in loops:
        chain = _loop_through(graph, min(loop))
        report.append(" -> ".join(chain) + "\n" + "\n".join(
            f"  {a} -> {b}: {', '.join(graph[a][b])}" for a, b in zip(chain, chain[1:])))
    return "\n".join(report)


def test_no_module_imports_another_of_its_package_that_imports_it_back():
    graph = module_imports()
    loops = module_loops(graph)
    known = [modules for modules, _ in KNOWN_LOOPS.values()]
    unexpected = [loop for loop in loops if not any(loop <= k for k in known)]
    assert not unexpected, "module import loops:\n" + _report(graph, unexpected)
    gone = [package for package, (modules, _) in KNOWN_LOOPS.items() if not any(loop <= modules for loop in loops)]
    assert not gone, f"no loop left in {gone}: remove it from KNOWN_LOOPS"


def test_the_module_graph_sees_a_loop():
    """The check above on a graph of three modules, one import of which closes a loop."""
    graph = {"p.a": {"p.b": ["a.py:1"]}, "p.b": {"p.c": ["b.py:1"]}, "p.c": {}, "p.d": {"p.a": ["d.py:1"]}}
    assert module_loops(graph) == []
    graph["p.c"] = {"p.a": ["c.py:9"]}
    assert module_loops(graph) == [{"p.a", "p.b", "p.c"}]
    assert _loop_through(graph, "p.a") == ["p.a", "p.b", "p.c", "p.a"]


def _subpackage(module: str, modules: dict[str, Path]) -> str:
    """The deepest package that holds `module` (a package's own name for its __init__)."""
    name = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
    return name or module


def subpackage_imports(graph, modules) -> dict[str, dict[str, list[str]]]:
    """{subpackage: {sibling or cousin subpackage it imports: sites}}, from the module graph; a package
    importing its own parent or child is its layering (actors.worker reads actors.config) and is left out."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module, targets in graph.items():
        a = _subpackage(module, modules)
        out[a]
        for target, sites in targets.items():
            b = _subpackage(target, modules)
            if a != b and not b.startswith(a + ".") and not a.startswith(b + "."):
                out[a][b].extend(sites)
                out[b]
    return out


def test_no_subpackage_imports_a_sibling_that_imports_it_back():
    """actors/scheduler, actors/worker, actors/kv, actors/model, ...: each a layer of its own. The tests'
    folders share their fixtures and are left out."""
    modules = _modules()
    graph = {m: t for m, t in module_imports().items() if m.partition(".")[0] != "tests"}
    sub = subpackage_imports(graph, modules)
    assert {"actors.scheduler", "actors.worker", "actors.model"} <= set(sub)
    loops = module_loops(sub)
    assert not loops, "subpackage import loops:\n" + _report(sub, loops)


def test_the_subpackage_graph_sees_a_loop_between_siblings_and_not_with_a_parent():
    modules = {name: Path(f"{name.replace('.', '/')}{'/__init__' if name.count('.') < 2 else ''}.py")
               for name in ("p", "p.a", "p.a.x", "p.b", "p.b.y", "p.z")}
    modules["p.z"] = Path("p/z.py")
    graph = {"p.a.x": {"p.z": ["x.py:1"]}, "p.z": {"p.a.x": ["z.py:1"]}, "p.b.y": {"p.a.x": ["y.py:1"]},
             "p": {}, "p.a": {}, "p.b": {}}
    sub = subpackage_imports(graph, modules)
    assert module_loops(sub) == []          # p.a <-> p (its parent): layering
    graph["p.a.x"] = {**graph["p.a.x"], "p.b.y": ["x.py:2"]}
    assert module_loops(subpackage_imports(graph, modules)) == [{"p.a", "p.b"}]
