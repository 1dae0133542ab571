"""Issue 60, first half: the journal (store/journal.py) puts each drain's rows in the page cache,
so that a recorder killed outright loses about a drain, and `open()` reads what it holds."""

from __future__ import annotations

import errno
import io
import os
import random
import signal
import stat
import time
import zlib
from pathlib import Path
from typing import Literal

import polars as pl
import pytest
from conftest import Engine, Recorder

import sparseety_prof
from sparseety_prof.session.collector import FlushTimedCollector
from sparseety_prof.session.policy import RecordingPolicy
from sparseety_prof.session.row_outlet import RowOutlet
from sparseety_prof.session.sinks import SinkFanout
from sparseety_prof.session.stage_cpu import StageCpu
from sparseety_prof.store import gathered_codec, ipc_stream, journal, schema
from sparseety_prof.store.buffers import FlushSchedule
from sparseety_prof.store.journal import HEADER, JOURNAL_DIR, MAGIC, MAGIC_GATHERED
from sparseety_prof.store.recording_writer import RecordingWriter

META = {"pid": 4242, "note": "journal"}
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def _steps(first: int, n: int) -> pl.DataFrame:
    given: dict[str, list[object]] = {
        "step_id": list(range(first, first + n)),
        "ctx_id": [0] * n,
        "n_tokens": [1] * n,
    }
    return schema.frame("steps", given, absent=[c for c in schema.TABLES["steps"] if c not in given])


def _tokens(first: int, n: int) -> pl.DataFrame:
    given: dict[str, list[object]] = {
        "token_id": list(range(first, first + n)),
        "token_text": [f"t{i}" for i in range(first, first + n)],
        "t_end_ns": list(range(first, first + n)),
        "seq_id": [0] * n,
    }
    return schema.frame("tokens", given, absent=[c for c in schema.TABLES["tokens"] if c not in given])


def _logs(rec: Path) -> list[str]:
    d = rec / JOURNAL_DIR
    return sorted(os.listdir(d)) if d.exists() else []


def _records(rec: Path) -> list[tuple[str, int, int, int]]:
    """(table, segment S, row R, rows) of every record of every log, in order."""
    out = []
    for name in _logs(rec):
        data = (rec / JOURNAL_DIR / name).read_bytes()
        pos = 0
        while pos < len(data):
            magic, table, segment, row, length, _ = HEADER.unpack_from(data, pos)
            payload = data[pos + HEADER.size : pos + HEADER.size + length]
            rows = (
                gathered_codec.payload_rows(payload)
                if magic == MAGIC_GATHERED
                else ipc_stream.read_stream(payload).height
            )
            out.append((table.rstrip(b"\0").decode(), segment, row, rows))
            pos += HEADER.size + length
    return out


def _magics(rec: Path) -> set[bytes]:
    """The record kinds (magics) of every log."""
    out = set()
    for name in _logs(rec):
        data, pos = (rec / JOURNAL_DIR / name).read_bytes(), 0
        while pos < len(data):
            magic, _, _, _, length, _ = HEADER.unpack_from(data, pos)
            out.add(magic)
            pos += HEADER.size + length
    return out


def _append_record(log: Path, table: str, segment: int, row: int, payload: bytes) -> None:
    header = HEADER.pack(MAGIC, table.encode(), segment, row, len(payload), zlib.crc32(payload))
    with log.open("ab") as f:
        f.write(header + payload)


def _step_ids(rec: Path) -> list[int]:
    return list(sparseety_prof.open(rec).steps()["step_id"].to_list())


