"""The recording's journal: the rows of each drain in the kernel's page cache within about a second.

Parquet segments (fsynced) come every `--flush-interval`. A recorder killed outright between two
(SIGKILL, the OOM killer) would lose every row gathered since the last; the kernel's page cache
survives any death of the process, only a power cut empties it. So after a drain the writer
appends the rows it was given since the last time to an append-only log in the folder
``journal/``: one record per table, with no fsync. An append is one write(2) to a file already
open: a file per chunk would cost its creation, rename, fsync and removal in system time, several
times what the append does. The log is fsynced on a cadence of its own (`--fsync-interval`),
which bounds what a power cut loses.

A log file, ``journal/log-<N>.arrows`` (N counts from 0), is a sequence of records, each a
fixed header then its payload::

    magic "SPJ1" or "SPJ2" | table name, 16 bytes, NUL-padded | segment S: u32 | row R: u64
        | payload length: u64 | CRC-32 of the payload: u32            (little-endian, 44 bytes)
    payload: the rows; SPJ1: framed, an Arrow IPC stream, uncompressed (store/ipc_stream.py);
        SPJ2: as the consumer gathered them, before any frame (store/gathered_codec.py)

A frame costs a fixed amount per column, paid per record: so the rows go as gathered (SPJ2)
whenever the recording stores them as they come (the policy keeps or drops whole tables, no
redaction: RowOutlet decides), framed once at the flush as without a journal. Rows a policy holds
or a redaction changes go framed (SPJ1), as the recording stores them.

A record's S and R say which rows of its table it holds, so that a reader can tell which ones
segments already hold even when the recorder died between writing a segment and removing the
log it covers: the record's rows follow the first R rows written to the table's segments from
segment S on. Segments hold a table's rows in the order the writer was given them, so with N the
rows of segments S, S+1, ... (as many as are on disk without a gap), the record's first
max(0, N - R) rows are in segments and the rest only here. The CRC tells a record torn by a
power cut (appended, not yet fsynced) from a whole one.

A segment being written starts a new log file; a file is removed once segments hold every row of
its records. A recording closed cleanly has no journal.

This module writes the journal (`JournalWriter`, used by store/recording_writer.py) and defines
its records; reading them back is store/journal_reader.py's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from sparseety_prof.store.ipc_stream import write_stream
from sparseety_prof.store.output_dir import OutputDir

__all__ = ["HEADER", "JOURNAL_DIR", "LOG_RE", "MAGIC", "MAGIC_GATHERED", "JournalWriter", "log_name"]

JOURNAL_DIR = "journal"
LOG_RE = re.compile(r"^log-(?P<n>\d{6})\.arrows$")
MAGIC = b"SPJ1"
MAGIC_GATHERED = b"SPJ2"
#: a record's header: magic, table, segment S, row R, payload length, payload CRC-32
HEADER = struct.Struct("<4s16sIQQI")


def log_name(n: int) -> str:
    return f"log-{n:06d}.arrows"


#: buffers per writev(2) call (the kernel's IOV_MAX is 1024)
_IOV_MAX = 1024


def _append(fd: int, parts: list[bytes]) -> int:
    """`parts` written in order at the end of `fd` without joining them first (writev), short
    writes continued; the bytes written."""
    views = [memoryview(p) for p in parts if p]
    size = sum(len(v) for v in views)
    while views:
        done = os.writev(fd, views[:_IOV_MAX])
        if done <= 0:
            raise OSError(errno.EIO, "the journal's append wrote nothing")
        while views and done >= len(views[0]):
            done -= len(views.pop(0))
        if views and done:
            views[0] = views[0][done:]
    return size


@dataclass
class _Pending:
    """A table's rows given since the last record, and where the first of them stands."""

    segment: int  # the segment the first row will be in, or one before it
    row: int  # rows of the table that go to segments from `segment` on before the first row
    start: int  # the first row's place among every row given for the table
    frames: list[pl.DataFrame] = field(default_factory=list)
    rows: int = 0


