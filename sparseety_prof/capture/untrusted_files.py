"""Opening, as root, files that someone else controls: the profiled process's model and
libraries, its CUPTI ring in world-writable /dev/shm, anything a local user could plant or swap.

The rules, applied by every such read:

- never block: opened with O_NONBLOCK (a FIFO opens at once instead of waiting for a writer),
  and only regular files are accepted (no FIFOs, sockets or devices such as /dev/zero, whose
  reads never end), checked with fstat on the opened descriptor, not on the name;
- no symlinks where the name is canonical (paths read from /proc/PID/maps or /proc/PID/fd):
  O_NOFOLLOW, so a name swapped for a link to another file is refused;
- identity: where the target's own view of the file is known (device and inode from
  /proc/PID/maps), the opened file must be that very file, whatever its name says;
- pinned: a file read several times over a recording (the model: its header at attach, its hash
  and weights later) is opened once, from the process's own mapping or descriptor where it has
  one, and read again only through that opening (PinnedFile): a name swapped in the meantime
  does not make root read another file;
- ownership where it matters: a file that proves something by its owner (the CUPTI ring) must
  belong to the target's user or root, and be writable by nobody else;
- bounded: sizes are checked before anything is allocated or read, reads stop at the size fstat
  gave;
- the target's own files: a process in another mount namespace (a container) sees other files
  under the same names, so its paths are resolved through /proc/PID/root.

Standard library only: gpu/shm_ring.py loads this file by path where the package is absent.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection
from pathlib import Path

__all__ = [
    "TRUSTED_TOOL_DIRS",
    "PinnedFile",
    "RefusedFile",
    "file_kind",
    "in_foreign_mount_ns",
    "open_source",
    "open_untrusted",
    "process_uids",
    "read_prefix",
    "target_path",
    "trusted_tool",
]

#: where the tools run on target files as root (nm, c++filt) are taken from; never from PATH
TRUSTED_TOOL_DIRS = ("/usr/bin", "/bin")


class RefusedFile(OSError):
    """The file is not one we read: not a regular file, not the expected one, wrong owner, too big."""

    def __init__(self, path: str | os.PathLike[str], why: str) -> None:
        super().__init__(errno.EPERM, why, str(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def file_kind(mode: int) -> str:
    """What a file of this st_mode is, in words ("a FIFO"), for a refusal's message."""
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_untrusted(
    path: str | os.PathLike[str],
    *,
    write: bool = False,
    follow: bool = True,
    identity: tuple[int, int] | None = None,
    owners: Collection[int] | None = None,
    private: bool = False,
    max_size: int | None = None,
) -> tuple[int, os.stat_result]:
    """Open a regular file that someone else controls without blocking; return (fd, fstat).

    `follow=False`: refuse a symlink as the last component (for canonical names from /proc).
    `identity`: the (st_dev, st_ino) the file must have. `owners`: the uids that may own it (root
    always may). `private`: refuse a file that group or others may write. `max_size`: refuse a
    larger file. Raises RefusedFile (an OSError) or the OSError of the open itself."""
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise RefusedFile(path, "is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFile(path, f"is {file_kind(st.st_mode)}, not a regular file")
        if identity is not None and (st.st_dev, st.st_ino) != identity:
            raise RefusedFile(path, "is not the file the process has mapped (replaced since?)")
        if owners is not None and st.st_uid != 0 and st.st_uid not in owners:
            raise RefusedFile(path, f"is owned by uid {st.st_uid}, not by the process's user or root")
        if private and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise RefusedFile(path, f"may be written by other users (mode {stat.S_IMODE(st.st_mode):04o})")
        if max_size is not None and st.st_size > max_size:
            raise RefusedFile(path, f"is {st.st_size} bytes, more than the {max_size} accepted")
        return fd, st
    except BaseException:
        os.close(fd)
        raise


class PinnedFile:
    """One file, opened once and read again only through that opening, never through its name.

    `path` is the name shown in messages and metadata; `source` is what was opened: the name
    itself, or a link of /proc that leads to the very file a process has mapped or open
    (/proc/PID/map_files/START-END, /proc/PID/fd/N), which no rename can redirect. Each reader
    gets a descriptor of its own (`reopen`: its own file offset) of that same file.
    """

    def __init__(self, path: str | os.PathLike[str], *, source: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path)
        # /proc links are followed by the kernel to the file itself (never through a name); a
        # name given by the operator is theirs to choose, symlink or not
        self._fd, self.stat = open_untrusted(source if source is not None else path)
        self.identity = (self.stat.st_dev, self.stat.st_ino)

    @property
    def size(self) -> int:
        return self.stat.st_size

    def reopen(self) -> tuple[int, os.stat_result]:
        """A new descriptor (fd, fstat) of the pinned file, with its own offset."""
        if self._fd < 0:
            raise ValueError(f"{self.path}: pinned file already closed")
        return open_untrusted(f"/proc/self/fd/{self._fd}", identity=self.identity)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> PinnedFile:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"PinnedFile({str(self.path)!r}, dev={self.identity[0]}, ino={self.identity[1]})"


def open_source(src: str | os.PathLike[str] | PinnedFile) -> tuple[int, os.stat_result]:
    """(fd, fstat) of a file read as untrusted: a pinned one through its opening, a name otherwise."""
    return src.reopen() if isinstance(src, PinnedFile) else open_untrusted(src)


def read_prefix(path: str | os.PathLike[str], n: int, *, follow: bool = True) -> bytes:
    """At most the first `n` bytes of a regular file (never more, whatever the file is)."""
    fd, st = open_untrusted(path, follow=follow)
    try:
        return os.pread(fd, min(n, st.st_size), 0)
    finally:
        os.close(fd)


def in_foreign_mount_ns(pid: int, proc: Path = Path("/proc")) -> bool:
    """True when `pid` runs in another mount namespace (a container): its paths name other files."""
    try:
        return os.readlink(proc / str(pid) / "ns" / "mnt") != os.readlink(proc / "self" / "ns" / "mnt")
    except OSError:
        return False


def target_path(pid: int, path: str | os.PathLike[str], proc: Path = Path("/proc")) -> Path:
    """`path` as the process `pid` sees it, reachable from here: through /proc/PID/root when the
    process is in another mount namespace, `path` itself otherwise (the same file either way)."""
    p = Path(path)
    if not p.is_absolute() or not in_foreign_mount_ns(pid, proc):
        return p
    return proc / str(pid) / "root" / p.relative_to("/")


def process_uids(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """The real, effective, saved and filesystem uids of `pid` (from /proc/PID/status)."""
    for line in (proc / str(pid) / "status").read_text().splitlines():
        if line.startswith("Uid:"):
            return {int(u) for u in line.split()[1:]}
    raise OSError(errno.ENOENT, "no Uid line", str(proc / str(pid) / "status"))


def trusted_tool(name: str) -> str:
    """The absolute path of a system tool run on target files as root (nm, c++filt): from the
    system directories only, owned by root and writable by nobody else; never through PATH."""
    for d in TRUSTED_TOOL_DIRS:
        p = os.path.join(d, name)
        try:
            st = os.stat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return p
    raise FileNotFoundError(
        errno.ENOENT, f"{name} not found in {' or '.join(TRUSTED_TOOL_DIRS)} (install binutils)", name
    )