def _writer(rec: Path, **kw: object) -> RecordingWriter:
    return RecordingWriter(rec, META, fsync_interval=kw.pop("fsync_interval", 1000.0), **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------ written per drain
def test_each_drain_appends_a_record_per_table_that_a_killed_recording_is_read_from(tmp_path: Path) -> None:
    w = _writer(tmp_path / "rec")
    w.append("steps", _steps(0, 3))
    w.append("tokens", _tokens(0, 3))
    w.write_journal()
    w.append("steps", _steps(3, 2))
    w.write_journal()
    w.write_journal()  # nothing new: no record
    assert _logs(tmp_path / "rec") == ["log-000000.arrows"]
    assert _records(tmp_path / "rec") == [("steps", 0, 0, 3), ("tokens", 0, 0, 3), ("steps", 0, 3, 2)]
    assert not (tmp_path / "rec" / "steps").exists()  # no segment yet
    rec = sparseety_prof.open(tmp_path / "rec")  # the writer never closed: as if killed
    assert not rec.complete
    assert rec.steps()["step_id"].to_list() == [0, 1, 2, 3, 4]
    assert rec.tokens()["token_id"].to_list() == [0, 1, 2]
    assert rec.damaged == []
    w.close()


def test_an_append_cut_short_by_the_kernel_goes_on_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """writev may write less than asked (a signal, a pipe-like file): the rest follows, in order,
    whatever the cut; one that writes nothing is an error, never a loop."""
    parts = [bytes([k]) * n for k, n in enumerate([5, 0, 3, 17, 1, 64])]
    real = os.writev
    for cap in (1, 2, 7, 16, 1000):

        def short(fd: int, views: list[memoryview], cap: int = cap) -> int:
            left, out = cap, []
            for v in views:
                out.append(bytes(v[:left]))
                left -= len(out[-1])
            return real(fd, out)

        monkeypatch.setattr(journal.os, "writev", short)
        path = tmp_path / f"log{cap}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            assert journal._append(fd, parts) == sum(map(len, parts))
        finally:
            os.close(fd)
        assert path.read_bytes() == b"".join(parts), cap
    monkeypatch.setattr(journal.os, "writev", lambda fd, views: 0)
    with pytest.raises(OSError, match="wrote nothing"):
        journal._append(1, parts)


def test_a_flush_removes_the_logs_its_segments_hold_and_close_removes_the_journal(tmp_path: Path) -> None:
    w = _writer(tmp_path / "rec")
    w.append("steps", _steps(0, 3))
    w.write_journal()
    w.flush()
    assert _logs(tmp_path / "rec") == []
    w.append("steps", _steps(3, 2))
    w.write_journal()
    assert _logs(tmp_path / "rec") == ["log-000001.arrows"]
    assert _records(tmp_path / "rec") == [("steps", 1, 0, 2)]
    assert _step_ids(tmp_path / "rec") == [0, 1, 2, 3, 4]
    w.close()
    assert not (tmp_path / "rec" / JOURNAL_DIR).exists()
    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.complete and rec.steps()["step_id"].to_list() == [0, 1, 2, 3, 4]
    assert rec.meta["journal"]["records"] == 2


def test_rows_a_segment_holds_are_never_read_twice_though_their_log_stayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between a segment's rename and the removal of the logs it covers."""
    w = _writer(tmp_path / "rec", segment_rows=5)
    w.append("steps", _steps(0, 3))
    w.write_journal()  # record A: rows 0-2
    monkeypatch.setattr(journal.OutputDir, "remove", lambda self, name: None)  # the kill came first
    w.append("steps", _steps(3, 3))  # 6 rows buffered: segment 0 holds 0-4, row 5 waits
    assert os.listdir(tmp_path / "rec" / "steps") == ["part-000000.parquet"]
    w.write_journal()  # record B: rows 3-5, two of which segment 0 holds
    assert _records(tmp_path / "rec") == [("steps", 0, 0, 3), ("steps", 0, 3, 3)]
    assert _step_ids(tmp_path / "rec") == [0, 1, 2, 3, 4, 5]
    w.flush()  # segment 1 holds row 5: both records covered, still on disk
    assert len(_records(tmp_path / "rec")) == 2
    assert _step_ids(tmp_path / "rec") == [0, 1, 2, 3, 4, 5]
    w.append("steps", _steps(6, 1))
    w.write_journal()
    assert _step_ids(tmp_path / "rec") == [0, 1, 2, 3, 4, 5, 6]


def test_a_torn_record_ends_its_log_left_out_and_named_damaged_never_raised(tmp_path: Path) -> None:
    w = _writer(tmp_path / "rec")
    w.append("steps", _steps(0, 3))
    w.write_journal()
    w.append("steps", _steps(3, 3))
    w.write_journal()
    log = tmp_path / "rec" / JOURNAL_DIR / "log-000000.arrows"
    log.write_bytes(log.read_bytes()[:-100])  # a power cut before the fsync
    rec = sparseety_prof.open(tmp_path / "rec")  # skip_damaged not needed: it is where it ends
    assert rec.steps()["step_id"].to_list() == [0, 1, 2]
    assert len(rec.damaged) == 1 and log.name in rec.damaged[0] and "cut short" in rec.damaged[0]
    w.close()


def test_a_record_whose_checksum_fails_is_left_out(tmp_path: Path) -> None:
    w = _writer(tmp_path / "rec")
    w.append("steps", _steps(0, 3))
    w.write_journal()
    log = tmp_path / "rec" / JOURNAL_DIR / "log-000000.arrows"
    data = bytearray(log.read_bytes())
    data[-20] ^= 0xFF  # a byte of the payload the disk never got
    log.write_bytes(bytes(data))
    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.steps().height == 0
    assert len(rec.damaged) == 1 and "checksum" in rec.damaged[0]
    w.close()


def test_a_record_of_another_schema_is_left_out_as_damaged(tmp_path: Path) -> None:
    w = _writer(tmp_path / "rec")
    w.append("steps", _steps(0, 2))
    w.write_journal()
    log = tmp_path / "rec" / JOURNAL_DIR / "log-000000.arrows"
    _append_record(log, "steps", 0, 2, ipc_stream.write_stream(pl.DataFrame({"step_id": [7]})))
    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.steps()["step_id"].to_list() == [0, 1]
    assert len(rec.damaged) == 1 and log.name in rec.damaged[0] and "schema" in rec.damaged[0]
    w.close()


def test_a_closed_recording_ignores_a_journal_planted_in_it(tmp_path: Path) -> None:
    w = _writer(tmp_path / "rec")
    w.append("steps", _steps(0, 2))
    w.close()
    (tmp_path / "rec" / JOURNAL_DIR).mkdir()
    _append_record(
        tmp_path / "rec" / JOURNAL_DIR / "log-000000.arrows",
        "steps",
        1,
        0,
        ipc_stream.write_stream(_steps(100, 2)),
    )
    assert _step_ids(tmp_path / "rec") == [0, 1]


def test_journal_rows_are_redacted_as_the_segments_are(tmp_path: Path) -> None:
    w = _writer(tmp_path / "rec", redact_text=True)
    w.append("tokens", _tokens(0, 3))
    w.write_journal()
    data = (tmp_path / "rec" / JOURNAL_DIR / "log-000000.arrows").read_bytes()
    assert b"t1" not in data  # the token texts never reach the disk
    held = sparseety_prof.open(tmp_path / "rec").tokens()
    assert held["token_id"].to_list() == [0, 1, 2]
    assert held["token_text"].null_count() == 3
    w.close()


# ------------------------------------------------------------------ owner, modes, fsyncs
@root_only
def test_logs_are_0600_their_folder_0700_and_both_belong_to_the_sudo_user(tmp_path: Path) -> None:
    os.umask(0o022)
    w = _writer(tmp_path / "rec", owner=(NOBODY, NOBODY))
    w.append("steps", _steps(0, 2))
    w.write_journal()
    d = tmp_path / "rec" / JOURNAL_DIR
    for p in (d, *d.iterdir()):
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), p
        assert stat.S_IMODE(st.st_mode) == (0o700 if p.is_dir() else 0o600), p
    w.close()


