"""The directory a recording is written to, created and used without trusting its path twice.

The recorder runs as root, often under sudo, and `-o` may point into a directory other users can
write to. So the path is resolved once: the recording directory is opened (never through a
symlink) and every name in it (table folders, segments, meta.json) is created relative to that
open descriptor with O_NOFOLLOW | O_EXCL. A symlink or file planted under one of those names is
never followed; it makes the write fail instead. Only directories the recorder created itself get
its mode and owner: an existing, empty `-o` keeps both.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from sparseety_prof.errors import UsageError

__all__ = ["DIR_MODE", "FILE_MODE", "OutputDir", "check_output_path", "sudo_owner"]

DIR_MODE = 0o700
FILE_MODE = 0o600
_CHOOSE = "choose a new or empty output directory"


def sudo_owner() -> tuple[int, int] | None:
    """(uid, gid) of the user who ran ``sudo``, or None when not root or not under sudo."""
    if os.geteuid() != 0:
        return None
    uid, gid = os.environ.get("SUDO_UID"), os.environ.get("SUDO_GID")
    if not uid or not gid:
        return None
    try:
        return int(uid), int(gid)
    except ValueError:
        return None


def check_output_path(path: Path, meta_file: str, owner: tuple[int, int] | None = None) -> None:
    """Refuse, before anything is attached, an output path that `OutputDir.create` would refuse
    (UsageError). Creates nothing; `create` checks again on what it really opens."""
    p = Path(path)
    try:
        st = p.lstat()
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"{p} cannot be examined: {e.strerror}: {_CHOOSE}") from None
    _check_existing(p, st, _entries(p, st), meta_file, owner)


def _entries(p: Path, st: os.stat_result) -> list[str]:
    if not stat.S_ISDIR(st.st_mode):
        return []
    try:
        return os.listdir(p)
    except OSError as e:
        raise UsageError(f"{p} cannot be listed: {e.strerror}: {_CHOOSE}") from None


def _check_existing(
    p: Path, st: os.stat_result, entries: list[str], meta_file: str, owner: tuple[int, int] | None
) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UsageError(
            f"{p} is a symbolic link: give the real directory (a link could be switched to "
            f"another place while root writes through it), or {_CHOOSE}"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{p} exists and is not a directory: choose another output directory")
    if meta_file in entries:
        raise UsageError(
            f"{p} already holds a recording: choose another output directory (or delete that one)"
        )
    if entries:
        raise UsageError(f"{p} is not empty: {_CHOOSE}")
    trusted = {0, os.geteuid()} | ({owner[0]} if owner else set())
    if st.st_uid not in trusted:
        raise UsageError(
            f"{p} belongs to user id {st.st_uid}, who could replace the recording's files: {_CHOOSE}"
        )
    if st.st_mode & stat.S_IWOTH:
        raise UsageError(f"{p} is writable by every user, who could replace the recording's files: {_CHOOSE}")


class OutputDir:
    """An open directory of the recording; every file and folder in it is made through `fd`."""

    def __init__(self, fd: int, path: Path, owner: tuple[int, int] | None) -> None:
        self.fd = fd
        self.path = path
        self.owner = owner

    @classmethod
    def create(cls, path: Path, meta_file: str, owner: tuple[int, int] | None = None) -> OutputDir:
        """Open the recording directory `path`, creating it and any missing parents (0700, handed
        to `owner`). An existing `path` must be an empty real directory (not a symlink) that
        belongs to root, us or `owner` and that not every user can write to (UsageError)."""
        p = Path(path).absolute()
        parent = os.open(p.anchor, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # Parents the operator named are followed like any path; the ones we create are ours.
            for i, name in enumerate(p.parts[1:-1], start=1):
                here = Path(*p.parts[: i + 1])
                try:
                    try:
                        fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent)
                    except FileNotFoundError:
                        fd = _make_dir(parent, name, here, owner, exist_ok=True)
                except OSError as e:
                    raise UsageError(
                        f"cannot open {here}: {e.strerror}: choose another output directory"
                    ) from None
                os.close(parent)
                parent = fd
            return cls(_open_root(parent, p, meta_file, owner), p, owner)
        finally:
            os.close(parent)

    def subdir(self, name: str) -> OutputDir:
        """Create the folder `name` (it must not exist yet: anything found there was planted)."""
        return OutputDir(
            _make_dir(self.fd, name, self.path / name, self.owner, exist_ok=False),
            self.path / name,
            self.owner,
        )

    def write_atomic(self, name: str, write: Callable[[BinaryIO], object]) -> None:
        """Write `name` in full under a fresh hidden name, then rename it into place: a reader never
        sees half a file, and a planted name is never written through."""
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            FILE_MODE,
            dir_fd=self.fd,
        )
        try:
            self._own(fd)
            with os.fdopen(fd, "wb", closefd=False) as f:
                write(f)
                f.flush()
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            os.fsync(self.fd)  # the rename itself survives a power cut
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def create_log(self, name: str) -> int:
        """Create the file `name` (it must not exist: anything found there was planted) for
        appending; its descriptor, which the caller closes."""
        fd = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND | os.O_CLOEXEC,
            FILE_MODE,
            dir_fd=self.fd,
        )
        try:
            self._own(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def sync_file(self, name: str) -> bool:
        """fsync the file `name` of this folder (never through a link); False when it is gone."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def sync(self) -> None:
        """fsync this folder: the names made or removed in it survive a power cut."""
        os.fsync(self.fd)

    def remove_subdir(self, name: str) -> None:
        """Remove the empty folder `name` of this folder (gone already: nothing to do)."""
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(name, dir_fd=self.fd)

    def reserve(self, name: str, size: int) -> bool:
        """Hold `size` bytes of the file system in the hidden file `name`, so that metadata can
        still be written once the disk is full (see `release`). False when there is no room."""
        try:
            fd = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                FILE_MODE,
                dir_fd=self.fd,
            )
        except OSError:
            return False
        try:
            self._own(fd)
            os.posix_fallocate(fd, 0, size)
            return True
        except OSError:
            self.release(name)
            return False
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        """Remove the file `name` of this folder (a name, never a path followed elsewhere)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def release(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _own(self, fd: int) -> None:
        os.fchmod(fd, FILE_MODE)  # os.open's mode is filtered by the umask
        if self.owner is not None:
            os.fchown(fd, *self.owner)


def _open_root(parent: int, p: Path, meta_file: str, owner: tuple[int, int] | None) -> int:
    name = p.name
    try:
        return _make_dir(parent, name, p, owner, exist_ok=False)
    except FileExistsError:
        pass
    except OSError as e:
        raise UsageError(f"cannot create {p}: {e.strerror}: choose another output directory") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError as e:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            raise UsageError(f"cannot open {p}: {e.strerror}: {_CHOOSE}") from None
        _check_existing(p, st, [], meta_file, owner)
        raise UsageError(f"cannot open {p}: {e.strerror}: {_CHOOSE}") from None
    try:
        _check_existing(p, os.fstat(fd), os.listdir(fd), meta_file, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_dir(parent: int, name: str, path: Path, owner: tuple[int, int] | None, *, exist_ok: bool) -> int:
    """mkdir `name` in `parent` and open what was made, without following a symlink; only a
    directory we made ourselves is given our mode and owner. With `exist_ok`, a directory that
    appeared meanwhile is opened as found (another process created a parent at the same time)."""
    try:
        os.mkdir(name, DIR_MODE, dir_fd=parent)
    except FileExistsError:
        if not exist_ok:
            raise
        try:
            return os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent)
        except OSError as e:
            raise UsageError(f"cannot open {path}: {e.strerror}: choose another output directory") from None
    except OSError as e:
        if exist_ok:
            raise UsageError(f"cannot create {path}: {e.strerror}: choose another output directory") from None
        raise
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():  # swapped between mkdir and open: not ours to chmod
            raise FileExistsError(errno.EEXIST, f"{path} was replaced while it was being created")
        os.fchmod(fd, DIR_MODE)
        if owner is not None:
            os.fchown(fd, *owner)
    except BaseException:
        os.close(fd)
        raise
    return fd
