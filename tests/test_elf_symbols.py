"""Function symbols read from ELF files in-process (capture/elf_symbols.py) against binutils' nm on
the host's own libraries, the same reader on files made hostile, and c++filt in batches
(capture/demangle.py)."""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from sparseety_prof.capture import demangle as demangle_mod
from sparseety_prof.capture.demangle import demangle
from sparseety_prof.capture.elf_symbols import NotElf, SymbolTable, read_symbols

NM = "/usr/bin/nm"
#: nm's letters of symbols in code sections: text (local, global) and indirect functions
NM_CODE = frozenset("Tti")


def _libraries() -> list[Path]:
    """ELF files every set-up has, with .symtab or without: the C and C++ runtimes, libpython or
    the interpreter, and a numpy extension (a .symtab of thousands)."""
    import numpy._core._multiarray_umath as umath

    libdir = Path(sysconfig.get_config_var("LIBDIR") or "/usr/lib")
    found = [Path(sys.executable).resolve(), Path(umath.__file__)]
    found += sorted(libdir.glob("libpython3*.so.1.0"))
    for name in ("libc.so.6", "libstdc++.so.6", "libm.so.6"):
        found += [p for p in (Path("/lib/x86_64-linux-gnu") / name, Path("/usr/lib64") / name) if p.exists()][
            :1
        ]
    return [p.resolve() for p in found if p.exists()]


def _nm_symbols(path: Path, *extra: str) -> dict[int, set[tuple[str, str]]]:
    """address -> {(type letter, raw name)} of nm's defined symbols with an address."""
    out = subprocess.run(
        [NM, *extra, "--defined-only", str(path)],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=120,
    ).stdout
    got: dict[int, set[tuple[str, str]]] = {}
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) != 3 or len(parts[1]) != 1:
            continue
        got.setdefault(int(parts[0], 16), set()).add((parts[1], parts[2].split("@", 1)[0]))
    return got


