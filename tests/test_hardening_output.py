"""Issue 18, items 2 and 5, performed for real: an output path (`-o`) that others could plant or
swap must never be written through, and a recording must survive SIGKILL and a full disk."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from conftest import ROOT, Engine, Recorder, run_cli

import sparseety_prof
from sparseety_prof.commands.exit_codes import CHECK_FAILED, EXIT_CODES_HELP
from sparseety_prof.errors import RecordingWriteError, UsageError
from sparseety_prof.store import schema
from sparseety_prof.store.output_dir import check_output_path
from sparseety_prof.store.recording import META_FILE
from sparseety_prof.store.recording_writer import RecordingWriter

NOBODY = 65534  # an unused uid/gid: stands for "the user who ran sudo" or for another local user
META = {"pid": 4242, "note": "hardening"}
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def _steps(n: int) -> pl.DataFrame:
    given: dict[str, list[object]] = {"step_id": list(range(n)), "ctx_id": [0] * n, "n_tokens": [1] * n}
    return schema.frame("steps", given, absent=[c for c in schema.TABLES["steps"] if c not in given])


def _state(p: Path) -> tuple[int, int, int, list[str]]:
    st = p.stat()
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, sorted(os.listdir(p))


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A live process to point --pid at (the output check comes before any attach)."""
    p = subprocess.Popen(["sleep", "60"])
    yield p.pid
    p.kill()
    p.wait()


def _record_cli(pid: int, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SUDO_UID": str(NOBODY), "SUDO_GID": str(NOBODY)}
    return run_cli("record", "--pid", str(pid), "-o", str(out), "--duration", "1", env=env)


# ------------------------------------------------------------------ -o that others planted
def test_output_symlink_to_a_root_owned_directory_is_refused(tmp_path: Path, sleeper: int) -> None:
    # an empty root-owned directory (say, early in sudo's secure_path) behind a planted link
    target = tmp_path / "sbin"
    target.mkdir()
    target.chmod(0o755)
    link = tmp_path / "rec"
    link.symlink_to(target)
    before = _state(target)
    r = _record_cli(sleeper, link)
    assert r.returncode == UsageError.exit_code, r.stderr
    assert "is a symbolic link" in r.stderr and "Traceback" not in r.stderr
    assert _state(target) == before == (0o755, 0, 0, [])
    # the writer itself refuses it too (it does not rely on the command's early check)
    with pytest.raises(UsageError, match="symbolic link"):
        RecordingWriter(link, META, owner=(NOBODY, NOBODY))
    assert _state(target) == before


def test_a_non_empty_output_directory_is_refused(tmp_path: Path, sleeper: int) -> None:
    d = tmp_path / "rec"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    before = _state(d)
    r = _record_cli(sleeper, d)
    assert r.returncode == UsageError.exit_code, r.stderr
    assert "is not empty" in r.stderr and "Traceback" not in r.stderr
    assert _state(d) == before
    assert (d / "notes.txt").read_text() == "mine"


@root_only
def test_an_output_directory_another_user_controls_is_refused(tmp_path: Path, sleeper: int) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY + 1, NOBODY + 1)  # neither root, us, nor the sudo user
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    for d, why in ((theirs, "belongs to user id"), (open_to_all, "writable by every user")):
        before = _state(d)
        r = _record_cli(sleeper, d)
        assert r.returncode == UsageError.exit_code and why in r.stderr, r.stderr
        with pytest.raises(UsageError, match=why):
            RecordingWriter(d, META)
        assert _state(d) == before


def test_a_symlink_swapped_in_after_the_check_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    victim.chmod(0o755)
    out = tmp_path / "rec"
    check_output_path(out, META_FILE)  # what `record` checks before attaching: fine, nothing there
    out.symlink_to(victim)  # ... then swapped in while the recorder attaches
    with pytest.raises(UsageError, match="symbolic link"):
        RecordingWriter(out, META, owner=(NOBODY, NOBODY) if os.geteuid() == 0 else None)
    assert _state(victim) == (0o755, os.geteuid(), os.getegid(), [])


