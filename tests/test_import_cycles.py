"""No two modules of the package import each other, directly or through others: every import
counts, at module level, inside functions and under `if TYPE_CHECKING:` alike (a circle of type
imports is still one object's logic spread over files that need each other).

Walks every module's imports with `ast` and looks for strongly connected components of the
import graph (Tarjan); a circle fails with its modules and the imports that close it.
tests/test_import_layers.py keeps the imports between the package's folders pointing down; this
keeps them from going round inside one folder."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "sparseety_prof"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of the package's modules (`from a.b import c` names a.b.c when c is
    a module, else a.b)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        # a relative import's base: the module's package (its own name for an __init__)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in modules else base)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
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
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _describe(circle: list[str], graph: dict[str, set[str]]) -> str:
    inside = set(circle)
    edges = [f"{a} -> {b}" for a in circle for b in sorted(graph[a] & inside)]
    return "; ".join(edges)


def _package_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def test_the_cycle_finder_finds_a_circle() -> None:
    """The finder itself: a circle through three modules and one of two, beside a chain."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(_circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_reads_type_checking_function_and_relative_imports(tmp_path: Path) -> None:
    """An import under `if TYPE_CHECKING:`, inside a function or relative is an edge like any
    other."""
    (tmp_path / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.y import Y\n"
    )
    (tmp_path / "y.py").write_text("def f():\n    import pkg.x\n")
    (tmp_path / "z.py").write_text("from . import x\nfrom .y import f\n")
    modules = {"pkg.x": tmp_path / "x.py", "pkg.y": tmp_path / "y.py", "pkg.z": tmp_path / "z.py"}
    graph = _import_graph(modules)
    assert graph == {"pkg.x": {"pkg.y"}, "pkg.y": {"pkg.x"}, "pkg.z": {"pkg.x", "pkg.y"}}
    assert _circles(graph) == [["pkg.x", "pkg.y"]]


@pytest.mark.parametrize("folder", ["correlate", ""])
def test_no_import_circle(folder: str) -> None:
    """None inside the correlator (its fast paths take its FeedState, never the correlator), and
    none in the whole package."""
    modules = _package_modules()
    prefix = f"sparseety_prof.{folder}" if folder else "sparseety_prof"
    assert any(m.startswith(prefix + ".") for m in modules)
    graph = _import_graph(modules)
    circles = [c for c in _circles(graph) if any(m.startswith(prefix) for m in c)]
    assert not circles, "\n".join(_describe(c, graph) for c in circles)