def _table(path: Path) -> SymbolTable:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_symbols(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("path", _libraries(), ids=lambda p: p.name)
def test_the_code_symbols_are_nms_code_symbols_address_for_address(path: Path) -> None:
    table = _table(path)
    nm = _nm_symbols(path)
    for addr, got in _nm_symbols(path, "-D").items():
        nm.setdefault(addr, set()).update(got)
    code = {a for a, syms in nm.items() if a and any(t in NM_CODE for t, _ in syms)}
    starts = [int(a) for a in table.starts]
    assert starts == sorted(set(starts)), "one symbol per address, sorted"
    assert code <= set(starts), f"nm's code symbols missing: {sorted(code - set(starts))[:5]}"
    # every symbol kept is one nm lists at that address (W: weak, in code or not for nm), by name
    for i, a in enumerate(starts):
        names = {n for _, n in nm.get(a, ())}
        assert table.raw_name(i).split("@", 1)[0] in names, (hex(a), table.raw_name(i), names)
    assert table.has_symtab == bool(_nm_symbols(path))


def test_of_aliases_the_one_perf_shows_is_kept_and_sizes_bound_lookups(tmp_path: Path) -> None:
    src = tmp_path / "alias.c"
    src.write_text(
        "int work(int x) { return x * 3 + 1; }\n"
        'int __attribute__((weak, alias("work"))) weak_work(int x);\n'
        'static int __attribute__((alias("work"), used)) _local_work(int x);\n'
        "int other(int x) { return x - 1; }\n"
    )
    lib = tmp_path / "libalias.so"
    gcc = shutil.which("gcc")
    assert gcc, "gcc is part of the set-up (scripts/install.sh)"
    subprocess.run([gcc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=120)
    table = _table(lib)
    addr = next(a for a, s in _nm_symbols(lib).items() if ("T", "work") in s)
    i = table.index_of(addr)
    assert i is not None and table.raw_name(i) == "work"  # global beats weak and local
    assert table.index_of(addr + 1) == i
    assert int(table.ends[i]) > addr
    # an address past a sized function's end is not that function's, however near
    other = next(a for a, s in _nm_symbols(lib).items() if ("T", "other") in s)
    j = table.index_of(other)
    assert j is not None and table.raw_name(j) == "other"
    assert table.index_of(int(table.ends[j])) != j


def _section_headers(data: bytes) -> tuple[int, int]:
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    (shnum,) = struct.unpack_from("<H", data, 0x3C)
    return shoff, shnum


def test_hostile_files_are_refused_or_read_within_bounds(tmp_path: Path) -> None:
    """Truncated, lying and randomly corrupted section headers and tables: NotElf or a table,
    never another error, never a read past what the headers bound."""
    good = Path(sys.executable).resolve().read_bytes()
    libc = next((p for p in _libraries() if p.name.startswith("libc.so")), None)
    if libc is not None:
        good = libc.read_bytes()
    shoff, shnum = _section_headers(good)
    cases: list[bytes] = [
        b"",
        b"\x7fELF",
        good[: len(good) // 2],  # the section headers cut off
        good[:64],
        b"\x7fELF\x01\x01" + good[6:],  # 32-bit
    ]
    lie = bytearray(good)
    struct.pack_into("<Q", lie, 0x28, len(good) + 4096)  # headers past the end
    cases.append(bytes(lie))
    lie = bytearray(good)
    struct.pack_into("<H", lie, 0x3C, 0)  # extended numbering, section 0 says 2^40 sections
    struct.pack_into("<Q", lie, shoff + 32, 1 << 40)
    cases.append(bytes(lie))
    for field_at, value in ((24, 1 << 62), (32, 1 << 62), (24, len(good) - 8), (40, 5), (56, 1)):
        for k in range(shnum):  # every section's offset, size, link or entsize made to lie
            lie = bytearray(good)
            struct.pack_into("<Q" if field_at != 40 else "<I", lie, shoff + 64 * k + field_at, value)
            cases.append(bytes(lie))
    rng = random.Random(62)
    for _ in range(200):  # random bytes written over the section headers and the tables
        lie = bytearray(good)
        for _ in range(16):
            at = rng.choice([shoff + rng.randrange(64 * shnum), rng.randrange(len(good))])
            lie[at] = rng.randrange(256)
        cases.append(bytes(lie))
    path = tmp_path / "hostile.so"
    for data in cases:
        path.write_bytes(data)
        try:
            table = _table(path)
        except NotElf:
            continue
        for i in range(0, len(table), max(1, len(table) // 50)):
            assert isinstance(table.raw_name(i), str)
            assert len(table.raw_name(i).encode()) <= 4 * 4096


def test_a_name_without_its_terminating_nul_is_cut_at_the_bound(tmp_path: Path) -> None:
    lib = tmp_path / "libnul.so"
    src = tmp_path / "nul.c"
    src.write_text("int f_" + "x" * 5000 + "(int x) { return x + 1; }\n")
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=120)
    table = _table(lib)
    longest = max((table.raw_name(i) for i in range(len(table))), key=len)
    assert longest.startswith("f_xxx") and len(longest) == 4096


def test_names_are_demangled_in_one_run_as_cxxfilt_does_one_by_one() -> None:
    names = [
        "_ZN11llama_model4loadERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
        "_ZNSt6vectorIiSaIiEE9push_backERKi",
        "ggml_graph_compute",  # not mangled: left out
        "_Zbroken",  # c++filt cannot read it: as it was
        "_ZN1a1bEv\n_ZN1c1dEv",  # a line break (a hostile file's name): left alone
    ]
    got = demangle(names)
    for n in names[:2] + names[3:4]:
        one = subprocess.run(
            ["/usr/bin/c++filt", n], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert got[n] == one
    assert got[names[0]].startswith("llama_model::load(")
    assert "ggml_graph_compute" not in got and names[4] not in got


def test_without_cxxfilt_names_stay_mangled(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise FileNotFoundError(name)

    monkeypatch.setattr(demangle_mod, "trusted_tool", missing)
    assert demangle(["_ZNSt6vectorIiSaIiEE9push_backERKi"]) == {
        "_ZNSt6vectorIiSaIiEE9push_backERKi": "_ZNSt6vectorIiSaIiEE9push_backERKi"
    }
