"""Names for the sampled addresses of the engine (capture/cpu_sampler.py): address -> the mapping
of /proc/PID/maps that holds it -> the ELF file's virtual address -> the function symbol around
it, demangled.

The files are the target's, so hostile (capture/untrusted_files.py): each is opened through the
process's own mapping (/proc/PID/map_files/START-END, which the kernel follows to the very file
mapped, never through a name), is read by binutils' nm from /usr/bin through that descriptor
(a regular file only), and only once per file.

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
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sparseety_prof.capture.elf import load_segments
from sparseety_prof.capture.proc_maps import MapsEntry, read_maps
from sparseety_prof.capture.untrusted_files import RefusedFile, open_untrusted, trusted_tool
from sparseety_prof.errors import ProfError

NM_TIMEOUT_S = 120
MAX_NAME = 400  # characters of a demangled name kept (template names run to thousands)
KERNEL_FRAME = "[kernel]"
ANON_FRAME = "[anon]"
UNKNOWN_FRAME = "[unknown]"
#: where Debian's -dbg/-dbgsym packages put separate debug files, by GNU build id (root's, not
#: the target's: the host's system directory)
DEBUG_ROOT = Path("/usr/lib/debug/.build-id")
NOTE_MAX = 1 << 16  # bytes of a PT_NOTE segment read
#: nm's type letters of code symbols (text, weak, indirect)
_CODE = frozenset("TtWwi")

#: what each file's names come from, in meta.json
SYMBOLS_FULL = "symtab"  # .symtab (with .dynsym): every function
SYMBOLS_DEBUG_FILE = "debug file"  # stripped, but the host has its separate debug symbols (below)
SYMBOLS_DYNAMIC = "dynamic only"  # stripped: exported functions only
SYMBOLS_NONE = "none"  # no symbol at all, or the file could not be read (why says)


@dataclass
class FileSymbols:
    """One mapped ELF file's function symbols, sorted by address, and how its virtual addresses
    sit in the file (PT_LOAD segments)."""

    path: str
    source: str  # SYMBOLS_*
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (vaddr, offset, size)
    why: str = ""  # why it has no symbols, when it has none

    def vaddr(self, file_offset: int) -> int | None:
        for vaddr, off, size in self.segments:
            if off <= file_offset < off + size:
                return vaddr + file_offset - off
        return None

    def name(self, vaddr: int) -> str | None:
        i = bisect.bisect_right(self.starts, vaddr) - 1
        if i < 0:
            return None
        # a symbol with a size covers [start, end); without one (end == start) the nearest below
        if self.ends[i] > self.starts[i] and vaddr >= self.ends[i]:
            return None
        return self.names[i]


def _nm(fd: int, *extra: str) -> tuple[str, str]:
    nm = trusted_tool("nm")
    done = subprocess.run(
        [nm, *extra, "--defined-only", "-S", "-C", f"/dev/fd/{fd}"],
        capture_output=True,
        text=True,
        errors="replace",
        pass_fds=(fd,),
        timeout=NM_TIMEOUT_S,
    )
    return done.stdout, done.stderr


def _rank(size: int, kind: str, name: str) -> tuple[int, int, int, int, int]:
    """Of several names at one address (aliases: memcpy's and memmove's code is one), the one
    perf shows (tools/perf/util/symbol.c choose_best_symbol): one with a size, not weak, global,
    with fewer leading underscores, the longest."""
    underscores = len(name) - len(name.lstrip("_"))
    return (size > 0, kind not in "Ww", kind.isupper(), -min(underscores, 2), len(name))


def _parse_nm(text: str, into: dict[int, tuple[int, str, tuple[int, int, int, int, int]]]) -> None:
    """nm -S -C lines: "ADDR SIZE TYPE NAME" or "ADDR TYPE NAME" (no size); names may hold spaces."""
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and len(parts[1]) == 1:  # no size
            addr, size, kind, name = parts[0], "0", parts[1], " ".join(parts[2:])
        elif len(parts) == 4 and len(parts[2]) == 1:
            addr, size, kind, name = parts
        else:
            continue
        if kind not in _CODE:
            continue
        try:
            a, n = int(addr, 16), int(size, 16)
        except ValueError:
            continue
        name = (
            name.split("@", 1)[0] if "@" in name and "(" not in name else name
        )  # version: memmove@@GLIBC_2.2.5
        rank = _rank(n, kind, name)
        if a and (a not in into or into[a][2] < rank):
            into[a] = (n, name[:MAX_NAME], rank)


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


def _debug_symbols(fd: int, into: dict[int, tuple[int, str, tuple[int, int, int, int, int]]]) -> bool:
    """The .symtab of the host's separate debug file of the file at `fd`, if any, into `into`."""
    bid = build_id(fd)
    if not bid or len(bid) < 4:
        return False
    path = DEBUG_ROOT / bid[:2] / f"{bid[2:]}.debug"
    try:
        dfd, _ = open_untrusted(path)
    except OSError:
        return False
    try:
        text, _ = _nm(dfd)
    except (subprocess.TimeoutExpired, OSError):
        return False
    finally:
        os.close(dfd)
    before = len(into)
    _parse_nm(text, into)
    return len(into) > before