def test_a_symlink_planted_as_a_table_folder_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    w = RecordingWriter(tmp_path / "rec", META)
    (tmp_path / "rec" / "steps").symlink_to(victim)  # before the writer makes the folder
    w.append("steps", _steps(3))
    w.flush()  # must not write through the link: the write fails and is recorded instead
    assert os.listdir(victim) == []
    assert w.write_error is not None and "steps" in w.write_error
    failure = w.failure()
    assert isinstance(failure, RecordingWriteError) and "3 rows were not written" in str(failure)
    w.append("steps", _steps(2))  # later rows are counted, not written
    w.close()
    assert os.listdir(victim) == []
    assert (tmp_path / "rec" / "steps").is_symlink()
    rec = sparseety_prof.open(tmp_path / "rec")
    assert not rec.complete
    assert rec.meta["write_error"]["rows_not_written"]["steps"] == 5
    assert "File exists" in rec.meta["write_error"]["reason"]


def test_a_symlink_planted_as_a_segment_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    w = RecordingWriter(tmp_path / "rec", META, segment_rows=3)
    w.append("steps", _steps(3))  # part-000000, and the folder, exist now
    (tmp_path / "rec" / "steps" / "part-000001.parquet").symlink_to(victim)
    w.append("steps", _steps(3))
    w.close()
    assert victim.read_text() == "precious"
    seg = tmp_path / "rec" / "steps" / "part-000001.parquet"
    assert not seg.is_symlink() and stat.S_IMODE(seg.lstat().st_mode) == 0o600
    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.complete and rec.steps().height == 6


@root_only
def test_an_existing_empty_output_keeps_its_mode_and_owner_under_sudo(tmp_path: Path) -> None:
    d = tmp_path / "rec"
    d.mkdir()
    d.chmod(0o750)
    w = RecordingWriter(d, META, owner=(NOBODY, NOBODY), segment_rows=2)
    w.append("steps", _steps(3))
    w.close()
    assert _state(d)[:3] == (0o750, 0, 0)  # not ours: left as it was
    for p in d.rglob("*"):  # ours: private, and the sudo user's
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), p
        assert stat.S_IMODE(st.st_mode) == (0o700 if p.is_dir() else 0o600), p


def test_the_write_error_exit_code_is_its_own_and_documented() -> None:
    code = RecordingWriteError.exit_code
    assert code not in (0, 1, CHECK_FAILED)
    assert f"  {code} the recording could not be written" in EXIT_CODES_HELP
    table = (ROOT / "docs" / "exit-codes.md").read_text()  # the one table of exit codes
    assert f"| {code} | the recording could not be written" in table


# ------------------------------------------------------------------ durability, unit level
def test_an_interrupted_recording_whose_last_segment_is_cut_reads_cleanly(tmp_path: Path) -> None:
    w = RecordingWriter(tmp_path / "rec", META, segment_rows=2)
    w.append("steps", _steps(5))  # part-000000, part-000001 written; one row buffered
    last = tmp_path / "rec" / "steps" / "part-000001.parquet"
    last.write_bytes(last.read_bytes()[:20])  # as a crash on a file system without atomic rename
    del w  # killed: never closed
    rec = sparseety_prof.open(tmp_path / "rec")
    assert not rec.complete
    assert rec.steps()["step_id"].to_list() == [0, 1]
    assert len(rec.damaged) == 1 and "part-000001" in rec.damaged[0]


# ------------------------------------------------------------------ real engine, real recorder
def _all_paths(root: Path) -> list[Path]:
    return [root, *root.rglob("*")]


@pytest.mark.root
@pytest.mark.engine
def test_recording_under_sudo_belongs_to_the_invoking_user(
    llama_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUDO_UID", str(NOBODY))
    monkeypatch.setenv("SUDO_GID", str(NOBODY))
    rec = Recorder(llama_engine.pid, tmp_path / "new" / "rec", "--flush-interval", "0.5")
    llama_engine.generate(["hello the expert router"], max_tokens=40)
    rc, err = rec.stop()
    assert rc == 0, err
    paths = _all_paths(tmp_path / "new")
    assert len(paths) >= 2 + 1 + 3  # new, rec, meta.json, table folders and segments
    for p in paths:
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), p
        assert stat.S_IMODE(st.st_mode) == (0o700 if p.is_dir() else 0o600), p
    assert tmp_path.stat().st_uid == 0  # the existing parent is left as it was


