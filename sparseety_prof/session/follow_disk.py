"""`--max-disk` with `--follow`: a bound on all the runs' recordings under -o together.

Each run is an ordinary recording bounded by the Recorder's own --max-disk (its oldest segments
removed first, store/rotation.py). Across runs: before each attach, the oldest closed runs are
removed whole until the earlier runs together take at most half the bound; the new run is given
the rest as its own --max-disk. So the runs together stay within the bound, the newest run always
has at least half of it, and the oldest data goes first."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from typing import Any

from sparseety_prof.store.output_dir import OutputDir
from sparseety_prof.store.recording_writer import MIN_MAX_DISK

__all__ = ["dir_bytes", "make_room"]


def dir_bytes(folder: OutputDir, name: str) -> int:
    """The bytes the files under `name` take on disk (allocated blocks; links never followed)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder.fd)
    except OSError:
        return 0
    total = 0
    try:
        for _root, _dirs, files, rfd in os.fwalk(".", dir_fd=fd):
            for f in files:
                try:
                    st = os.stat(f, dir_fd=rfd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += st.st_blocks * 512
    finally:
        os.close(fd)
    return total


def make_room(
    folder: OutputDir,
    recordings: list[dict[str, Any]],
    max_disk: int,
    log: Callable[[str], None],
) -> int:
    """Remove the oldest closed runs until the kept ones take at most half of `max_disk`; the
    bytes the next run may take (its --max-disk). Removed runs stay listed, marked "removed"."""
    kept = [r for r in recordings if r.get("dir") and not r.get("removed")]
    sizes = {r["dir"]: dir_bytes(folder, r["dir"]) for r in kept}
    used = sum(sizes.values())
    for r in kept:
        if used <= max_disk // 2:
            break
        if r.get("stop_reason") is None and r.get("end_unix_ms") is None and r is kept[-1]:
            break  # (never the one being written: there is none while this runs, but be sure)
        shutil.rmtree(r["dir"], dir_fd=folder.fd)
        used -= sizes[r["dir"]]
        r["removed"] = True
        log(f"sparseety-prof: --max-disk: removed the oldest run {r['dir']} ({sizes[r['dir']] >> 20} MiB)")
    return max(MIN_MAX_DISK, max_disk - used)
