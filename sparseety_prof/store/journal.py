"""The recording's journal: the rows of each drain in the kernel's page cache within about a second.

Parquet segments (fsynced) come every `--flush-interval`. A recorder killed outright between two
(SIGKILL, the OOM killer) would lose every row gathered since the last; the kernel's page cache
survives any death of the process, only a power cut empties it. So after each drain the writer puts
the rows it was given since the drain before into one chunk per table, in the folder ``journal/``:
an Arrow IPC stream, uncompressed (store/ipc_stream.py: the cheapest format Polars writes, the
columns' buffers copied out as they are), written whole under a hidden name and renamed into
place, with no fsync. The
chunks are fsynced on a cadence of their own (`--fsync-interval`), which bounds what a power cut
loses. A chunk is removed once segments hold all its rows; a recording closed cleanly has no
journal.

A chunk's name says which rows of its table it holds, so that a reader can tell which ones
segments already hold even when the recorder died between writing a segment and removing the
chunks it covers: ``<table>-<S>-<R>.arrows`` (``tokens-000003-000000000120.arrows``) holds rows that
follow the first R rows written from segment S on. Segments hold a table's rows in the order the
writer was given them, so with N the rows of segments S, S+1, ... (as many as are on disk without
a gap), the chunk's first max(0, N - R) rows are in segments and the rest only here.

This module writes the journal (`JournalWriter`, used by store/recording_writer.py) and names its
chunks; reading it back is store/journal_reader.py's.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from sparseety_prof.store.ipc_stream import write_stream
from sparseety_prof.store.output_dir import OutputDir

__all__ = ["CHUNK_RE", "JOURNAL_DIR", "JournalWriter", "chunk_name"]

JOURNAL_DIR = "journal"
#: a chunk's name: its table, the segment S and the row R its rows follow (see the module doc)
CHUNK_RE = re.compile(r"^(?P<table>[a-z]+)-(?P<segment>\d{6})-(?P<row>\d{12})\.arrows$")


def chunk_name(table: str, segment: int, row: int) -> str:
    return f"{table}-{segment:06d}-{row:012d}.arrows"


@dataclass
class _Pending:
    """A table's rows given since the last chunk, and where the first of them stands."""

    segment: int  # the segment the first row will be in, or one before it
    row: int  # rows of the table that go to segments from `segment` on before the first row
    start: int  # the first row's place among every row given for the table
    frames: list[pl.DataFrame] = field(default_factory=list)
    rows: int = 0


@dataclass
class _Chunk:
    name: str
    end: int  # the place, among every row given for the table, after its last row
    nbytes: int


class JournalWriter:
    """The chunks of one recording (`root`: its open directory). Not thread-safe: the recording
    writer calls it under its lock. Every method raises what the file system raises (a full disk);
    the writer then stops writing, as for a segment."""

    def __init__(self, root: OutputDir, fsync_interval_s: float) -> None:
        if fsync_interval_s < 0:
            raise ValueError(f"the fsync interval cannot be negative, got {fsync_interval_s}")
        self._root = root
        self._dir: OutputDir | None = None  # made with the first chunk
        self.fsync_interval_s = fsync_interval_s
        self._next_sync = time.monotonic() + fsync_interval_s
        self._pending: dict[str, _Pending] = {}
        self._chunks: dict[str, list[_Chunk]] = {}  # per table, oldest first
        self._unsynced: list[str] = []  # chunks written since the last fsync
        self._root_synced = False  # the journal folder's own name, fsynced in the recording's
        self.chunks_written = 0
        self.chunks_removed = 0
        self.bytes_written = 0
        self.bytes_on_disk = 0  # of the chunks not removed yet (--max-disk counts them)
        self.fsyncs = 0
        self.stopped: str | None = None  # why the journal stopped (a full disk), None while it goes on

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

    def write(self, written: dict[str, int]) -> None:
        """A chunk per table of the rows added since the last call (none for a table whose rows
        segments already hold: `written`, per table, the rows given that are in segments), and the
        fsync when it is due."""
        if self.stopped is not None:
            return
        pending, self._pending = self._pending, {}
        for table, p in pending.items():
            if p.start + p.rows <= written.get(table, 0):
                continue  # a segment was written meanwhile and holds them all
            df = pl.concat(p.frames, how="vertical", rechunk=False) if len(p.frames) > 1 else p.frames[0]
            data = write_stream(df)
            name = chunk_name(table, p.segment, p.row)
            self._folder().write_unsynced(name, data)
            self._chunks.setdefault(table, []).append(_Chunk(name, p.start + p.rows, len(data)))
            self._unsynced.append(name)
            self.chunks_written += 1
            self.bytes_written += len(data)
            self.bytes_on_disk += len(data)
        if self._unsynced and time.monotonic() >= self._next_sync:
            self.sync()

    def sync(self) -> None:
        """fsync the chunks written since the last time, and the journal folder."""
        d = self._folder()
        for name in self._unsynced:
            d.sync_file(name)  # (one a segment covered since is gone: its rows are fsynced there)
        d.sync()
        if not self._root_synced:
            self._root.sync()
            self._root_synced = True
        self._unsynced = []
        self._next_sync = time.monotonic() + self.fsync_interval_s
        self.fsyncs += 1

    def covered(self, table: str, written: int) -> None:
        """Segments now hold the first `written` rows given for `table`: the chunks they cover whole
        go (after the segment's rename: a recorder killed in between leaves a chunk that readers
        see covered)."""
        chunks = self._chunks.get(table)
        if not chunks or self._dir is None:
            return
        while chunks and chunks[0].end <= written:
            with contextlib.suppress(OSError):  # one left behind is read as covered: no harm
                self._dir.remove(chunks[0].name)
                self.chunks_removed += 1
            self.bytes_on_disk -= chunks.pop(0).nbytes
        if self._unsynced and not any(chunks for chunks in self._chunks.values()):
            self._unsynced = []  # nothing left to fsync

    def stop(self, reason: str) -> None:
        """A chunk could not be written (`reason`: a full disk, an I/O error): no more chunks, and
        the ones written removed, their room given back to the segments (which hold their rows at
        the next flush, or count them lost if they fail too)."""
        self.stopped = reason
        with contextlib.suppress(OSError):
            self.close()

    def close(self) -> None:
        """At the end, once segments hold every row: every chunk left, and the folder, removed."""
        self._pending = {}
        if self._dir is None:
            return
        for chunks in self._chunks.values():
            for c in chunks:
                with contextlib.suppress(FileNotFoundError):
                    self._dir.remove(c.name)
                self.chunks_removed += 1
        self._chunks = {}
        self._unsynced = []
        self.bytes_on_disk = 0
        self._dir.close()
        self._dir = None
        self._root.remove_subdir(JOURNAL_DIR)

    def meta(self) -> dict[str, Any]:
        """meta.json "journal": the cadence and what was written."""
        return {
            "fsync_interval_s": self.fsync_interval_s,
            "chunks": self.chunks_written,
            "bytes": self.bytes_written,
            "fsyncs": self.fsyncs,
        } | ({"stopped": self.stopped} if self.stopped is not None else {})

    def _folder(self) -> OutputDir:
        if self._dir is None:
            self._dir = self._root.subdir(JOURNAL_DIR)
        return self._dir
