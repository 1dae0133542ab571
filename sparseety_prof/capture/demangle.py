"""C++ names demangled by binutils' c++filt, many per run: one process for every new name of a
drain, not one per name (a fork costs more than the names)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable

from sparseety_prof.capture.untrusted_files import trusted_tool

CXXFILT_TIMEOUT_S = 60
MAX_BATCH = 20_000  # names per c++filt run


def mangled(name: str) -> bool:
    """An Itanium C++ ABI mangled name (what g++ and clang emit on Linux)."""
    return name.startswith("_Z")


def demangle(names: Iterable[str]) -> dict[str, str]:
    """Each mangled name's demangled form. A name c++filt cannot read comes back as it was; with
    no c++filt on the host (binutils not installed), or one that fails, every name stays mangled."""
    todo = [n for n in dict.fromkeys(names) if mangled(n) and _one_line(n)]
    out: dict[str, str] = {}
    for at in range(0, len(todo), MAX_BATCH):
        batch = todo[at : at + MAX_BATCH]
        out.update(zip(batch, _cxxfilt(batch), strict=True))
    return out


def _one_line(name: str) -> bool:
    # a name is one line of c++filt's input: one with a line break (a hostile file's) is left alone
    return "\n" not in name and "\r" not in name


def _cxxfilt(batch: list[str]) -> list[str]:
    try:
        done = subprocess.run(
            [trusted_tool("c++filt")],
            input="\n".join(batch) + "\n",
            capture_output=True,
            text=True,
            errors="replace",
            timeout=CXXFILT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return batch
    lines = done.stdout.split("\n")[: len(batch)]
    if done.returncode != 0 or len(lines) != len(batch):
        return batch
    return lines