def test_logs_are_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        w = _writer(tmp_path / "rec")
        w.append("steps", _steps(0, 2))
        w.write_journal()
    finally:
        os.umask(old)
    d = tmp_path / "rec" / JOURNAL_DIR
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert [stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()] == [0o600]
    w.close()


def _count_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = os.fsync

    def counted(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counted)
    return calls


def test_fsync_comes_on_its_own_cadence_not_with_each_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(journal.time, "monotonic", lambda: clock[0])
    w = _writer(tmp_path / "rec", fsync_interval=10.0)
    fsyncs = _count_fsyncs(monkeypatch)
    synced_at = []
    for i in range(25):  # a drain a second, 25 s
        clock[0] += 1.0
        w.append("steps", _steps(i, 1))
        before = len(fsyncs)
        w.write_journal()
        if len(fsyncs) > before:
            synced_at.append(i + 1)
    assert synced_at == [10, 20]
    assert w._journal is not None and w._journal.fsyncs == 2
    w.close()


def test_fsync_interval_zero_fsyncs_after_every_drain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _writer(tmp_path / "rec", fsync_interval=0.0)
    fsyncs = _count_fsyncs(monkeypatch)
    w.append("steps", _steps(0, 1))
    w.append("tokens", _tokens(0, 1))
    w.write_journal()
    # the log (both records, one append), the journal folder, and once the recording's folder
    assert len(fsyncs) == 3
    w.append("steps", _steps(1, 1))
    w.write_journal()
    assert len(fsyncs) == 4
    w.close()


