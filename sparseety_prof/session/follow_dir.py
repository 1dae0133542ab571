"""The follower's output directory, `-o DIR` of `--follow`: made by the follower, or reopened by
a follower that a service manager restarted, which adds its runs beside the earlier ones.

A directory is taken back only when it is recognisably a follower's own: a real directory (not a
link) owned by root, us or the sudo user and not writable by every user, holding a follow.json
that is a regular file of mode 0600 owned by us (or the sudo user, who gets the files under
sudo), that follows the same processes, and beside which there is nothing but its runs' folders
(n-PID) and the hidden names of a rename in progress. Any other non-empty directory is refused as
before: a follower never writes over what it did not make."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from sparseety_prof.errors import UsageError
from sparseety_prof.store.output_dir import FILE_MODE, OutputDir, check_output_path

__all__ = ["FOLLOW_FILE", "check_follow_output", "open_follow_dir"]

FOLLOW_FILE = "follow.json"
#: a run's directory, as the follower names it (n-PID): one made but not listed yet when the
#: follower was killed is its own too
RUN_DIR = re.compile(r"[1-9][0-9]*-[1-9][0-9]*")
#: the most of follow.json read back (a follow of years lists a few hundred thousand runs at most)
MAX_INDEX_BYTES = 64 << 20


def check_follow_output(path: Path, follow: dict[str, Any], owner: tuple[int, int] | None) -> None:
    """Refuse, before anything is attached, an -o that `open_follow_dir` would refuse."""
    if _holds_index(path):
        open_follow_dir(path, follow, owner)[0].close()
    else:
        check_output_path(path, FOLLOW_FILE, owner)


def open_follow_dir(
    path: Path, follow: dict[str, Any], owner: tuple[int, int] | None
) -> tuple[OutputDir, dict[str, Any] | None]:
    """The open output directory, and the follow.json an earlier follower left there (None for a
    new or empty directory). `follow`: what this follower follows (follow.json "follow")."""
    p = Path(path).absolute()
    if not _holds_index(p):
        return OutputDir.create(p, FOLLOW_FILE, owner), None
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"cannot open {p}: {e.strerror}: choose a new or empty output directory") from None
    try:
        doc = _earlier_index(p, fd, follow, owner)
        return OutputDir(fd, p, owner), doc
    except BaseException:
        os.close(fd)
        raise


def _holds_index(p: Path) -> bool:
    try:
        return stat.S_ISDIR(p.lstat().st_mode) and FOLLOW_FILE in os.listdir(p)
    except OSError:
        return False


def _earlier_index(p: Path, fd: int, follow: dict[str, Any], owner: tuple[int, int] | None) -> dict[str, Any]:
    mine = {os.geteuid()} | ({owner[0]} if owner else set())
    st = os.fstat(fd)
    if st.st_uid not in mine | {0} or st.st_mode & stat.S_IWOTH:
        raise UsageError(
            f"{p} holds a follow.json but belongs to user id {st.st_uid} or is writable by every "
            "user: it is not this follower's; choose a new or empty output directory"
        )
    try:
        ifd = os.open(FOLLOW_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError as e:
        raise UsageError(
            f"{p / FOLLOW_FILE} cannot be read: {e.strerror}: not a follower's directory"
        ) from None
    with os.fdopen(ifd, "rb") as f:
        ist = os.fstat(f.fileno())
        if not stat.S_ISREG(ist.st_mode) or stat.S_IMODE(ist.st_mode) != FILE_MODE or ist.st_uid not in mine:
            raise UsageError(
                f"{p / FOLLOW_FILE} is not a follower's own (a regular file of mode 0600 owned by "
                f"user id {sorted(mine)}): choose a new or empty output directory"
            )
        raw = f.read(MAX_INDEX_BYTES + 1)
    try:
        doc = json.loads(raw) if len(raw) <= MAX_INDEX_BYTES else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("recordings"), list):
        raise UsageError(f"{p / FOLLOW_FILE} is not a follow index: choose a new or empty output directory")
    if doc.get("follow") != follow:
        raise UsageError(
            f"{p} follows {doc.get('follow')!r}, not {follow!r}: give this follow its own output directory"
        )
    listed = {r.get("dir") for r in doc["recordings"] if isinstance(r, dict)}
    strangers = sorted(
        n
        for n in os.listdir(fd)
        if n != FOLLOW_FILE and n not in listed and n[0] != "." and not RUN_DIR.fullmatch(n)
    )
    if strangers:
        raise UsageError(
            f"{p} holds {strangers[0]!r}, which its follow.json does not list: not only a follower's "
            "recordings are there; choose a new or empty output directory"
        )
    return doc
