"""capture/proc_maps.py, the one reader of /proc/PID/maps: this process's real maps against what
the kernel says elsewhere, a malformed and an oversized text, and the errors for a process that
is gone or may not be read."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparseety_prof.capture.proc_maps import MapsEntry, mapped_files, parse_maps, read_maps, read_maps_text
from sparseety_prof.errors import MissingPrivileges, NoSuchProcess, NotAnEngine


def test_reads_this_process_as_the_kernel_maps_it(tmp_path: Path) -> None:
    path = tmp_path / "mapped file"  # a space in the name: the path is the rest of the line
    path.write_bytes(b"x" * mmap.PAGESIZE * 2)
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 0):
        maps = read_maps(os.getpid())
        st = path.stat()
        (entry,) = [m for m in maps if m.path == str(path)]
        assert (entry.dev, entry.inode) == (st.st_dev, st.st_ino)
        assert entry.end - entry.start == mmap.PAGESIZE * 2 and entry.offset == 0
        assert entry.perms == "rw-s" and entry.file_backed and not entry.deleted
        # the kernel's own link for that mapping leads to the same file
        link = Path(f"/proc/self/map_files/{entry.map_files_name}")
        assert os.stat(link).st_ino == st.st_ino
        assert entry in mapped_files(os.getpid())
    # every line of the text is one entry, in address order
    text = read_maps_text(os.getpid())
    assert len(parse_maps(text)) == len(text.splitlines())
    starts = [m.start for m in read_maps(os.getpid())]
    assert starts == sorted(starts)
    assert any(m.path == "[stack]" and not m.file_backed for m in read_maps(os.getpid()))


def test_a_deleted_file_is_kept_by_read_maps_and_left_out_of_mapped_files(tmp_path: Path) -> None:
    path = tmp_path / "gone"
    path.write_bytes(b"y" * mmap.PAGESIZE)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        path.unlink()
        (entry,) = [m for m in read_maps(os.getpid()) if m.path == f"{path} (deleted)"]
        assert entry.deleted and entry.file_backed
        assert all(m.path != entry.path for m in mapped_files(os.getpid()))


def test_parses_each_field_and_leaves_out_what_is_no_maps_line() -> None:
    text = (
        "00400000-00452000 r-xp 00001000 08:02 173521      /usr/bin/with two  spaces\n"
        "garbage\n"
        "\n"
        "7fff5000-7fff6000 rw-p 00000000 00:00 0                          [stack]\n"
        "zz-7fff6000 rw-p 00000000 00:00 0\n"  # address not hex
        "1000-2000 rw-p 0 00:00\n"  # too few fields
        "1000-2000 rwxpq 0 00:00 0\n"  # not four permission letters
        "1000-2000 rw-p 0 0000 0\n"  # no major:minor
        "7f00000000-7f00001000 rw-p 00000000 00:00 0 \n"
    )
    assert parse_maps(text) == [
        MapsEntry(0x400000, 0x452000, "r-xp", 0x1000, os.makedev(8, 2), 173521, "/usr/bin/with two  spaces"),
        MapsEntry(0x7FFF5000, 0x7FFF6000, "rw-p", 0, 0, 0, "[stack]"),
        MapsEntry(0x7F00000000, 0x7F00001000, "rw-p", 0, 0, 0, ""),
    ]
    # map_files names have no leading zeros, whatever the maps text has
    assert parse_maps(text)[0].map_files_name == "400000-452000"


def test_a_maps_text_beyond_the_bound_is_refused(tmp_path: Path) -> None:
    # a fake /proc whose maps of PID 1 is longer than the bound (the reader stops past it)
    (tmp_path / "1").mkdir()
    line = "1000-2000 rw-p 00000000 00:00 0 " + "a" * 200 + "\n"
    (tmp_path / "1" / "maps").write_text(line * 100)
    assert len(read_maps(1, tmp_path)) == 100
    with pytest.raises(NotAnEngine, match="longer than the 4096 bytes"):
        read_maps_text(1, tmp_path, max_bytes=4096)


def test_a_symlink_named_maps_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "elsewhere").write_text("1000-2000 rw-p 00000000 00:00 0\n")
    (tmp_path / "1" / "maps").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(MissingPrivileges, match="cannot read"):
        read_maps(1, tmp_path)


def test_a_process_that_is_gone_is_no_such_process() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=60)
    with pytest.raises(NoSuchProcess, match=f"no process with PID {p.pid}"):
        read_maps(p.pid)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_a_process_that_may_not_be_read_is_missing_privileges() -> None:
    # PID 1 (root's init) read by an unprivileged user: the ptrace access check refuses
    code = (
        "import os\n"
        "from sparseety_prof.capture.proc_maps import read_maps\n"
        "from sparseety_prof.errors import MissingPrivileges\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "try:\n    read_maps(1)\nexcept MissingPrivileges as e:\n    print('refused', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert r.stdout.startswith("refused cannot read /proc/1/maps"), r.stderr