def test_without_a_journal_nothing_is_written_between_flushes(tmp_path: Path) -> None:
    w = RecordingWriter(tmp_path / "rec", META)
    w.append("steps", _steps(0, 2))
    w.write_journal()
    assert not (tmp_path / "rec" / JOURNAL_DIR).exists()
    assert _step_ids(tmp_path / "rec") == []
    w.close()


# ------------------------------------------------------------------ a real engine, a real kill
@pytest.mark.root
@pytest.mark.engine
def test_sigkill_with_the_default_options_loses_no_token_older_than_two_seconds(
    llama_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUDO_UID", str(NOBODY))
    monkeypatch.setenv("SUDO_GID", str(NOBODY))
    rec = Recorder(llama_engine.pid, tmp_path / "rec")  # the default flush interval: 10 s
    llama_engine.send(
        {"prompts": ["hello the expert router"], "max_tokens": 900, "temp": 0.0, "token_delay": 0.01}
    )
    time.sleep(6.0)  # well within the first flush interval
    killed_ns = time.perf_counter_ns()  # CLOCK_MONOTONIC, as the engine's times_ns
    rc, _ = rec.stop(signal.SIGKILL)
    assert rc == -signal.SIGKILL
    truth = llama_engine.read(timeout=300)["results"][0]
    old = sum(t < killed_ns - 2e9 for t in truth["times_ns"])
    assert old >= 100, "the engine should have produced tokens for more than 2 s before the kill"
    r = sparseety_prof.open(tmp_path / "rec")
    assert not r.complete
    assert not (tmp_path / "rec" / "tokens").exists(), "no flush yet: the journal alone holds them"
    got = r.tokens().sort("t_end_ns")["token_id"].to_list()
    assert len(got) >= old, (len(got), old)
    assert got == truth["ids"][: len(got)]
    # every table's rows as gathered (the default's journal), each record read back whole: the
    # correlator's columns are plain values (a numpy one would come back refused as damaged)
    assert {rec[0] for rec in _records(tmp_path / "rec")} >= {"tokens", "steps", "routes"}
    assert set(r.steps()["step_id"].to_list()) >= set(r.tokens()["step_id"].to_list())
    assert r.routes().height > 0
    assert _magics(tmp_path / "rec") == {MAGIC_GATHERED}
    assert r.damaged == []
    for p in [tmp_path / "rec", *(tmp_path / "rec").rglob("*")]:  # the journal included
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), p
        assert stat.S_IMODE(st.st_mode) == (0o700 if p.is_dir() else 0o600), p


@pytest.mark.root
@pytest.mark.engine
def test_a_recording_stopped_cleanly_leaves_no_journal(models: dict[str, Path], tmp_path: Path) -> None:
    e = Engine([str(Path(__file__).parent / "engines" / "llama_engine.py"), str(models["moe"])])
    try:
        rec = Recorder(e.pid, tmp_path / "rec")
        truth = e.generate(["hello the expert router"], max_tokens=24)
        deadline = time.monotonic() + 60
        while not any(r[0] == "tokens" for r in _records(tmp_path / "rec")):  # the next drain's
            assert time.monotonic() < deadline, "no drain put the tokens in the journal"
            time.sleep(0.1)
        rc, err = rec.stop()
        assert rc == 0, err
    finally:
        e.close()
    assert not (tmp_path / "rec" / JOURNAL_DIR).exists()
    r = sparseety_prof.open(tmp_path / "rec")
    assert r.complete and r.tokens()["token_id"].to_list() == truth[0]["ids"]
    assert r.meta["journal"]["records"] >= 1


@pytest.mark.root
@pytest.mark.engine
def test_no_journal_leaves_the_rows_to_the_flushes(models: dict[str, Path], tmp_path: Path) -> None:
    """--no-journal: nothing is written between flushes (no journal/ while recording, however many
    drains), and the recording closed is the same exact one."""
    e = Engine([str(Path(__file__).parent / "engines" / "llama_engine.py"), str(models["moe"])])
    try:
        rec = Recorder(e.pid, tmp_path / "rec", "--no-journal", "--flush-interval", "600")
        truth = e.generate(["hello the expert router"], max_tokens=24)
        time.sleep(3.0)  # several drains (at most a second apart) after the last token
        assert not (tmp_path / "rec" / JOURNAL_DIR).exists()
        assert not list((tmp_path / "rec").glob("tokens/part-*.parquet"))  # no flush came yet
        rc, err = rec.stop()
        assert rc == 0, err
    finally:
        e.close()
    r = sparseety_prof.open(tmp_path / "rec")
    assert r.complete and r.tokens()["token_id"].to_list() == truth[0]["ids"]
    assert "journal" not in r.meta


