"""The package's folders are its pipeline: a module imports only from its own stage or an earlier
one, so data flows one way (capture -> store -> correlate -> gpu -> session -> views -> commands).

Walks every module's imports (module level and inside functions) with `ast`; an import from a
later stage fails with the module, the line and the stage it reached into."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "sparseety_prof"

# Stage order; a module may import from any stage at its own rank or lower.
STAGES: dict[str, int] = {
    "errors": 0,  # the exceptions and their exit codes: every stage raises them
    "checks": 0,  # a check's result line, shared by doctor and the GPU diagnosis
    "terminal_text": 0,  # untrusted strings made safe to print: every stage that prints uses it
    # the build of the C helpers and of the compiled correlator (compile_correlator.py reads
    # correlate/build_stamp.py by its path, never through the package)
    "native": 0,
    # the generated GGUF models of the demo and the tests (numpy and gguf only, no profiler part)
    "synthetic": 0,
    "capture": 1,  # the only importer of bcc: probes, ring, plans, target inspection, layouts
    "store": 2,  # the schema (every column) and the on-disk recording format
    "correlate": 3,  # probe records -> steps, tokens, routes, requests
    "gpu": 4,  # the CUPTI ring and the kernel correlator
    "session": 5,  # attach, the consumer loop, scheduling, metadata
    "views": 6,  # live view, report, diff
    "commands": 7,  # one module per subcommand
    "cli": 7,  # the dispatcher
}


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "sparseety_prof" or len(parts) < 2:
        return None
    return parts[1].removesuffix(".py")


def _module_name(path: Path, pkg: Path = PKG) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, pkg: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of a sparseety_prof module in the file."""
    name = _module_name(path, pkg)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if node.module is None or mod == "sparseety_prof":
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, mod))
    return [(ln, m) for ln, m in out if m.startswith("sparseety_prof.")]


MODULES = sorted(p for p in PKG.rglob("*.py") if p != PKG / "__init__.py")


def test_every_module_belongs_to_a_stage() -> None:
    unknown = {str(p.relative_to(PKG)) for p in MODULES if _stage(_module_name(p)) not in STAGES}
    assert not unknown, f"modules outside every stage: {sorted(unknown)}"


def _back_edges(path: Path, pkg: Path = PKG) -> list[str]:
    own = _stage(_module_name(path, pkg))
    assert own is not None
    return [
        f"line {ln}: {mod} ({_stage(mod)}, after {own})"
        for ln, mod in _imports(path, pkg)
        if _stage(mod) in STAGES and STAGES[_stage(mod) or ""] > STAGES[own]
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_flow_one_way(path: Path) -> None:
    back = _back_edges(path)
    assert not back, f"{path.relative_to(PKG)} imports from a later stage: " + "; ".join(back)


def test_the_walk_sees_back_edges(tmp_path: Path) -> None:
    """The checker itself: relative, absolute and function-level imports from a later stage are
    reported; the same imports the other way are not."""
    pkg = tmp_path / "sparseety_prof"
    (pkg / "capture").mkdir(parents=True)
    bad = pkg / "capture" / "bad.py"
    bad.write_text(
        "from ..correlate import correlator\n"
        "import sparseety_prof.views.live\n"
        "def f():\n    from sparseety_prof import cli\n    return cli\n"
    )
    assert [e.split(":")[0] for e in _back_edges(bad, pkg)] == ["line 1", "line 2", "line 4"]
    good = pkg / "capture" / "good.py"
    good.write_text(
        "from . import elf\nfrom ..errors import ProfError\nfrom sparseety_prof.capture import target\n"
    )
    assert _back_edges(good, pkg) == []


def test_only_capture_imports_bcc() -> None:
    """bcc (root, kernel headers, a compiler) stays in the capture stage: every later stage can be
    imported, and its tests run, without it."""
    importers = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            if any(n == "bcc" or n.startswith("bcc.") for n in names):
                importers.append(str(path.relative_to(PKG)))
    assert importers and all(p.startswith("capture/") for p in importers), importers
