"""The folders where the recorder's work happens keep their functions short enough to read whole:
no function or method in `session/`, `correlate/` and `commands/` is longer than MAX_LINES, from
its `def` to its last line (docstring and comments included). A longer one fails with its place.

The bound is a reading aid, not a style rule for the whole package: views and capture code with
long tables of cases are left out on purpose."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "sparseety_prof"
FOLDERS = ("session", "correlate", "commands")
MAX_LINES = 80


def _long_functions(path: Path, root: Path = PKG.parent) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > MAX_LINES:
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {n} lines")
    return out


def test_no_function_in_the_engine_room_is_longer_than_the_bound() -> None:
    files = sorted(p for folder in FOLDERS for p in (PKG / folder).rglob("*.py"))
    assert len(files) > 50  # (the folders are there: the scan cannot pass on nothing)
    long = [f for p in files for f in _long_functions(p)]
    assert not long, "\n".join(long)


def test_the_scan_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    src = tmp_path / "m.py"
    src.write_text(f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body}\n")
    assert _long_functions(src, tmp_path) == [f"m.py:6 long: {MAX_LINES + 1} lines"]