def test_no_journal_reaches_the_writer(tmp_path: Path) -> None:
    from sparseety_prof.cli import build_parser
    from sparseety_prof.commands.attach_options import options_from
    from sparseety_prof.session.recorder import _open_writer

    p = build_parser()
    base = ["record", "--pid", "7", "-o", "r"]
    assert options_from(p.parse_args(base)).journal is True
    assert options_from(p.parse_args([*base, "--no-journal"])).journal is False
    assert options_from(p.parse_args(["attach", "--pid", "7", "-o", "r", "--no-journal"])).journal is False
    for journaled in (True, False):
        opts = options_from(p.parse_args([*base] + ([] if journaled else ["--no-journal"])))
        w = _open_writer(opts, tmp_path / f"rec-{journaled}", dict(META))
        assert w.journaling is journaled
        w.close()


# ------------------------------------------------------------------ the consumer's side
def _outlet(writer: RecordingWriter) -> RowOutlet:
    sinks = SinkFanout([], META, redact_text=False, redact=frozenset(), redact_layers=None, log=print)
    return RowOutlet(
        writer,
        RecordingPolicy(("full",)),
        None,
        sinks,
        stages=StageCpu(),
        collector=FlushTimedCollector(),
        log=print,
    )


@pytest.mark.parametrize("journaled", [True, False])
def test_each_drain_s_rows_reach_the_journal_after_the_drain(tmp_path: Path, journaled: bool) -> None:
    w = _writer(tmp_path / "rec") if journaled else RecordingWriter(tmp_path / "rec", META)
    out = _outlet(w)
    flush, t0 = FlushSchedule(10.0), time.monotonic()
    for drain in range(3):  # a drain a second
        out.add("steps", _steps(drain * 4, 4).to_dict(as_series=False))
        out.keep_durable(flush, t0 + drain, in_pieces=True)
    assert out.round.rounds == 0  # no flush yet: the journal alone holds the rows
    assert _step_ids(tmp_path / "rec") == (list(range(12)) if journaled else [])
    assert len(_records(tmp_path / "rec")) == (3 if journaled else 0)
    out.close_rows()
    w.close()
    assert _step_ids(tmp_path / "rec") == list(range(12))
    assert _logs(tmp_path / "rec") == []


def test_drains_that_come_fast_share_a_record(tmp_path: Path) -> None:
    w = _writer(tmp_path / "rec")
    out = _outlet(w)
    flush, t0 = FlushSchedule(10.0), time.monotonic()
    for drain in range(5):  # 0.2 s apart: framed for the journal at 0 and 0.6 s
        out.add("steps", _steps(drain * 4, 4).to_dict(as_series=False))
        out.keep_durable(flush, t0 + 0.2 * drain, in_pieces=True)
    assert [r[3] for r in _records(tmp_path / "rec")] == [4, 12]
    assert _step_ids(tmp_path / "rec") == list(range(16))  # the last drain's rows: at the next
    out.close_rows()
    w.close()


def test_fsync_interval_reaches_the_options_with_its_default_from_one_place() -> None:
    from sparseety_prof.cli import build_parser
    from sparseety_prof.commands.attach_options import options_from
    from sparseety_prof.errors import UsageError
    from sparseety_prof.session.options import FSYNC_INTERVAL_S

    p = build_parser()
    base = ["record", "--pid", "7", "-o", "r"]
    assert options_from(p.parse_args(base)).fsync_interval == FSYNC_INTERVAL_S
    assert options_from(p.parse_args([*base, "--fsync-interval", "0"])).fsync_interval == 0
    assert options_from(p.parse_args([*base, "--fsync-interval", "2.5"])).fsync_interval == 2.5
    for bad in ("-1", "nan"):
        with pytest.raises(UsageError, match="--fsync-interval"):
            options_from(p.parse_args([*base, "--fsync-interval", bad]))