@dataclass(frozen=True)
class _Gathered:
    """A table's rows as gathered (store/gathered_codec.py payload) and where the first stands."""

    table: str
    payload: bytes
    rows: int
    segment: int
    row: int
    start: int


@dataclass
class _Log:
    """A log file, and per table the place (among every row given for it) after its last row."""

    name: str
    fd: int  # -1 once no longer appended to
    ends: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0
    unsynced: bool = False


class JournalWriter:
    """The journal of one recording (`root`: its open directory). Not thread-safe: the recording
    writer calls it under its lock. `write` raises what the file system raises (a full disk)."""

    def __init__(self, root: OutputDir, fsync_interval_s: float) -> None:
        if fsync_interval_s < 0:
            raise ValueError(f"the fsync interval cannot be negative, got {fsync_interval_s}")
        self._root = root
        self._dir: OutputDir | None = None  # made with the first record
        self.fsync_interval_s = fsync_interval_s
        self._next_sync = time.monotonic() + fsync_interval_s
        self._pending: dict[str, _Pending] = {}
        self._gathered: list[_Gathered] = []
        self._logs: list[_Log] = []  # oldest first; the last one is appended to
        self._written_now: dict[str, int] = {}  # per table, the rows given that segments hold
        self._files = 0  # log files made
        self._dir_unsynced = False  # a log file made since the folder's last fsync
        self._root_synced = False  # the journal folder's own name, fsynced in the recording's
        self.records = 0
        self.bytes_written = 0
        self.fsyncs = 0
        self.stopped: str | None = None  # why the journal stopped (a full disk), None while it goes on

    @property
    def bytes_on_disk(self) -> int:
        """The bytes of the log files not removed yet (--max-disk counts them)."""
        return sum(log.nbytes for log in self._logs)

    def add(self, table: str, df: pl.DataFrame, *, segment: int, row: int, start: int) -> None:
        """Rows given to the writer for `table` (as it buffered them): `segment` is the table's next
        segment, `row` the rows buffered for it before these, `start` the rows given before these
        over the whole recording."""
        if df.height == 0 or self.stopped is not None:
            return
        p = self._pending.get(table)
        if p is None:
            p = self._pending[table] = _Pending(segment, row, start)
        p.frames.append(df)
        p.rows += df.height

    def add_gathered(
        self, table: str, payload: bytes, rows: int, *, segment: int, row: int, start: int
    ) -> None:
        """Rows of `table` as gathered (a gathered_codec payload of `rows` rows): they follow the
        first `row` rows written to its segments from `segment` on, and `start` rows given
        before them over the whole recording."""
        if rows and self.stopped is None:
            self._gathered.append(_Gathered(table, payload, rows, segment, row, start))

    def write(self, written: dict[str, int]) -> None:
        """A record per table of the rows added since the last call (none for a table whose rows
        segments already hold: `written`, per table, the rows given that are in segments),
        appended in one write; and the fsync when it is due."""
        if self.stopped is not None:
            return
        pending, self._pending = self._pending, {}
        gathered, self._gathered = self._gathered, []
        parts: list[bytes] = []
        ends: dict[str, int] = {}
        for g in gathered:
            end = g.start + g.rows
            if end <= written.get(g.table, 0):
                continue  # a segment was written meanwhile and holds them all
            header = HEADER.pack(
                MAGIC_GATHERED, g.table.encode(), g.segment, g.row, len(g.payload), zlib.crc32(g.payload)
            )
            parts += [header, g.payload]
            ends[g.table] = max(ends.get(g.table, 0), end)
        for table, p in pending.items():
            end = p.start + p.rows
            if end <= written.get(table, 0):
                continue  # a segment was written meanwhile and holds them all
            df = pl.concat(p.frames, how="vertical", rechunk=False) if len(p.frames) > 1 else p.frames[0]
            payload = write_stream(df)
            name = table.encode()
            parts.append(HEADER.pack(MAGIC, name, p.segment, p.row, len(payload), zlib.crc32(payload)))
            parts.append(payload)
            ends[table] = max(ends.get(table, 0), end)
        if parts:
            log = self._current()
            size = _append(log.fd, parts)
            for table, end in ends.items():
                log.ends[table] = max(log.ends.get(table, 0), end)
            log.nbytes += size
            log.unsynced = True
            self.records += len(parts) // 2
            self.bytes_written += size
        if time.monotonic() >= self._next_sync and any(log.unsynced for log in self._logs):
            self.sync()

    def sync(self) -> None:
        """fsync what was appended since the last time, and the journal folder when a log file
        was made since."""
        for log in self._logs:
            if log.unsynced and log.fd >= 0:
                os.fsync(log.fd)
            elif log.unsynced and self._dir is not None:
                self._dir.sync_file(log.name)
            log.unsynced = False
        if self._dir is not None and self._dir_unsynced:
            self._dir.sync()
            self._dir_unsynced = False
            if not self._root_synced:
                self._root.sync()
                self._root_synced = True
        self._next_sync = time.monotonic() + self.fsync_interval_s
        self.fsyncs += 1

    def covered(self, table: str, written: int) -> None:
        """A segment of `table` was written: segments now hold its first `written` rows given.
        The log appended to so far is closed (appends go to a new one from now on: the rows of
        this flush's segments are all in it or before) and every log file whose rows segments now
        all hold is removed (after the segment's rename: a recorder killed in between leaves a
        log that readers see covered)."""
        self._written_now[table] = written
        if self._logs and self._logs[-1].fd >= 0:
            self._retire(self._logs[-1])
        for log in [log for log in self._logs if log.fd < 0]:
            if all(end <= self._written_now.get(t, 0) for t, end in log.ends.items()):
                with contextlib.suppress(OSError):  # one left behind is read as covered: no harm
                    assert self._dir is not None
                    self._dir.remove(log.name)
                self._logs.remove(log)

    def stop(self, reason: str) -> None:
        """A record could not be written (`reason`: a full disk, an I/O error): no more records,
        and the logs removed, their room given back to the segments (which hold their rows at
        the next flush, or count them lost if they fail too)."""
        self.stopped = reason
        with contextlib.suppress(OSError):
            self.close()

    def close(self) -> None:
        """At the end, once segments hold every row: every log, and the folder, removed."""
        self._pending = {}
        self._gathered = []
        for log in self._logs:
            self._retire(log)
        if self._dir is None:
            return
        for log in self._logs:
            with contextlib.suppress(FileNotFoundError):
                self._dir.remove(log.name)
        self._logs = []
        self._dir.close()
        self._dir = None
        self._root.remove_subdir(JOURNAL_DIR)

    def meta(self) -> dict[str, Any]:
        """meta.json "journal": the cadence and what was written."""
        return {
            "fsync_interval_s": self.fsync_interval_s,
            "records": self.records,
            "bytes": self.bytes_written,
            "fsyncs": self.fsyncs,
        } | ({"stopped": self.stopped} if self.stopped is not None else {})

    def _current(self) -> _Log:
        """The log file appended to, made when there is none."""
        if self._logs and self._logs[-1].fd >= 0:
            return self._logs[-1]
        if self._dir is None:
            self._dir = self._root.subdir(JOURNAL_DIR)
            self._dir_unsynced = True
        name = log_name(self._files)
        log = _Log(name, self._dir.create_log(name))
        self._files += 1
        self._dir_unsynced = True
        self._logs.append(log)
        return log

    def _retire(self, log: _Log) -> None:
        """No more appends to `log` (its data stays to be fsynced by name)."""
        if log.fd >= 0:
            os.close(log.fd)
            log.fd = -1
