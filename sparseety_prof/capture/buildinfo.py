"""Which llama.cpp build a process runs, read from the binaries it maps.

The files say it themselves, without running them: `ggml_version()` returns a string constant
(ggml's version, which moves with llama.cpp), `LLAMA_BUILD_NUMBER` / `LLAMA_COMMIT` are globals of
llama.cpp's common library (0 / "unknown" in builds made without git metadata, e.g. the wheels on
PyPI), and every file has a GNU build id. The Python package around a library, where there is
one, is only a hint. Reads are bounded: these files belong to the profiled process.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

from sparseety_prof.capture.elf import load_segments, open_elf
from sparseety_prof.capture.target import symbol_table

MAX_STRING = 128
_DATA_TYPES = {"B", "b", "D", "d", "R", "r", "T", "t"}
_WANTED = ("ggml_version", "ggml_commit", "LLAMA_BUILD_NUMBER", "LLAMA_COMMIT")


@dataclass(frozen=True)
class BuildIdentity:
    ggml_version: str | None  # e.g. "0.26.0"
    build_number: int | None  # llama.cpp's bNNNN, when the build recorded one
    commit: str | None  # llama.cpp's commit, when the build recorded one
    package: str  # "llama-cpp-python", "xllamacpp", or "" (a built binary, another program)
    package_version: str
    build_ids: tuple[str, ...]  # GNU build ids of the probed files

    def describe(self) -> str:
        parts = []
        if self.build_number:
            parts.append(f"llama.cpp b{self.build_number}")
        if self.commit:
            parts.append(f"commit {self.commit}")
        if self.ggml_version:
            parts.append(f"ggml {self.ggml_version}")
        if self.package:
            parts.append(f"{self.package} {self.package_version}")
        return ", ".join(parts) or "unidentified build"

    def to_meta(self) -> dict[str, object]:
        return {
            "ggml_version": self.ggml_version,
            "llama_build_number": self.build_number,
            "llama_commit": self.commit,
            "package": self.package or None,
            "package_version": self.package_version or None,
            "build_ids": list(self.build_ids),
        }


def version_key(v: str | None) -> tuple[int, ...]:
    """'0.26.0' -> (0, 26, 0); unparsable parts end the key."""
    out = []
    for p in (v or "").split("."):
        if not p.isdigit():
            break
        out.append(int(p))
    return tuple(out)


def identify(files: list[Path], package: tuple[str, str], build_ids: list[str]) -> BuildIdentity:
    """Read the build's own markers from `files` (the probed libraries or executable)."""
    ggml_version = commit = None
    build_number: int | None = None
    for f in dict.fromkeys(files):
        try:
            found = read_markers(f)
        except (OSError, ValueError):
            continue
        ggml_version = ggml_version or found.get("ggml_version")
        commit = commit or found.get("commit")
        build_number = build_number or found.get("build_number")  # type: ignore[assignment]
    return BuildIdentity(
        ggml_version=ggml_version if isinstance(ggml_version, str) else None,
        build_number=build_number if isinstance(build_number, int) and build_number > 0 else None,
        commit=commit if isinstance(commit, str) else None,
        package=package[0] if package[0] != "unknown" else "",
        package_version=package[1] if package[0] != "unknown" else "",
        build_ids=tuple(b for b in build_ids if b),
    )


def read_markers(path: Path) -> dict[str, object]:
    """ggml_version / ggml_commit (from the functions' `lea` of a string constant), and the
    LLAMA_BUILD_NUMBER / LLAMA_COMMIT globals of one ELF file."""
    table = symbol_table(path)
    syms = {name: table[name][0] for name in _WANTED if name in table and table[name][2] in _DATA_TYPES}
    segs = load_segments(path)
    out: dict[str, object] = {}
    with open_elf(path) as f:
        for fn, key in (("ggml_version", "ggml_version"), ("ggml_commit", "commit")):
            if fn in syms:
                s = _returned_string(f, segs, syms[fn])
                if s and s != "unknown":
                    out[key] = s
        if "LLAMA_BUILD_NUMBER" in syms:
            raw = _read(f, segs, syms["LLAMA_BUILD_NUMBER"], 4)
            if raw is not None:
                out["build_number"] = struct.unpack("<i", raw)[0]
        if "LLAMA_COMMIT" in syms and "commit" not in out:
            raw = _read(f, segs, syms["LLAMA_COMMIT"], 8)
            if raw is not None:
                s = _cstring(f, segs, struct.unpack("<Q", raw)[0])
                if s and re.fullmatch(r"[0-9a-f]{7,40}", s):
                    out["commit"] = s
    return out


def _read(f: object, segs: list[tuple[int, int, int]], vaddr: int, n: int) -> bytes | None:
    """n bytes at a virtual address, from the file (None where it is not file-backed, e.g. .bss)."""
    for seg_vaddr, seg_off, seg_size in segs:
        if seg_vaddr <= vaddr and vaddr + n <= seg_vaddr + seg_size:
            f.seek(seg_off + vaddr - seg_vaddr)  # type: ignore[attr-defined]
            data: bytes = f.read(n)  # type: ignore[attr-defined]
            return data if len(data) == n else None
    return None


def _cstring(f: object, segs: list[tuple[int, int, int]], vaddr: int) -> str | None:
    for n in (MAX_STRING, 16):
        raw = _read(f, segs, vaddr, n)
        if raw is not None:
            end = raw.find(b"\0")
            if end < 0:
                return None
            s = raw[:end].decode("ascii", errors="replace")
            return s if s.isprintable() else None
    return None


def _returned_string(f: object, segs: list[tuple[int, int, int]], fn_vaddr: int) -> str | None:
    """The string a `const char *f(void) { return "..."; }` returns: its first instructions are
    (endbr64;) lea rax, [rip + disp32]; ret."""
    code = _read(f, segs, fn_vaddr, 16)
    if code is None:
        return None
    i = code.find(b"\x48\x8d\x05")
    if i < 0 or i > 4:
        return None
    (disp,) = struct.unpack_from("<i", code, i + 3)
    return _cstring(f, segs, fn_vaddr + i + 7 + disp)
