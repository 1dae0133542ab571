"""Writing one recording directory (the format: store/recording.py): rows buffered per table and
written as Parquet segments, meta.json rewritten atomically, every file created through an opened
directory (store/output_dir.py); redaction levels applied to every row (store/redaction_levels.py),
a disk budget kept by removing the oldest segments (store/rotation.py), and a write error (disk
full) ending the writes honestly instead of raising into the recorder."""

from __future__ import annotations

import contextlib
import io
import json
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import polars as pl

from sparseety_prof.errors import RecordingWriteError
from sparseety_prof.store import gathered_codec, redaction_levels, schema
from sparseety_prof.store.journal import JournalWriter
from sparseety_prof.store.output_dir import OutputDir
from sparseety_prof.store.recording import (
    FORMAT,
    META_FILE,
    list_layers,
    schema_diff,
    segment_name,
    without_text,
)
from sparseety_prof.store.rotation import DiskBudget, Segment

DEFAULT_SEGMENT_ROWS = 50_000
#: segments whose first row the writer remembers per table (journal_gathered: a drain's rows are
#: never spread over more than the last few)
_SEGMENT_STARTS_KEPT = 64
# Disk room held from the start for the last meta.json, freed when a write fails or at close.
_RESERVE_FILE = ".space-reserve"
_RESERVE_MIN = 64 * 1024
#: the smallest --max-disk: room for meta.json, its reserve and a few segments of every table
MIN_MAX_DISK = 1 << 20
_RESERVE_PER_META_BYTE = 4  # the final meta.json is larger than the first; it is written beside it
#: Keys the writer owns; callers may not set them through meta/update_meta/close.
_RESERVED_META = frozenset(
    {
        "format",
        "schema_version",
        "complete",
        "redacted",
        "redaction",
        "tables",
        "write_error",
        "rotation",
        "journal",
    }
)
#: the same keys, for a caller copying another recording's meta.json into a new writer
WRITER_META_KEYS = _RESERVED_META


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class RecordingWriter:
    """Writes one recording directory. Thread-safe; meant to be fed by the consumer thread.

    Parameters
    ----------
    path
        The recording directory. Created (mode 0700, missing parents too); an existing directory
        must be empty, a real directory (not a symlink), and is left with its mode and owner
        (see `output_dir.OutputDir.create`).
    meta
        Run metadata (JSON-serialisable; anything else is stored as ``str()``).
    owner
        ``(uid, gid)`` to chown every file and every directory it creates to (see `sudo_owner`).
    segment_rows
        Rows buffered per table before a segment is written.
    redact_text
        Store token text as nulls (the column stays) and record ``"redacted": true``.
    max_disk
        Bytes the recording may hold on disk; beyond them the oldest segments are removed
        (store/rotation.py) and counted in ``"rotation"``. None: no limit.
    fsync_interval
        Keep a journal (store/journal.py): `write_journal` puts the rows given since its last call
        in the page cache, fsynced this many seconds apart (0: each time). None: no journal, the
        rows reach the disk with the segments only.
    redact, redact_layers
        Redaction levels (store/redaction_levels.py: ids, routing, sparsity, masks) applied to
        every row before it is buffered, the per-layer ones on `redact_layers` only when given
        (meta's "layers" maps the tokens table's per-layer lists); meta.json's ``"redaction"``
        says what was applied (with the expert load per layer when routing is redacted).

    A write that fails (disk full, I/O error) does not raise: the writer stops writing rows,
    counts every row it is given from then on as not written, and `close` records
    ``"complete": false`` with the reason (`write_error`). The caller decides what to do.
    """

    def __init__(
        self,
        path: Path,
        meta: Mapping[str, Any],
        *,
        owner: tuple[int, int] | None = None,
        segment_rows: int = DEFAULT_SEGMENT_ROWS,
        redact_text: bool = False,
        redact: Iterable[str] = (),
        redact_layers: Iterable[int] | None = None,
        compression: Literal["zstd", "lz4", "snappy", "uncompressed"] = "zstd",
        max_disk: int | None = None,
        fsync_interval: float | None = None,
    ) -> None:
        if segment_rows < 1:
            raise ValueError(f"segment_rows must be >= 1, got {segment_rows}")
        reserved = _RESERVED_META & set(meta)
        if reserved:
            raise ValueError(f"meta keys {sorted(reserved)} are set by the writer")
        self.path = Path(path)
        self.owner = owner
        self.segment_rows = segment_rows
        self.redact_text = redact_text
        self.redaction = redaction_levels.Redaction(
            frozenset(redact),
            None if redact_layers is None else frozenset(redact_layers),
            list_layers(meta),
        )
        self._expert_load = redaction_levels.ExpertLoad() if "routing" in self.redaction.levels else None
        self._compression = compression
        self._lock = threading.Lock()
        self._buffers: dict[str, list[pl.DataFrame]] = {t: [] for t in schema.TABLES}
        self._buffered: dict[str, int] = dict.fromkeys(schema.TABLES, 0)
        self._segments: dict[str, int] = dict.fromkeys(schema.TABLES, 0)  # next segment index
        self._first: dict[str, int] = dict.fromkeys(schema.TABLES, 0)  # oldest segment on disk
        self._rows: dict[str, int] = dict.fromkeys(schema.TABLES, 0)  # rows in segments on disk
        # rows given (buffered) and rows written to segments, rotated ones included: the journal's
        # places (store/journal.py)
        self._given: dict[str, int] = dict.fromkeys(schema.TABLES, 0)
        self._written: dict[str, int] = dict.fromkeys(schema.TABLES, 0)
        # per table, the first row (among every row given) of each of its last segments: where a
        # gathered journal record whose rows a segment partly holds starts (journal_gathered)
        self._segment_starts: dict[str, dict[int, int]] = {t: {} for t in schema.TABLES}
        self._budget = DiskBudget(max_disk) if max_disk is not None else None
        self._meta_bytes = 0
        self._not_written: dict[str, int] = dict.fromkeys(schema.TABLES, 0)
        #: Why writing stopped (disk full, I/O error), or None while every write succeeded.
        self.write_error: str | None = None
        self._closed = False
        self._dir = OutputDir.create(self.path, META_FILE, owner)
        self._table_dirs: dict[str, OutputDir] = {}
        self._journal = JournalWriter(self._dir, fsync_interval) if fsync_interval is not None else None
        self._meta: dict[str, Any] = {
            "format": FORMAT,
            "schema_version": schema.SCHEMA_VERSION,
            "complete": False,
            "redacted": redact_text,
            "redaction": self.redaction.to_meta(),
            "created_unix_ms": _now_ms(),
            **meta,
        }
        with self._lock:
            try:
                size = self._write_meta()
            except Exception as e:
                self._dir.close()
                raise RecordingWriteError(f"cannot write {self.path / META_FILE}: {_reason(e)}") from None
            self._reserve_bytes = max(_RESERVE_MIN, _RESERVE_PER_META_BYTE * size)
            self._dir.reserve(_RESERVE_FILE, self._reserve_bytes)

    # ------------------------------------------------------------------ public API
    @property
    def meta(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._meta)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def journaling(self) -> bool:
        """Whether the rows given reach the journal at each `write_journal` (store/journal.py)."""
        return self._journal is not None

    def rows_written(self, table: str) -> int:
        """Rows of `table` already in segments on disk (buffered rows not included)."""
        return self._rows[table]

    def rows_not_written(self) -> dict[str, int]:
        """Rows per table given to the writer but lost to a write error."""
        with self._lock:
            return dict(self._not_written)

    def failure(self) -> RecordingWriteError | None:
        """The one-line error to end with when a write failed (None when none did)."""
        if self.write_error is None:
            return None
        lost, kept = sum(self.rows_not_written().values()), sum(self._rows.values())
        return RecordingWriteError(
            f"recording stopped: {self.write_error}; {lost} rows were not written, the {kept} written "
            f"before are readable ({META_FILE} says complete: false)"
        )

    @property
    def stores_as_given(self) -> bool:
        """Whether rows are stored as they are given (no redaction changes them): the journal
        may then hold them as the consumer gathered them (`journal_gathered`)."""
        return not self.redact_text and not self.redaction.levels

    def journal_gathered(self, table: str, parts: Sequence[Mapping[str, Any]], *, start: int) -> None:
        """Rows of `table` as the consumer gathered them (store/gathered_codec.py), to the journal
        at the next `write_journal`; `start`: the rows of the table gathered before them, every
        one of which is given to `append` (`journaled=True`) in the order gathered, as these
        will be. Only when `stores_as_given`."""
        if self._journal is None:
            return
        payload = gathered_codec.encode(parts)
        rows = gathered_codec.payload_rows(payload)
        with self._lock:
            if self._closed or self.write_error is not None or not rows:
                return
            written = self._written[table]
            if start + rows <= written:
                return  # segments hold them all already
            if start >= written:  # after every row in segments: from the next segment on
                segment, row = self._segments[table], start - written
            else:  # some in the last segments already (given as a frame was made before this)
                segment = max(
                    (k for k, first in self._segment_starts[table].items() if first <= start), default=-1
                )
                if segment < 0:
                    return  # (in a segment older than those remembered: not a case the writer makes)
                row = start - self._segment_starts[table][segment]
            self._journal.add_gathered(table, payload, rows, segment=segment, row=row, start=start)

    def append(self, table: str, df: pl.DataFrame, *, journaled: bool = False) -> None:
        """Buffer rows of `table`; writes a segment each time `segment_rows` rows are buffered.
        `journaled`: the journal holds these rows already (`journal_gathered`).

        Raises ValueError when the frame's columns or dtypes are not exactly the table's schema.
        """
        if table not in schema.TABLES:
            raise ValueError(f"unknown table {table!r}; tables are {sorted(schema.TABLES)}")
        diff = schema_diff(table, df.schema)
        if diff:
            raise ValueError(f"frame does not match the {table} schema: {diff}")
        with self._lock:
            self._check_open()
            if df.height == 0:
                return
            if self.write_error is not None:
                self._not_written[table] += df.height
                return
            if self.redact_text:
                df = without_text(table, df)
            if self._expert_load is not None and table == "routes":
                self._expert_load.add(df)
            df = self.redaction.frame(table, df)
            if self._journal is not None and not journaled:
                self._journal.add(
                    table,
                    df,
                    segment=self._segments[table],
                    row=self._buffered[table],
                    start=self._given[table],
                )
            self._buffers[table].append(df)
            self._buffered[table] += df.height
            self._given[table] += df.height
            if self._buffered[table] >= self.segment_rows:
                self._flush_table(table, full_only=True)

    def flush(self) -> None:
        """Write every buffered row to disk now (one segment per table that has rows)."""
        with self._lock:
            self._check_open()
            self._flush_all()

    def write_journal(self) -> None:
        """The rows given since the last call, to the journal (page cache, no fsync unless its
        cadence says so): after each drain. Nothing without a journal, once closed or after a
        write error."""
        if self._journal is None:
            return
        with self._lock:
            if self._closed or self.write_error is not None:
                return
            try:
                self._journal.write(self._written)
            except Exception as e:
                # the segments may still fit where a record did not (a record is uncompressed, a segment
                # zstd): the journal stops and frees its room, the recording goes on without it
                self._journal.stop(_reason(e))
            if self._budget is not None:  # the journal counts against --max-disk too
                if self._overhead() > self._budget.max_bytes:  # not even with every segment gone
                    self._journal.stop(
                        f"the journal does not fit within --max-disk ({self._budget.max_bytes} bytes)"
                    )
                try:
                    self._rotate(self._budget.make_room(overhead=self._overhead()))
                except Exception as e:
                    self._fail(f"writing {self.path / META_FILE}", e)

    def flush_steps(self) -> Iterator[str]:
        """`flush` in steps, for a caller that does other work between them: a yield after each
        table's segments (naming the table), then meta.json. Rows appended in between are written
        by the step of their table if it comes later, else by the next flush. Nothing is done
        once the writer is closed (its close wrote everything) or a write failed."""
        wrote = False
        for table in schema.TABLES:
            with self._lock:
                if self._closed or self.write_error is not None:
                    return
                wrote_table = self._flush_table(table, full_only=False)
            if wrote_table:
                wrote = True
                yield f"segment {table}"
        with self._lock:
            if not wrote or self._closed or self.write_error is not None:
                return
            self._store_meta()
        yield META_FILE

    def update_meta(self, **kv: Any) -> None:
        """Merge `kv` into the metadata and rewrite meta.json."""
        self._check_reserved(kv)
        with self._lock:
            self._check_open()
            self._meta.update(kv)
            if self.write_error is None:
                self._store_meta()

    def close(self, *, complete: bool = True, **final_meta: Any) -> None:
        """Flush, merge `final_meta` (end time, loss counters...) and mark the recording complete
        (unless `complete` is False, or a write failed). A second call does nothing."""
        self._check_reserved(final_meta)
        with self._lock:
            if self._closed:
                return
            self._flush_all()
            self._close_journal()
            self._meta.update(final_meta)
            self._meta.setdefault("closed_unix_ms", _now_ms())
            lost = sum(self._not_written.values())
            if isinstance(self._meta.get("losses"), dict):
                self._meta["losses"] = {**self._meta["losses"], "rows_not_written": lost}
            elif lost:
                self._meta["losses"] = {"rows_not_written": lost}
            self._meta["complete"] = complete and self.write_error is None
            self._dir.release(_RESERVE_FILE)  # its room is for this last meta.json
            self._store_meta()
            self._closed = True
            for d in (*self._table_dirs.values(), self._dir):
                d.close()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Keep what was captured, but do not claim completeness after an exception.
        self.close(complete=exc_type is None)

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"recording {self.path} is closed")

    @staticmethod
    def _check_reserved(kv: Mapping[str, Any]) -> None:
        reserved = _RESERVED_META & set(kv)
        if reserved:
            raise ValueError(f"meta keys {sorted(reserved)} are set by the writer")

    def _close_journal(self) -> None:
        """Segments hold every row now (or a write failed, and the rows not written are counted
        lost): the journal goes, its figures into meta.json."""
        if self._journal is None:
            return
        with contextlib.suppress(OSError):  # a log left in a closed recording is never read
            self._journal.close()
        self._meta["journal"] = self._journal.meta()

    def _write_meta(self) -> int:
        """Rewrite meta.json (atomically); returns its size. Raises what the file system raises."""
        self._meta["tables"] = {
            t: {"rows": self._rows[t], "segments": self._segments[t] - self._first[t]}
            | ({"first_segment": self._first[t]} if self._budget is not None else {})
            for t in schema.TABLES
        }
        if self._budget is not None:
            self._meta["rotation"] = self._budget.to_meta()
        if self._expert_load is not None:
            self._meta["redaction"] = {**self._meta["redaction"], "expert_load": self._expert_load.to_meta()}
        if self.write_error is not None:
            self._meta["write_error"] = {
                "reason": self.write_error,
                "rows_not_written": dict(self._not_written),
            }
        data = (json.dumps(self._meta, indent=2, sort_keys=True, default=str) + "\n").encode()
        self._dir.write_atomic(META_FILE, lambda f: f.write(data))
        self._meta_bytes = len(data)
        return len(data)

    def _store_meta(self) -> None:
        """Rewrite meta.json; a failure stops the recording's writes (see `_fail`)."""
        try:
            self._write_meta()
        except Exception as e:
            if self.write_error is None:
                self._fail(f"writing {self.path / META_FILE}", e)

    def _fail(self, what: str, e: BaseException) -> None:
        """Stop writing rows: every buffered row is lost, and so is every row appended later.
        meta.json is rewritten once more (complete: false, with the reason) in the room the
        reserve held; if even that fails, it keeps its last state, which says complete: false."""
        self.write_error = f"{what}: {_reason(e)}"
        for t in schema.TABLES:
            self._not_written[t] += self._buffered[t]
            self._buffers[t], self._buffered[t] = [], 0
        self._meta["complete"] = False
        self._dir.release(_RESERVE_FILE)
        with contextlib.suppress(Exception):  # still full: meta.json keeps complete: false
            self._write_meta()

    def _flush_all(self) -> None:
        if self.write_error is not None:
            return
        wrote = False
        for table in schema.TABLES:
            wrote |= self._flush_table(table, full_only=False)
        if wrote and self.write_error is None:
            self._store_meta()

    def _flush_table(self, table: str, *, full_only: bool) -> bool:
        """Write buffered rows as segments of at most `segment_rows` rows. With `full_only`, a
        remainder smaller than a segment stays buffered. Returns whether anything was written."""
        if self._buffered[table] == 0 or self.write_error is not None:
            return False
        df = pl.concat(self._buffers[table], how="vertical", rechunk=False)
        self._buffers[table], self._buffered[table] = [], 0
        offset, wrote = 0, False
        while offset < df.height:
            n = min(self.segment_rows, df.height - offset)
            if full_only and n < self.segment_rows:
                break
            try:
                self._write_segment(table, df.slice(offset, n))
            except Exception as e:
                self._not_written[table] += df.height - offset
                self._fail(f"writing {self.path / table / segment_name(self._segments[table])}", e)
                return wrote
            offset += n
            wrote = True
        if offset < df.height:
            rest = df.slice(offset)
            self._buffers[table], self._buffered[table] = [rest], rest.height
        if wrote and full_only:
            self._store_meta()
        return wrote

    def _write_segment(self, table: str, df: pl.DataFrame) -> None:
        d = self._table_dirs.get(table)
        if d is None:
            d = self._table_dirs[table] = self._dir.subdir(table)
        # encoded in memory, then written as bytes: a full disk then fails in our own write, with
        # its errno (polars reports it as a bare "transport error")
        buf = io.BytesIO()
        df.write_parquet(buf, compression=self._compression)
        data = buf.getbuffer()
        d.write_atomic(segment_name(self._segments[table]), lambda f: f.write(data))
        starts = self._segment_starts[table]
        starts[self._segments[table]] = self._written[table]
        if len(starts) > _SEGMENT_STARTS_KEPT:
            del starts[min(starts)]
        self._segments[table] += 1
        self._rows[table] += df.height
        self._written[table] += df.height
        if self._journal is not None:  # after the rename: a log is never the only copy lost
            self._journal.covered(table, self._written[table])
        if self._budget is not None:
            seg = Segment(table, self._segments[table] - 1, len(data), df.height)
            self._rotate(self._budget.added(seg, overhead=self._overhead()))

    def _overhead(self) -> int:
        """The bytes --max-disk counts beside the segments: meta.json, its reserve, the journal."""
        journal = self._journal.bytes_on_disk if self._journal is not None else 0
        return self._meta_bytes + self._reserve_bytes + journal

    def _rotate(self, victims: list[Segment]) -> None:
        """Remove the oldest segments the disk budget gave up. meta.json moves each table's first
        segment past them BEFORE the files go: a recorder killed in between leaves an old segment
        the loader ignores, never a gap it would call damage."""
        if not victims:
            return
        for seg in victims:
            self._first[seg.table] = seg.index + 1
            self._rows[seg.table] -= seg.rows
        self._write_meta()
        for seg in victims:
            self._table_dirs[seg.table].remove(segment_name(seg.index))


def _reason(e: BaseException) -> str:
    """One line saying why a write failed ("No space left on device", not a polars traceback)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    _, sep, io_reason = text.partition("underlying IO error: ")  # polars wraps the OSError
    return re.sub(r" \(os error \d+\)$", "", io_reason) if sep else text