def load_file_symbols(pid: int, m: MapsEntry) -> FileSymbols:
    """The symbols of the file of mapping `m` of process `pid`, read through the mapping itself."""
    link = f"/proc/{pid}/map_files/{m.map_files_name}"
    try:
        # the kernel follows a map_files link to the very file mapped (no name is looked up);
        # O_NOFOLLOW does not apply to these links, and a FIFO or device is still refused
        fd, _ = open_untrusted(link)
    except (RefusedFile, OSError) as e:
        return FileSymbols(m.path, SYMBOLS_NONE, why=str(e))
    syms: dict[int, tuple[int, str, tuple[int, int, int, int, int]]] = {}
    try:
        full, err = _nm(fd)
        _parse_nm(full, syms)
        has_symtab = bool(syms)
        from_debug = not has_symtab and _debug_symbols(fd, syms)
        dyn, _ = _nm(fd, "-D")
        _parse_nm(dyn, syms)
        segments = load_segments(Path(f"/dev/fd/{fd}"))
    except (subprocess.TimeoutExpired, OSError, ValueError, struct.error) as e:
        return FileSymbols(m.path, SYMBOLS_NONE, why=str(e))
    finally:
        os.close(fd)
    source = (
        SYMBOLS_FULL
        if has_symtab
        else SYMBOLS_DEBUG_FILE
        if from_debug
        else SYMBOLS_DYNAMIC
        if syms
        else SYMBOLS_NONE
    )
    fs = FileSymbols(m.path, source, segments=segments, why="" if syms else (err.strip() or "no symbols"))
    for a in sorted(syms):
        n, name, _ = syms[a]
        fs.starts.append(a)
        fs.ends.append(a + n)
        fs.names.append(name)
    return fs


class Symboliser:
    """Frame names for one process's addresses; its maps re-read when an address lies outside
    every mapping known (a library loaded since), at most every MAPS_REREAD_S: a stack walked
    through code built without frame pointers ends in addresses that lie in no mapping at all, a
    new one at nearly every sample, and reading the maps for each would cost more than the
    sampling itself. `clock` is time.monotonic (tests replace it)."""

    #: the shortest time between two reads of the process's maps
    MAPS_REREAD_S = 1.0
    #: names kept per address (addresses of stack walks gone astray are many): beyond it the
    #: cache starts over
    MAX_NAMES = 1 << 18

    def __init__(self, pid: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.pid = pid
        self._maps: list[MapsEntry] = []
        self._map_starts: list[int] = []
        self._files: dict[tuple[str, int, int], FileSymbols] = {}
        self._names: dict[int, str] = {}
        self._clock = clock
        self._maps_read_at = -self.MAPS_REREAD_S
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
        out = [self.name(a) for a in reversed(stack)]
        if kernel:
            out.append(KERNEL_FRAME)
        return out or [UNKNOWN_FRAME]

    def name(self, addr: int) -> str:
        got = self._names.get(addr)
        if got is not None:
            return got
        m = self._mapping(addr)
        read_now = False
        if m is None and self._clock() - self._maps_read_at >= self.MAPS_REREAD_S:
            self._read_maps()
            m = self._mapping(addr)
            read_now = True
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
