"""The function symbols of an ELF file, read in-process: its .symtab and .dynsym, the symbols that
lie in code sections (what `nm` types T, t, W, w and i), one per address, sorted.

The file is the target's, so hostile: read from a descriptor the caller opened as untrusted, with
every read bounded (section headers, symbol tables, string tables), every offset checked against
what was read; a table that does not fit is skipped, never trusted. Names stay raw (mangled) bytes
until asked for: a library has thousands of functions and a profile names a few dozen.

`nm` did this before, twice per file (the full table, then the dynamic one): a forked process per
run, whatever the file's size, paid at the first sample that lands in each of the engine's
libraries (dozens, under Python); docs/overhead.md has both timed (scripts/bench_symbols.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

#: bounds on what is read of one file (a larger table is left out: its file gets fewer names)
MAX_SECTIONS = 1 << 16
MAX_TABLE_BYTES = 256 << 20  # a symbol or string table
MAX_NAME_BYTES = 4096  # of one raw name (template names run long; the caller cuts what it shows)

SHT_SYMTAB, SHT_STRTAB, SHT_DYNSYM = 2, 3, 11
SHF_EXECINSTR = 0x4
SHN_LORESERVE = 0xFF00
STT_SECTION, STT_FILE, STT_TLS = 3, 4, 6
STB_GLOBAL, STB_WEAK = 1, 2

_SECTION = np.dtype(
    [
        ("name", "<u4"),
        ("type", "<u4"),
        ("flags", "<u8"),
        ("addr", "<u8"),
        ("offset", "<u8"),
        ("size", "<u8"),
        ("link", "<u4"),
        ("info", "<u4"),
        ("addralign", "<u8"),
        ("entsize", "<u8"),
    ]
)
_SYMBOL = np.dtype(
    [
        ("name", "<u4"),
        ("info", "u1"),
        ("other", "u1"),
        ("shndx", "<u2"),
        ("value", "<u8"),
        ("size", "<u8"),
    ]
)


class NotElf(ValueError):
    """Not a 64-bit little-endian ELF file, or its section headers do not fit in it."""


@dataclass
class SymbolTable:
    """Code symbols sorted by address, one per address: [starts[i], ends[i]) (ends == starts when
    the symbol has no size); the name of each is raw_name(i). `has_symtab`: the file has a .symtab
    with code in it (not stripped)."""

    starts: np.ndarray  # uint64
    ends: np.ndarray  # uint64
    _name_offs: np.ndarray  # uint32: offset in its string table
    _name_tabs: np.ndarray  # uint8: which string table
    _strtabs: list[bytes]
    has_symtab: bool

    def __len__(self) -> int:
        return len(self.starts)

    def index_of(self, vaddr: int) -> int | None:
        """The symbol around `vaddr`: the nearest at or below it, unless its size ends before."""
        i = int(np.searchsorted(self.starts, np.uint64(vaddr), side="right")) - 1
        if i < 0:
            return None
        start, end = int(self.starts[i]), int(self.ends[i])
        if end > start and vaddr >= end:
            return None
        return i

    def raw_name(self, i: int) -> str:
        return _name_at(self._strtabs[int(self._name_tabs[i])], int(self._name_offs[i]))


def _name_at(strtab: bytes, off: int) -> str:
    end = strtab.find(b"\0", off, off + MAX_NAME_BYTES)
    raw = strtab[off : end if end >= 0 else off + MAX_NAME_BYTES]
    return raw.decode("utf-8", errors="replace")


def _pread_exact(fd: int, size: int, offset: int) -> bytes | None:
    """`size` bytes at `offset`, or None when the file is shorter (a lying header)."""
    if size < 0 or offset < 0 or offset + size > os.fstat(fd).st_size:
        return None
    chunks, got = [], 0
    while got < size:
        b = os.pread(fd, size - got, offset + got)
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _sections(fd: int) -> np.ndarray:
    ehdr = _pread_exact(fd, 64, 0)
    if ehdr is None or ehdr[:4] != b"\x7fELF" or ehdr[4] != 2 or ehdr[5] != 1:
        raise NotElf("not a 64-bit little-endian ELF file")
    shoff = int.from_bytes(ehdr[0x28:0x30], "little")
    shentsize = int.from_bytes(ehdr[0x3A:0x3C], "little")
    shnum = int.from_bytes(ehdr[0x3C:0x3E], "little")
    if shoff == 0:
        return np.zeros(0, _SECTION)  # no section headers at all
    if shentsize != _SECTION.itemsize:
        raise NotElf(f"section header entries of {shentsize} bytes")
    if shnum == 0:  # extended numbering: the count is section 0's size
        first = _pread_exact(fd, _SECTION.itemsize, shoff)
        if first is None:
            raise NotElf("its section headers lie beyond its end")
        shnum = int(np.frombuffer(first, _SECTION)[0]["size"])
    if shnum > MAX_SECTIONS:
        raise NotElf(f"{shnum} sections")
    raw = _pread_exact(fd, shnum * _SECTION.itemsize, shoff)
    if raw is None:
        raise NotElf("its section headers lie beyond its end")
    return np.frombuffer(raw, _SECTION)


def _table(fd: int, sec: np.void) -> bytes | None:
    size = int(sec["size"])
    if size > MAX_TABLE_BYTES:
        return None
    return _pread_exact(fd, size, int(sec["offset"]))


def read_symbols(fd: int) -> SymbolTable:
    """The code symbols of the ELF file open at `fd` (NotElf when it is not one)."""
    sections = _sections(fd)
    code_sections = (sections["flags"] & SHF_EXECINSTR) != 0
    strtabs: list[bytes] = []
    parts: list[np.ndarray] = []
    tab_ids: list[np.ndarray] = []
    has_symtab = False
    for sec in sections:
        kind = int(sec["type"])
        if kind not in (SHT_SYMTAB, SHT_DYNSYM) or int(sec["entsize"]) != _SYMBOL.itemsize:
            continue
        link = int(sec["link"])
        if not 0 < link < len(sections) or int(sections[link]["type"]) != SHT_STRTAB:
            continue
        table, strtab = _table(fd, sec), _table(fd, sections[link])
        if table is None or strtab is None:
            continue
        syms = np.frombuffer(table, _SYMBOL, count=len(table) // _SYMBOL.itemsize)
        shndx = syms["shndx"].astype(np.int64)
        in_range = (shndx > 0) & (shndx < min(SHN_LORESERVE, len(sections)))
        in_code = np.zeros(len(syms), bool)
        in_code[in_range] = code_sections[shndx[in_range]]
        kinds = syms["info"] & 0xF
        keep = (
            in_code
            & (syms["value"] != 0)
            & (kinds != STT_SECTION)
            & (kinds != STT_FILE)
            & (kinds != STT_TLS)
            & (syms["name"] < len(strtab))
            & (syms["name"] > 0)
        )
        if not keep.any():
            continue
        has_symtab |= kind == SHT_SYMTAB
        parts.append(syms[keep])
        tab_ids.append(np.full(int(keep.sum()), len(strtabs), np.uint8))
        strtabs.append(strtab)
    if not parts:
        empty = np.zeros(0, np.uint64)
        return SymbolTable(empty, empty, np.zeros(0, np.uint32), np.zeros(0, np.uint8), [], False)
    syms = np.concatenate(parts)
    tabs = np.concatenate(tab_ids)
    chosen = _one_per_address(syms, tabs, strtabs)
    syms, tabs = syms[chosen], tabs[chosen]
    starts = syms["value"].astype(np.uint64)
    return SymbolTable(
        starts=starts,
        ends=starts + syms["size"].astype(np.uint64),
        _name_offs=syms["name"].astype(np.uint32),
        _name_tabs=tabs,
        _strtabs=strtabs,
        has_symtab=has_symtab,
    )


def _one_per_address(syms: np.ndarray, tabs: np.ndarray, strtabs: list[bytes]) -> np.ndarray:
    """Indices of the symbol kept at each address, sorted by address: of several (aliases, and the
    same function in .symtab and .dynsym), the one perf shows (tools/perf/util/symbol.c
    choose_best_symbol): one with a size, not weak, global, with fewer leading underscores (two
    or more count as two), the longest name; of equals, the first in the file's tables (perf keeps
    the one it read first). Sorted on those keys at once: libc has thousands of aliases."""
    lengths = np.zeros(len(syms), np.int64)
    underscores = np.zeros(len(syms), np.int64)
    for t, strtab in enumerate(strtabs):
        mine = np.flatnonzero(tabs == t)
        if not len(mine):
            continue
        chars = np.frombuffer(strtab, np.uint8)
        nuls = np.append(np.flatnonzero(chars == 0), len(chars))
        offs = syms["name"][mine].astype(np.int64)
        lengths[mine] = np.minimum(nuls[np.searchsorted(nuls, offs)] - offs, MAX_NAME_BYTES)
        first = chars[offs] == ord("_")
        second = first & (offs + 1 < len(chars))
        second[second] = chars[offs[second] + 1] == ord("_")
        underscores[mine] = first.astype(np.int64) + second
    bind = syms["info"] >> 4
    order = np.lexsort(
        (
            np.arange(len(syms)),  # the first in the tables
            -lengths,
            underscores,
            -(bind == STB_GLOBAL).astype(np.int64),
            -(bind != STB_WEAK).astype(np.int64),
            -(syms["size"] > 0).astype(np.int64),
            syms["value"],  # (the last key sorts first)
        )
    )
    values = syms["value"][order]
    first_of_address = np.ones(len(order), bool)
    first_of_address[1:] = values[1:] != values[:-1]
    return order[first_of_address]
