"""A single output file (an export), created the way the recorder creates its files.

Exports hold what the recording holds (token text, routing: secrets, see docs/privacy.md), so the
file is owner-only (0600, handed to the sudo user like a recording) and is written under a fresh
hidden name in its folder (O_EXCL | O_NOFOLLOW, through the open folder), then put in place in
one step: a reader never sees half a file, and a symlink planted at the output path is never
written through. An existing path is refused unless `force`; with it, the old entry (a file, or a
symlink itself, never what it points to) is replaced.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from sparseety_prof.errors import UsageError
from sparseety_prof.store.output_dir import FILE_MODE

__all__ = ["check_new_file", "new_file"]


def check_new_file(path: Path, *, force: bool) -> None:
    """Refuse (UsageError), before any work, an output path `new_file` would refuse."""
    try:
        st = Path(path).lstat()
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"{path} cannot be examined: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{path} is a directory: give the path of the file to write")
    if not force:
        raise UsageError(f"{path} already exists: choose another output file, or give --force to replace it")


@contextlib.contextmanager
def new_file(path: Path, *, force: bool, owner: tuple[int, int] | None = None) -> Iterator[BinaryIO]:
    """Yield a binary file that becomes `path` when the block ends without an exception; on an
    exception nothing is left behind. The folder must exist."""
    p = Path(path).absolute()
    check_new_file(p, force=force)
    try:
        folder = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"cannot open the folder {p.parent}: {e.strerror}") from None
    tmp = f".{p.name}.{secrets.token_hex(6)}.tmp"
    fd = -1
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=folder
        )
        os.fchmod(fd, FILE_MODE)  # os.open's mode is filtered by the umask
        if owner is not None:
            os.fchown(fd, *owner)
        with os.fdopen(fd, "wb", closefd=False, buffering=1 << 20) as f:
            yield f
            f.flush()
        os.fsync(fd)
        os.close(fd)
        fd = -1
        _publish(folder, tmp, p, force=force)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise
    finally:
        os.close(folder)


def _publish(folder: int, tmp: str, p: Path, *, force: bool) -> None:
    if force:
        if stat.S_ISDIR(_mode(folder, p.name)):
            raise UsageError(f"{p} is a directory: give the path of the file to write")
        os.replace(tmp, p.name, src_dir_fd=folder, dst_dir_fd=folder)
    else:
        # link() never replaces: a file that appeared at the path meanwhile is refused, not clobbered
        try:
            os.link(tmp, p.name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
        except FileExistsError:
            raise UsageError(
                f"{p} already exists: choose another output file, or give --force to replace it"
            ) from None
        os.unlink(tmp, dir_fd=folder)
    os.fsync(folder)


def _mode(folder: int, name: str) -> int:
    try:
        return os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return 0
