"""The folder of a dataset (`collect`), opened once and written only relative to that open folder.

Like a recording's folder (store/output_dir.py), but a dataset grows: DEST may already hold one
(a manifest.json and table folders), and partition folders are opened when they exist. Every
folder is opened with O_NOFOLLOW, so a symlink planted under a partition's name makes the write
fail instead of sending it elsewhere; folders made here are 0700 and files 0600, handed to the
sudo user. A lock file serialises two collects into one dataset (the manifest is read, extended
and rewritten under it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from sparseety_prof.errors import UsageError
from sparseety_prof.store.output_dir import DIR_MODE, FILE_MODE, OutputDir

#: the manifest lists every recording collected, about a KiB each
MAX_READ_BYTES = 256 << 20

__all__ = ["DatasetDir", "StagedFile", "check_dest"]

LOCK_FILE = ".collect.lock"
_HASH_CHUNK = 1 << 20


class StagedFile:
    """A file written in full under a hidden name in its folder, put in place by `publish`."""

    def __init__(self, folder_fd: int, tmp: str, name: str, rel: PurePosixPath, sha256: str, size: int):
        self.folder_fd, self.tmp, self.name, self.rel = folder_fd, tmp, name, rel
        self.sha256, self.size = sha256, size

    def publish(self) -> None:
        os.replace(self.tmp, self.name, src_dir_fd=self.folder_fd, dst_dir_fd=self.folder_fd)
        os.fsync(self.folder_fd)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.tmp, dir_fd=self.folder_fd)


class DatasetDir:
    """DEST, open. Use as a context manager: it holds the collect lock and closes every folder."""

    def __init__(self, path: Path, manifest_name: str, owner: tuple[int, int] | None) -> None:
        self.path = Path(path).absolute()
        self.owner = owner
        self._root = _open_dest(self.path, manifest_name, owner)
        self._folders: dict[PurePosixPath, int] = {PurePosixPath("."): self._root.fd}
        self._lock = -1

    def __enter__(self) -> DatasetDir:
        self._lock = os.open(
            LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=self._root.fd
        )
        os.fchmod(self._lock, FILE_MODE)
        if self.owner is not None:
            os.fchown(self._lock, *self.owner)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock >= 0:
            os.close(self._lock)  # releases the lock
            self._lock = -1
        for rel, fd in self._folders.items():
            if rel != PurePosixPath("."):
                os.close(fd)
        self._folders.clear()
        self._root.close()

    def read(self, name: str, max_bytes: int = MAX_READ_BYTES) -> bytes | None:
        """The file `name` of DEST, or None when absent: never through a symlink, never waiting
        on a FIFO, a regular file of at most `max_bytes` (a dataset may come from elsewhere)."""
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self._root.fd
            )
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UsageError(f"{self.path / name} cannot be read: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(
                    f"{self.path / name} is not a plain file: not a dataset this command can extend"
                )
            if st.st_size > max_bytes:
                raise UsageError(
                    f"{self.path / name} is {st.st_size} bytes, more than the {max_bytes} accepted"
                )
            return f.read(st.st_size)

    def write_atomic(self, name: str, write: Callable[[BinaryIO], object]) -> None:
        self._root.write_atomic(name, write)

    def folder(self, rel: PurePosixPath) -> int:
        """The open folder `rel` (made, 0700, where missing), each part opened without following
        a symlink."""
        if rel in self._folders:
            return self._folders[rel]
        parent = self.folder(rel.parent)
        name = rel.name
        try:
            os.mkdir(name, DIR_MODE, dir_fd=parent)
            made = True
        except FileExistsError:
            made = False
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        if made and os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, DIR_MODE)
            if self.owner is not None:
                os.fchown(fd, *self.owner)
        self._folders[rel] = fd
        return fd

    def stage(self, rel: PurePosixPath, write: Callable[[BinaryIO], object]) -> StagedFile:
        """Write the file `rel` under a hidden name in its folder and return it unpublished, with
        the sha256 and size of what is on disk (read back, not what was meant to be written)."""
        folder = self.folder(rel.parent)
        tmp = f".{rel.name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(
            tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=folder
        )
        try:
            os.fchmod(fd, FILE_MODE)
            if self.owner is not None:
                os.fchown(fd, *self.owner)
            with os.fdopen(fd, "w+b", closefd=False) as f:
                write(f)
                f.flush()
                os.fsync(fd)
                f.seek(0)
                digest, size = _sha256(f)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=folder)
            raise
        finally:
            os.close(fd)
        return StagedFile(folder, tmp, rel.name, rel, digest, size)

    def remove_leftovers(self, rel: PurePosixPath) -> None:
        """Remove the hidden temporary files a killed collect left in the folder `rel`."""
        try:
            fd = self.folder(rel)
        except OSError:
            return
        for name in os.listdir(fd):
            if name.startswith(".") and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)


def _sha256(f: BinaryIO) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    while chunk := f.read(_HASH_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def check_dest(p: Path, manifest_name: str, owner: tuple[int, int] | None) -> None:
    """Refuse (UsageError), before any work, a DEST that `DatasetDir` would refuse. Creates nothing."""
    try:
        st = p.lstat()
    except FileNotFoundError:
        return
    fd = _open_existing(p, st)
    try:
        _check_existing(p, fd, manifest_name, owner)
    finally:
        os.close(fd)


def _open_dest(p: Path, manifest_name: str, owner: tuple[int, int] | None) -> OutputDir:
    """DEST: created when missing (with its parents, as a recording's folder is), or an existing
    real folder that is empty or already a dataset, owned by root, us or the sudo user and not
    writable by every user."""
    try:
        st = p.lstat()
    except FileNotFoundError:
        return OutputDir.create(p, manifest_name, owner)
    fd = _open_existing(p, st)
    try:
        _check_existing(p, fd, manifest_name, owner)
    except BaseException:
        os.close(fd)
        raise
    return OutputDir(fd, p, owner)


def _open_existing(p: Path, st: os.stat_result) -> int:
    if stat.S_ISLNK(st.st_mode):
        raise UsageError(f"{p} is a symbolic link: give the dataset's real folder")
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{p} exists and is not a folder: give a new folder or an existing dataset")
    try:
        return os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"cannot open {p}: {e.strerror}") from None


def _check_existing(p: Path, fd: int, manifest_name: str, owner: tuple[int, int] | None) -> None:
    st = os.fstat(fd)
    trusted = {0, os.geteuid()} | ({owner[0]} if owner else set())
    if st.st_uid not in trusted:
        raise UsageError(f"{p} belongs to user id {st.st_uid}, who could replace the dataset's files")
    if st.st_mode & stat.S_IWOTH:
        raise UsageError(f"{p} is writable by every user, who could replace the dataset's files")
    entries = set(os.listdir(fd)) - {LOCK_FILE}
    if entries and manifest_name not in entries:
        raise UsageError(
            f"{p} is not empty and holds no {manifest_name}: it is not a sparseety-prof dataset; "
            "give a new folder or an existing dataset"
        )