def test_a_record_that_does_not_fit_stops_the_journal_not_the_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _writer(tmp_path / "rec")
    w.append("steps", _steps(0, 2))
    w.write_journal()
    assert len(_records(tmp_path / "rec")) == 1
    real = os.writev

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal.os, "writev", full)
    w.append("steps", _steps(2, 2))
    w.write_journal()
    monkeypatch.setattr(journal.os, "writev", real)
    assert w.write_error is None
    assert not (tmp_path / "rec" / JOURNAL_DIR).exists()  # its room back to the segments
    w.append("steps", _steps(4, 1))
    w.write_journal()
    w.close()
    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.complete and rec.steps()["step_id"].to_list() == [0, 1, 2, 3, 4]
    assert rec.meta["journal"]["stopped"] == "No space left on device"


def test_the_journal_counts_against_max_disk(tmp_path: Path) -> None:
    from sparseety_prof.store.recording_writer import MIN_MAX_DISK

    w = _writer(tmp_path / "rec", max_disk=MIN_MAX_DISK)
    for i in range(60):  # a segment, then a record, over and over: the oldest segments make room
        w.append("tokens", _tokens(i * 1000, 1000))
        w.flush()
        w.append("tokens", _tokens(i * 1000 + 500_000, 1000))
        w.write_journal()
        on_disk = sum(p.stat().st_size for p in (tmp_path / "rec").rglob("*") if p.is_file())
        largest = max(p.stat().st_size for p in (tmp_path / "rec").rglob("part-*.parquet"))
        assert on_disk <= MIN_MAX_DISK + largest, i
    assert w.meta["rotation"]["segments_removed"] > 0
    w.close()


# ------------------------------------------------------------------ journals from elsewhere
def _stream(df: pl.DataFrame, compression: Literal["uncompressed", "zstd"], oldest: bool) -> bytes:
    buf = io.BytesIO()
    df.write_ipc_stream(
        buf, compression=compression, compat_level=pl.CompatLevel.oldest() if oldest else None
    )
    return buf.getvalue()


@pytest.mark.parametrize(
    ("planted", "why"),
    [
        ("fifo", "FIFO"),
        ("symlink", "link"),
        ("compressed", "compressed body"),
        ("views", "Arrow type"),
        ("torn", "torn"),
        ("not a table", "names no table"),
    ],
)
def test_a_log_a_reader_must_not_trust_is_left_out_within_bounds(
    tmp_path: Path, planted: str, why: str
) -> None:
    w = _writer(tmp_path / "rec")
    w.append("steps", _steps(0, 2))
    w.flush()  # rows 0-1 in a segment, the journal emptied
    w.append("steps", _steps(2, 2))
    w.write_journal()
    log = tmp_path / "rec" / JOURNAL_DIR / "log-000000.arrows"
    rows = _steps(2, 2)
    log.unlink()
    if planted == "fifo":
        os.mkfifo(log)  # a reader that opened it would wait for ever
    elif planted == "symlink":
        log.symlink_to("/dev/zero")  # one that followed it would read for ever
    elif planted == "compressed":  # a decompression bomb's shape
        _append_record(log, "steps", 1, 0, _stream(rows, "zstd", oldest=True))
    elif planted == "views":
        _append_record(log, "steps", 1, 0, _stream(rows, "uncompressed", oldest=False))
    elif planted == "torn":
        _append_record(log, "steps", 1, 0, ipc_stream.write_stream(rows)[:-9])
    else:
        _append_record(log, "../../etc", 1, 0, ipc_stream.write_stream(rows))
    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.steps()["step_id"].to_list() == [0, 1]
    assert len(rec.damaged) == 1 and log.name in rec.damaged[0] and why in rec.damaged[0], rec.damaged
    w.close()


def test_types_nested_deeper_than_any_table_are_refused_before_decoding() -> None:
    deep = pl.DataFrame({"x": [[[[[[1]]]]]]})
    with pytest.raises(ipc_stream.IpcStreamError, match="nests types"):
        ipc_stream.check_stream(ipc_stream.write_stream(deep))


def test_mutated_chunks_are_refused_with_one_error_and_never_crash_the_reader() -> None:
    data = ipc_stream.write_stream(_tokens(0, 20))
    rng = random.Random(60)
    refused = 0
    for _ in range(400):
        d = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            d[rng.randrange(len(d))] = rng.randrange(256)
        try:
            df = ipc_stream.read_stream(bytes(d))
        except ipc_stream.IpcStreamError:
            refused += 1
            continue
        assert df.height <= 20  # what is accepted decodes into no more than was written
    assert refused > 100  # (any other exception, or a crash, fails the test too)
