"""Names for the sampled addresses of the engine (capture/cpu_sampler.py): address -> the mapping
of /proc/PID/maps that holds it -> the ELF file's virtual address -> the function symbol around
it, demangled.

The files are the target's, so hostile (capture/untrusted_files.py): each is opened through the
process's own mapping (/proc/PID/map_files/START-END, which the kernel follows to the very file
mapped, never through a name), a regular file only, its symbol tables read in-process with
bounded reads (capture/elf_symbols.py), once per file. C++ names are demangled by binutils'
c++filt from /usr/bin, the new names of a drain in one run (capture/demangle.py).

What cannot be named, said plainly in meta.json (`files`):
- a stripped file has its dynamic symbols only (.dynsym): its static and hidden functions show
  as "FILE+0xOFFSET" (the offset in the file), never as a wrong name; unless the host has its
  separate debug file (/usr/lib/debug/.build-id/, Debian's -dbg and -dbgsym packages), found by
  the file's build id, whose .symtab then names them;
- the engine's Python frames (llama-cpp-python) are not symbolised: a sample in Python code shows
  the interpreter's own C functions (_PyEval_EvalFrameDefault, ...), not the Python function;
- anonymous memory (JIT code) is "[anon]"; a sample in the kernel ends its stack with "[kernel]".
"""

from __future__ import annotations

import bisect
import os
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sparseety_prof.capture.demangle import demangle
from sparseety_prof.capture.elf import load_segments
from sparseety_prof.capture.elf_symbols import NotElf, SymbolTable, read_symbols
from sparseety_prof.capture.proc_maps import MapsEntry, read_maps
from sparseety_prof.capture.untrusted_files import RefusedFile, open_untrusted
from sparseety_prof.errors import ProfError

MAX_NAME = 400  # characters of a demangled name kept (template names run to thousands)
KERNEL_FRAME = "[kernel]"
ANON_FRAME = "[anon]"
UNKNOWN_FRAME = "[unknown]"
#: where Debian's -dbg/-dbgsym packages put separate debug files, by GNU build id (root's, not
#: the target's: the host's system directory)
DEBUG_ROOT = Path("/usr/lib/debug/.build-id")
NOTE_MAX = 1 << 16  # bytes of a PT_NOTE segment read

#: what each file's names come from, in meta.json
SYMBOLS_FULL = "symtab"  # .symtab (with .dynsym): every function
SYMBOLS_DEBUG_FILE = "debug file"  # stripped, but the host has its separate debug symbols (below)
SYMBOLS_DYNAMIC = "dynamic only"  # stripped: exported functions only
SYMBOLS_NONE = "none"  # no symbol at all, or the file could not be read (why says)


@dataclass
class FileSymbols:
    """One mapped ELF file's function symbols (raw: mangled), and how its virtual addresses sit
    in the file (PT_LOAD segments)."""

    path: str
    source: str  # SYMBOLS_*
    table: SymbolTable | None = None
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (vaddr, offset, size)
    why: str = ""  # why it has no symbols, when it has none

    def vaddr(self, file_offset: int) -> int | None:
        for vaddr, off, size in self.segments:
            if off <= file_offset < off + size:
                return vaddr + file_offset - off
        return None

    def name(self, vaddr: int) -> str | None:
        """The raw name of the function around `vaddr` (a version cut: memmove@@GLIBC_2.2.5)."""
        table = self.table
        i = table.index_of(vaddr) if table is not None else None
        if table is None or i is None:
            return None
        name = table.raw_name(i)
        return name.split("@", 1)[0] if "@" in name and "(" not in name else name


