"""The `--watch` grammar of the CUPTI injection library, in Python: `pattern:arg:dtype:rule` entries
(cupti_ext/README.md "Watched kernels"). The library parses SPARSEETY_WATCH itself (cupti_ext/src/
watch.c) and reports a bad entry only into its ring, after the engine started; this module mirrors
that parser so `launch` and `--late-attach` refuse a bad spec up front, and so the presets
(`presets.py`) can be checked without a GPU. tests/test_watch_presets.py checks that the two
parsers agree: the shape evaluated here is the one the library copies on the stub driver.

The limits are the library's: at most 16 entries (SPARSEETY_WATCH and SPARSEETY_WATCH_FILE
together), patterns shorter than 128 bytes, argument indices below 256, at most 4 dimensions of at
most 6 terms."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_ENTRIES = 16  # WATCH_MAX in cupti_ext/src/internal.h
MAX_PATTERN_BYTES = 127  # char pattern[128], NUL-terminated
MAX_DIMS = 4  # WATCH_MAX_DIMS
MAX_TERMS = 6  # WATCH_MAX_TERMS
#: dtype name -> element size in bytes (watch.c DTYPES)
DTYPES = {
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "bool": 1,
}
GEOMETRY = ("grid.x", "grid.y", "grid.z", "block.x", "block.y", "block.z")


class WatchSpecError(ValueError):
    """A watch spec the library would refuse; the message names the entry and the part."""


@dataclass(frozen=True)
class Term:
    """One factor of a dimension: kind is "const", "arg32", "arg64" or one of GEOMETRY."""

    kind: str
    value: int = 0  # the constant, or the argument index


@dataclass(frozen=True)
class WatchRule:
    pattern: str  # substring of the (mangled) kernel name
    arg_index: int  # the argument holding the device pointer
    dtype: str
    dims: tuple[tuple[Term, ...], ...]  # each dimension a product of terms

    def args_read(self) -> dict[int, int]:
        """The scalar arguments the shape reads: index -> size in bytes (4 or 8)."""
        return {
            t.value: 4 if t.kind == "arg32" else 8
            for d in self.dims
            for t in d
            if t.kind in ("arg32", "arg64")
        }

    def shape(
        self,
        args: Mapping[int, int],
        grid: Sequence[int] = (1, 1, 1),
        block: Sequence[int] = (1, 1, 1),
    ) -> tuple[int, ...]:
        """The buffer's shape for a launch with scalar arguments `args` (index -> value)."""
        geometry = dict(zip(GEOMETRY, (*grid, *block), strict=True))
        out = []
        for d in self.dims:
            v = 1
            for t in d:
                if t.kind == "const":
                    v *= t.value
                elif t.kind in ("arg32", "arg64"):
                    v *= args[t.value]
                else:
                    v *= geometry[t.kind]
            out.append(v)
        return tuple(out)

    def nbytes(self, shape: Sequence[int]) -> int:
        return math.prod(shape) * DTYPES[self.dtype]


def _uint(s: str) -> int | None:
    """watch.c parse_uint: decimal digits only (no sign, no space)."""
    return int(s) if s.isascii() and s.isdigit() else None


def _term(text: str) -> Term | None:
    t = text.strip()
    if t in GEOMETRY:
        return Term(t)
    if t.startswith("arg"):
        kind = "arg32"
        if "." in t:
            t, _, suffix = t.partition(".")
            if suffix != "i64":
                return None
            kind = "arg64"
        n = _uint(t[3:])
        return None if n is None else Term(kind, n)
    n = _uint(t)
    return None if n is None else Term("const", n)


def _entry(line: str) -> WatchRule:
    # split from the right: the pattern may itself contain ':' (a demangled name)
    parts = line.rsplit(":", 3)
    if len(parts) != 4:
        raise WatchSpecError(f"watch entry {line!r} is not pattern:arg:dtype:rule")
    pattern, arg, dtype, rule = (p.strip() for p in parts)
    if not pattern or len(pattern.encode()) > MAX_PATTERN_BYTES:
        raise WatchSpecError(f"watch pattern empty or longer than {MAX_PATTERN_BYTES} bytes: {line!r}")
    index = _uint(arg)
    if index is None or index > 255:
        raise WatchSpecError(f"watch {pattern!r}: argument index {arg!r} is not a number below 256")
    if dtype not in DTYPES:
        raise WatchSpecError(f"watch {pattern!r}: unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    dims: list[tuple[Term, ...]] = []
    # strtok semantics: empty pieces between separators are skipped
    for dim in (d for d in rule.split(",") if d):
        if len(dims) == MAX_DIMS:
            raise WatchSpecError(f"watch {pattern!r}: more than {MAX_DIMS} dimensions")
        terms: list[Term] = []
        for piece in (p for p in dim.split("*") if p):
            term = _term(piece)
            if len(terms) == MAX_TERMS or term is None:
                raise WatchSpecError(
                    f"watch {pattern!r}: bad count term {piece.strip()!r} (constant, argN, argN.i64, "
                    f"grid.x|y|z, block.x|y|z; at most {MAX_TERMS} per dimension)"
                )
            terms.append(term)
        if not terms:
            raise WatchSpecError(f"watch entry {line!r} is not pattern:arg:dtype:rule")
        dims.append(tuple(terms))
    if not dims:
        raise WatchSpecError(f"watch entry {line!r} is not pattern:arg:dtype:rule")
    return WatchRule(pattern, index, dtype, tuple(dims))


def parse(text: str) -> list[WatchRule]:
    """The entries of a spec: separated by ';' or newlines, '#' starts a comment."""
    rules: list[WatchRule] = []
    for raw in text.replace(";", "\n").split("\n"):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if len(rules) == MAX_ENTRIES:
            raise WatchSpecError(f"more than {MAX_ENTRIES} watched kernels")
        rules.append(_entry(line))
    return rules


def match(rules: Sequence[WatchRule], kernel_name: str) -> WatchRule | None:
    """The rule the library applies to a kernel: the first whose pattern is a substring of its name."""
    return next((r for r in rules if r.pattern in kernel_name), None)
