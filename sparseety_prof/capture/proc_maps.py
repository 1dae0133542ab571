"""The one reader of /proc/PID/maps: which files and memory a process maps, as typed entries.

The target is a process someone else controls, so the read is bounded like any untrusted file
(capture/untrusted_files.py): at most MAPS_MAX_BYTES (a process can make its maps as long as its
mapping count and path lengths allow), the name opened without following a symlink as its last
component, and failures said as the project's errors: NoSuchProcess when the process is gone,
MissingPrivileges when it may not be read, NotAnEngine when its maps are beyond the bound.

Standard library only, plus errors.py: gpu/shm_ring.py loads this file by path where the package
is absent (scripts/gpu_check.py loads errors.py by name before it).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

try:
    # relative on purpose: loaded by file path, an absolute import would pull in the package
    from ..errors import MissingPrivileges, NoSuchProcess, NotAnEngine
except ImportError:  # loaded by file path (scripts/gpu_check.py): errors.py was loaded by its name
    from errors import MissingPrivileges, NoSuchProcess, NotAnEngine  # type: ignore[no-redef]

__all__ = ["MAPS_MAX_BYTES", "MapsEntry", "mapped_files", "parse_maps", "read_maps", "read_maps_text"]

#: the most of a process's maps read: far above what an engine maps (its libraries, model and
#: buffers), far below the largest maps a process can make
MAPS_MAX_BYTES = 64 << 20
_CHUNK = 1 << 20
_DELETED = " (deleted)"


@dataclass(frozen=True)
class MapsEntry:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    perms: str  # "r-xp"
    offset: int  # into the mapped file
    dev: int  # os.makedev(major, minor) of the mapped file; 0 for anonymous memory
    inode: int  # 0 for anonymous memory
    path: str  # "/usr/lib/x.so", "/x (deleted)", "[heap]", "[anon:name]", or "" (anonymous)

    @property
    def file_backed(self) -> bool:
        """A file's mapping (a path), deleted or not; not anonymous, [heap], [stack] or [vdso]."""
        return self.path.startswith("/")

    @property
    def deleted(self) -> bool:
        """The file was unlinked since it was mapped: its name may now be another file's."""
        return self.path.endswith(_DELETED)

    @property
    def map_files_name(self) -> str:
        """Its name under /proc/PID/map_files/ (a link the kernel follows to the very file mapped)."""
        return f"{self.start:x}-{self.end:x}"


def parse_maps(text: str) -> list[MapsEntry]:
    """The entries of a /proc/PID/maps text, in its order. A line that does not read as one (never
    written by the kernel) is left out rather than guessed at."""
    out = []
    for line in text.splitlines():
        entry = _parse_line(line)
        if entry is not None:
            out.append(entry)
    return out


def _parse_line(line: str) -> MapsEntry | None:
    # "start-end perms offset major:minor inode [path]"; the path may hold spaces (split 5 times)
    parts = line.split(None, 5)
    if len(parts) < 5:
        return None
    addresses, perms, offset, dev, inode = parts[:5]
    start, sep, end = addresses.partition("-")
    major, sep2, minor = dev.partition(":")
    if not sep or not sep2 or len(perms) != 4:
        return None
    try:
        return MapsEntry(
            start=int(start, 16),
            end=int(end, 16),
            perms=perms,
            offset=int(offset, 16),
            dev=os.makedev(int(major, 16), int(minor, 16)),
            inode=int(inode),
            path=parts[5] if len(parts) == 6 else "",
        )
    except (ValueError, OverflowError):
        return None


def read_maps_text(pid: int, proc: Path = Path("/proc"), max_bytes: int = MAPS_MAX_BYTES) -> str:
    """The text of /proc/PID/maps, at most `max_bytes` of it (NotAnEngine beyond)."""
    name = proc / str(pid) / "maps"
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise _read_error(pid, name, e) from None
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := os.read(fd, _CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise NotAnEngine(
                    f"{name} is longer than the {max_bytes} bytes read at most: not a process the "
                    "profiler reads (an engine maps far less)"
                )
            chunks.append(chunk)
    except OSError as e:  # ESRCH: it exited while read
        raise _read_error(pid, name, e) from None
    finally:
        os.close(fd)
    # the kernel writes paths as bytes; an undecodable one stays a distinct string
    return b"".join(chunks).decode(errors="surrogateescape")


def _read_error(pid: int, name: Path, e: OSError) -> NoSuchProcess | MissingPrivileges:
    if e.errno in (errno.ENOENT, errno.ESRCH):
        return NoSuchProcess(f"no process with PID {pid} (did it exit?)")
    return MissingPrivileges(
        f"cannot read {name}: {e.strerror}; run as root (sudo), or give the recorder CAP_SYS_PTRACE "
        "for a process of another user (docs/privileges.md)"
    )


def read_maps(pid: int, proc: Path = Path("/proc")) -> list[MapsEntry]:
    """The mappings of `pid` now, in address order."""
    return parse_maps(read_maps_text(pid, proc))


def mapped_files(pid: int, proc: Path = Path("/proc")) -> list[MapsEntry]:
    """The file-backed mappings of `pid`, once per (path, device, inode), deleted files left out."""
    out: dict[tuple[str, int, int], MapsEntry] = {}
    for m in read_maps(pid, proc):
        if m.file_backed and not m.deleted:
            out.setdefault((m.path, m.dev, m.inode), m)
    return list(out.values())