def build_id(fd: int) -> str | None:
    """The GNU build id of the 64-bit little-endian ELF file open at `fd` (its NT_GNU_BUILD_ID
    note), as hex; None when it has none. Bounded reads: the header, the program headers, notes."""
    ehdr = os.pread(fd, 64, 0)
    if len(ehdr) < 64 or ehdr[:4] != b"\x7fELF" or ehdr[4] != 2 or ehdr[5] != 1:
        return None
    (phoff,) = struct.unpack_from("<Q", ehdr, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", ehdr, 0x36)
    if phentsize < 56 or phnum > 256:
        return None
    ph = os.pread(fd, phentsize * phnum, phoff)
    for i in range(len(ph) // phentsize):
        p_type, _flags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack_from("<IIQQQQ", ph, i * phentsize)
        if p_type != 4:  # PT_NOTE
            continue
        notes = os.pread(fd, min(p_filesz, NOTE_MAX), p_offset)
        at = 0
        while at + 12 <= len(notes):
            namesz, descsz, kind = struct.unpack_from("<III", notes, at)
            name_at = at + 12
            desc_at = name_at + (namesz + 3) // 4 * 4
            if (
                kind == 3
                and notes[name_at : name_at + namesz] == b"GNU\x00"
                and desc_at + descsz <= len(notes)
            ):
                return notes[desc_at : desc_at + descsz].hex()
            at = desc_at + (descsz + 3) // 4 * 4
    return None


def _debug_symbols(fd: int) -> SymbolTable | None:
    """The .symtab of the host's separate debug file of the file at `fd`, if it has one."""
    bid = build_id(fd)
    if not bid or len(bid) < 4:
        return None
    path = DEBUG_ROOT / bid[:2] / f"{bid[2:]}.debug"
    try:
        dfd, _ = open_untrusted(path)
    except OSError:
        return None
    try:
        table = read_symbols(dfd)
    except (OSError, NotElf):
        return None
    finally:
        os.close(dfd)
    return table if len(table) else None


def load_file_symbols(pid: int, m: MapsEntry) -> FileSymbols:
    """The symbols of the file of mapping `m` of process `pid`, read through the mapping itself."""
    link = f"/proc/{pid}/map_files/{m.map_files_name}"
    try:
        # the kernel follows a map_files link to the very file mapped (no name is looked up);
        # O_NOFOLLOW does not apply to these links, and a FIFO or device is still refused
        fd, _ = open_untrusted(link)
    except (RefusedFile, OSError) as e:
        return FileSymbols(m.path, SYMBOLS_NONE, why=str(e))
    try:
        table = read_symbols(fd)
        source = SYMBOLS_FULL if table.has_symtab else SYMBOLS_DYNAMIC if len(table) else SYMBOLS_NONE
        if not table.has_symtab:
            debug = _debug_symbols(fd)
            if debug is not None:  # (a debug file's .symtab holds the dynamic symbols too)
                table, source = debug, SYMBOLS_DEBUG_FILE
        segments = load_segments(Path(f"/dev/fd/{fd}"))
    except (OSError, ValueError, struct.error) as e:  # (NotElf is a ValueError)
        return FileSymbols(m.path, SYMBOLS_NONE, why=str(e))
    finally:
        os.close(fd)
    why = "" if len(table) else "no symbols"
    return FileSymbols(m.path, source, table=table, segments=segments, why=why)


class Symboliser:
    """Frame names for one process's addresses; its maps re-read when an address lies outside
    every mapping known (a library loaded since), at most every MAPS_REREAD_S: a stack walked
    through code built without frame pointers ends in addresses that lie in no mapping at all, a
    new one at nearly every sample, and reading the maps for each would cost more than the
    sampling itself. A re-read that still leaves the address outside every mapping (an address
    astray, not a new library) doubles that period, up to MAPS_REREAD_MAX_S; one that places it
    sets it back. `clock` is time.monotonic (tests replace it)."""

    #: the shortest time between two reads of the process's maps, and the longest it grows to
    MAPS_REREAD_S = 1.0
    MAPS_REREAD_MAX_S = 32.0
    #: names kept per address (addresses of stack walks gone astray are many), and demangled
    #: names kept: beyond it the cache starts over
    MAX_NAMES = 1 << 18

    def __init__(self, pid: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.pid = pid
        self._maps: list[MapsEntry] = []
        self._map_starts: list[int] = []
        self._files: dict[tuple[str, int, int], FileSymbols] = {}
        self._names: dict[int, str] = {}  # address -> raw name
        self._shown: dict[str, str] = {}  # raw name -> the name shown (demangled, cut short)
        self._clock = clock
        self._maps_read_at = -self.MAPS_REREAD_S
        self._reread_s = self.MAPS_REREAD_S
        self.maps_reads = 0
        self._read_maps()  # now, while the process surely lives

    def _read_maps(self) -> None:
        self._maps_read_at = self._clock()
        self.maps_reads += 1
        try:
            maps = [m for m in read_maps(self.pid) if "x" in m.perms]
        except (OSError, ProfError):  # the process exited (NoSuchProcess): the maps read before stay
            return
        self._maps = maps
        self._map_starts = [m.start for m in maps]

    def _mapping(self, addr: int) -> MapsEntry | None:
        i = bisect.bisect_right(self._map_starts, addr) - 1
        if i >= 0 and addr < self._maps[i].end:
            return self._maps[i]
        return None

    def frames(self, stack: tuple[int, ...], *, kernel: bool = False) -> list[str]:
        """Names of a stack's frames, root first (the folded order), "[kernel]" last for a
        sample taken in the kernel."""
        return self.frames_many([(stack, kernel)])[0]

    def frames_many(self, stacks: Sequence[tuple[tuple[int, ...], bool]]) -> list[list[str]]:
        """frames() of each (stack, kernel), the names new to them demangled in one run."""
        raw = [[self._raw_name(a) for a in reversed(stack)] for stack, _ in stacks]
        self._learn({n for frames in raw for n in frames})
        shown = self._shown
        out = []
        for frames, (_, kernel) in zip(raw, stacks, strict=True):
            named = [shown.get(n, n) for n in frames]
            if kernel:
                named.append(KERNEL_FRAME)
            out.append(named or [UNKNOWN_FRAME])
        return out

    def name(self, addr: int) -> str:
        """The name shown for `addr`: its function's, demangled; else FILE+0xOFFSET or [anon]."""
        raw = self._raw_name(addr)
        self._learn((raw,))
        return self._shown.get(raw, raw)

    def _learn(self, raw: Iterable[str]) -> None:
        """The names shown for raw names not seen before: demangled (together), cut short."""
        new = [n for n in raw if n not in self._shown]
        if not new:
            return
        if len(self._shown) + len(new) > self.MAX_NAMES:
            self._shown.clear()
        demangled = demangle(new)  # (the mangled ones; the others stay as they are)
        for n in new:
            self._shown[n] = demangled.get(n, n)[:MAX_NAME]

    def _raw_name(self, addr: int) -> str:
        got = self._names.get(addr)
        if got is not None:
            return got
        m = self._mapping(addr)
        read_now = False
        if m is None and self._clock() - self._maps_read_at >= self._reread_s:
            self._read_maps()
            m = self._mapping(addr)
            read_now = True
            self._reread_s = (
                self.MAPS_REREAD_S if m is not None else min(2 * self._reread_s, self.MAPS_REREAD_MAX_S)
            )
        got = self._name_in(addr, m)
        if m is not None or read_now:  # (outside the maps read a while ago: asked again later)
            if len(self._names) >= self.MAX_NAMES:
                self._names.clear()
            self._names[addr] = got
        return got

    def _name_in(self, addr: int, m: MapsEntry | None) -> str:
        if m is None:
            return UNKNOWN_FRAME
        if not m.file_backed or m.deleted:
            return ANON_FRAME if not m.path else f"[{m.path.strip('[]')}]"
        key = (m.path, m.dev, m.inode)
        fs = self._files.get(key)
        if fs is None:
            fs = self._files[key] = load_file_symbols(self.pid, m)
        base = Path(m.path).name
        file_offset = addr - m.start + m.offset
        vaddr = fs.vaddr(file_offset)
        name = fs.name(vaddr) if vaddr is not None else None
        return name if name is not None else f"{base}+{file_offset:#x}"

    def files_meta(self) -> list[dict[str, str]]:
        """Which files were read for names, and where their names come from (meta.json)."""
        return [
            {"path": fs.path, "symbols": fs.source, **({"why": fs.why} if fs.why else {})}
            for fs in self._files.values()
        ]