@pytest.mark.root
@pytest.mark.engine
def test_sigkill_during_generation_keeps_every_token_older_than_the_flush_interval(
    llama_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUDO_UID", str(NOBODY))
    monkeypatch.setenv("SUDO_GID", str(NOBODY))
    interval = 2.0
    rec = Recorder(llama_engine.pid, tmp_path / "rec", "--flush-interval", str(interval))
    llama_engine.send(
        {"prompts": ["hello the expert router"], "max_tokens": 900, "temp": 0.0, "token_delay": 0.01}
    )
    time.sleep(4.5)  # > 2 s of tokens
    killed_ns = time.perf_counter_ns()  # CLOCK_MONOTONIC, as the engine's times_ns
    rc, _ = rec.stop(signal.SIGKILL)
    assert rc == -signal.SIGKILL
    truth = llama_engine.read(timeout=300)["results"][0]
    old = sum(t < killed_ns - interval * 1e9 for t in truth["times_ns"])
    assert old >= 100, "the engine should have produced tokens for more than the flush interval"
    r = sparseety_prof.open(tmp_path / "rec")
    assert not r.complete and r.meta["complete"] is False
    got = r.tokens().sort("t_end_ns")["token_id"].to_list()
    assert len(got) >= old, (len(got), old)
    assert got == truth["ids"][: len(got)]
    for p in _all_paths(tmp_path / "rec"):  # leftovers of the kill included
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), p
        assert stat.S_IMODE(st.st_mode) == (0o700 if p.is_dir() else 0o600), p


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@root_only
def test_a_disk_already_full_is_a_one_line_write_error(tiny_tmpfs: Path) -> None:
    with open(tiny_tmpfs / "filler", "wb") as f, pytest.raises(OSError):
        f.write(b"\0" * (1 << 20))
    with pytest.raises(RecordingWriteError, match=r"cannot write .*meta\.json: No space left on device"):
        RecordingWriter(tiny_tmpfs / "rec", META)


@pytest.mark.root
@pytest.mark.engine
def test_a_full_disk_stops_the_recording_honestly_and_leaves_the_engine_running(
    llama_engine: Engine, tiny_tmpfs: Path
) -> None:
    out = tiny_tmpfs / "rec"
    rec = Recorder(llama_engine.pid, out, "--flush-interval", "0.5")
    truth: list[dict] = []
    for _ in range(30):  # generate until the disk is full and the recorder stops on its own
        truth += llama_engine.generate(["hello the expert router", "one two three"], max_tokens=300)
        if rec.proc.poll() is not None:
            break
    rc, err = rec.wait(timeout=60)
    assert rc == RecordingWriteError.exit_code, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, err
    assert errors[0].startswith("sparseety-prof: error: recording stopped: writing ")
    assert "No space left on device" in errors[0]
    meta = json.loads((out / META_FILE).read_text())
    assert meta["complete"] is False
    assert "No space left on device" in meta["write_error"]["reason"]
    assert meta["stop_reason"] == "write error"
    assert meta["losses"]["rows_not_written"] > 0
    assert meta["losses"]["rows_not_written"] == sum(meta["write_error"]["rows_not_written"].values())
    # what was written before the disk filled is readable, and is what the engine generated
    r = sparseety_prof.open(out)
    got = r.tokens().sort("t_end_ns")["token_id"].to_list()
    ids = [t for g in truth for t in g["ids"]]
    assert got == ids[: len(got)]
    assert 0 < len(got) < len(ids)
    assert r.tokens().height == meta["tables"]["tokens"]["rows"]
    # the engine kept running, undisturbed
    assert llama_engine.proc.poll() is None
    again = llama_engine.generate(["one two three"], max_tokens=20)
    assert again[0]["ids"] == truth[1]["ids"][:20]
