"""Whether the correlator runs compiled (mypyc) or as its Python source, and why.

The correlator's per-token work is Python function calls and attribute and dict reads: about 220
calls per token at four llama-server clients (`scripts/replay_drains.py replay --profile`).
mypyc compiles the same typed source into C extension modules
(`sparseety_prof/native/compile_correlator.py`, run by the package's build), which run those
calls, reads and loops without the interpreter. The compiled modules are kept apart from the
source, in `sparseety_prof/native/build/compiled/`, with a stamp naming what they were built
from: the sha256 of every source module, the interpreter (cache tag and extension suffix) and
mypyc's version. The package (correlate/__init__.py) puts them first on its `__path__` only when
each stamped source is unchanged and the interpreter is the one they were built for: a checkout
edited since its build, another Python, or `SPARSEETY_PROF_PURE_PYTHON=1` runs the source, never
a stale build. `STATE` says which, and why (meta.json `correlator.build`, and the first line
of `scripts/replay_drains.py replay`).

This module and the package's __init__ are never compiled: they decide.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

#: set to 1 to run the correlator's Python source even where a compiled build is present
PURE_ENV = "SPARSEETY_PROF_PURE_PYTHON"
STAMP_NAME = "stamp.json"
#: mypyc's group, one shared library for all the modules: calls between them stay direct C calls
GROUP = "sparseety_prof.correlate.compiled"
#: a stamp is a few KiB; a larger file is not ours
_STAMP_MAX = 1 << 16

#: "compiled" or "source: <why>", set when the package is imported
STATE = "source: not checked"


def package_dir() -> Path:
    """This package's source folder (sparseety_prof/correlate)."""
    return Path(__file__).resolve().parent


def compiled_root(pkg: Path) -> Path:
    """Where the build puts the compiled tree (its sparseety_prof/correlate holds the modules),
    in a checkout or an installed package alike."""
    return pkg.parent / "native" / "build" / "compiled"


def source_modules(pkg: Path) -> list[Path]:
    """The modules mypyc compiles: every module of the package but its __init__ and this one."""
    return sorted(p for p in pkg.glob("*.py") if p.name not in ("__init__.py", "build_stamp.py"))


def interpreter() -> dict[str, str]:
    return {
        "cache_tag": str(sys.implementation.cache_tag),
        "ext_suffix": str(sysconfig.get_config_var("EXT_SUFFIX")),
    }


def make_stamp(pkg: Path, mypyc_version: str) -> dict[str, object]:
    return {
        "sources": {p.name: _sha256(p) for p in source_modules(pkg)},
        "interpreter": interpreter(),
        "mypyc": mypyc_version,
    }


def compiled_dir(pkg: Path) -> tuple[Path | None, str]:
    """The folder of compiled modules to put first on the package's __path__, or None, and a
    word on why."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None, f"source: {PURE_ENV} is set"
    root = compiled_root(pkg)
    stamp_file = root / STAMP_NAME
    try:
        with stamp_file.open("rb") as f:
            stamp = json.loads(f.read(_STAMP_MAX + 1)[:_STAMP_MAX])
    except FileNotFoundError:
        return None, "source: no compiled build (scripts/setup.sh makes one)"
    except (OSError, ValueError) as e:
        return None, f"source: the compiled build's stamp is unreadable ({type(e).__name__})"
    if not isinstance(stamp, dict):
        return None, "source: the compiled build's stamp is not one"
    if stamp.get("interpreter") != interpreter():
        return None, "source: the compiled build is for another Python"
    stamped = stamp.get("sources")
    current = source_modules(pkg)
    if not isinstance(stamped, dict) or set(stamped) != {p.name for p in current}:
        return None, "source: the compiled build is of other modules (rebuild it)"
    for p in current:
        if stamped[p.name] != _sha256(p):
            return None, f"source: {p.name} changed since the compiled build (rebuild it)"
    where = root / "sparseety_prof" / "correlate"
    if not where.is_dir():
        return None, "source: the compiled build's modules are missing"
    return where, "compiled"


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()
