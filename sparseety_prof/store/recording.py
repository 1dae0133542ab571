"""The on-disk recording format: a directory of Parquet segments plus a JSON metadata file.

Layout::

    <recording>/
        meta.json                  run metadata (rewritten atomically; "complete": true once closed)
        tokens/part-000000.parquet one segment per flush, schema.TOKENS columns
        tokens/part-000001.parquet
        steps/part-000000.parquet  schema.STEPS columns
        ...

Every segment is written in full under a hidden temporary name (``.part-000003.parquet.tmp``)
and then renamed, so a crash or Ctrl-C loses at most the segment being written and a reader
never sees half a file. ``polars.scan_parquet(rec / "tokens" / "*.parquet")`` reads a table.

Recordings hold secrets (token text, and routing/mask traces from which prompts can be
recovered), so every file is 0600 and every directory 0700 whatever the umask, and when the
profiler runs under sudo everything is handed to the invoking user (``owner``).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Literal

import polars as pl

from sparseety_prof.errors import CorruptRecording, UsageError
from sparseety_prof.store import schema

__all__ = ["FORMAT", "META_FILE", "Recording", "RecordingWriter", "open", "sudo_owner"]

FORMAT = "sparseety-prof-recording"
META_FILE = "meta.json"
DIR_MODE = 0o700
FILE_MODE = 0o600
DEFAULT_SEGMENT_ROWS = 50_000

_SKIP_HINT = "; open the recording with skip_damaged=True to read the rest"
_SEGMENT_RE = re.compile(r"^part-(\d{6})\.parquet$")
#: Keys the writer owns; callers may not set them through meta/update_meta/close.
_RESERVED_META = frozenset({"format", "schema_version", "complete", "redacted", "tables"})

# Column roles. Names come from the schema; these only say which schema column plays which role.
# (Candidates for schema.py itself, e.g. schema.TEXT_COLUMNS / schema.SORT_KEYS.)
_TEXT_COLUMNS: dict[str, tuple[str, ...]] = {"tokens": ("token_text",)}
_SORT_KEYS: dict[str, tuple[str, ...]] = {
    "tokens": ("t_end_ns", "seq_id"),
    "steps": ("step_id",),
    "routes": ("step_id", "row", "layer"),
    "masks": ("step_id", "row", "layer"),
    "requests": ("t_started_ns", "seq_id"),
    "kernels": ("launch_ns", "correlation_id"),
}
for _table, _cols in (*_TEXT_COLUMNS.items(), *_SORT_KEYS.items()):
    _missing = [c for c in _cols if c not in schema.TABLES[_table]]
    if _missing:  # pragma: no cover - guards against a schema rename
        raise ImportError(f"recording: columns {_missing} are not in schema.TABLES[{_table!r}]")


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


def segment_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _schema_diff(table: str, got: Mapping[str, pl.DataType]) -> str:
    """Human-readable difference between a frame's schema and the table's; '' when identical."""
    want = schema.TABLES[table]
    problems = []
    missing = [c for c in want if c not in got]
    extra = [c for c in got if c not in want]
    if missing:
        problems.append(f"missing columns {missing}")
    if extra:
        problems.append(f"unexpected columns {extra}")
    wrong = [f"{c}: {got[c]} (expected {want[c]})" for c in want if c in got and got[c] != want[c]]
    if wrong:
        problems.append("wrong dtypes " + ", ".join(wrong))
    if not problems and list(got) != list(want):
        problems.append(f"columns out of order {list(got)} (expected {list(want)})")
    return "; ".join(problems)


class RecordingWriter:
    """Writes one recording directory. Thread-safe; meant to be fed by the consumer thread.

    Parameters
    ----------
    path
        The recording directory. Created (mode 0700, missing parents too); an existing directory
        must be empty.
    meta
        Run metadata (JSON-serialisable; anything else is stored as ``str()``).
    owner
        ``(uid, gid)`` to chown every file and directory to (see `sudo_owner`).
    segment_rows
        Rows buffered per table before a segment is written.
    redact_text
        Store token text as nulls (the column stays) and record ``"redacted": true``.
    """

    def __init__(
        self,
        path: Path,
        meta: Mapping[str, Any],
        *,
        owner: tuple[int, int] | None = None,
        segment_rows: int = DEFAULT_SEGMENT_ROWS,
        redact_text: bool = False,
        compression: Literal["zstd", "lz4", "snappy", "uncompressed"] = "zstd",
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
        self._compression = compression
        self._lock = threading.Lock()
        self._buffers: dict[str, list[pl.DataFrame]] = {t: [] for t in schema.TABLES}
        self._buffered: dict[str, int] = dict.fromkeys(schema.TABLES, 0)
        self._segments: dict[str, int] = dict.fromkeys(schema.TABLES, 0)
        self._rows: dict[str, int] = dict.fromkeys(schema.TABLES, 0)
        self._closed = False
        self._make_root()
        self._meta: dict[str, Any] = {
            "format": FORMAT,
            "schema_version": schema.SCHEMA_VERSION,
            "complete": False,
            "redacted": redact_text,
            "created_unix_ms": _now_ms(),
            **meta,
        }
        with self._lock:
            self._write_meta()

    # ------------------------------------------------------------------ public API
    @property
    def meta(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._meta)

    @property
    def closed(self) -> bool:
        return self._closed

    def rows_written(self, table: str) -> int:
        """Rows of `table` already in segments on disk (buffered rows not included)."""
        return self._rows[table]

    def append(self, table: str, df: pl.DataFrame) -> None:
        """Buffer rows of `table`; writes a segment each time `segment_rows` rows are buffered.

        Raises ValueError when the frame's columns or dtypes are not exactly the table's schema.
        """
        if table not in schema.TABLES:
            raise ValueError(f"unknown table {table!r}; tables are {sorted(schema.TABLES)}")
        diff = _schema_diff(table, df.schema)
        if diff:
            raise ValueError(f"frame does not match the {table} schema: {diff}")
        with self._lock:
            self._check_open()
            if df.height == 0:
                return
            if self.redact_text:
                df = df.with_columns(
                    pl.lit(None, dtype=schema.TABLES[table][c]).alias(c) for c in _TEXT_COLUMNS.get(table, ())
                )
            self._buffers[table].append(df)
            self._buffered[table] += df.height
            if self._buffered[table] >= self.segment_rows:
                self._flush_table(table, full_only=True)

    def flush(self) -> None:
        """Write every buffered row to disk now (one segment per table that has rows)."""
        with self._lock:
            self._check_open()
            self._flush_all()

    def update_meta(self, **kv: Any) -> None:
        """Merge `kv` into the metadata and rewrite meta.json."""
        self._check_reserved(kv)
        with self._lock:
            self._check_open()
            self._meta.update(kv)
            self._write_meta()

    def close(self, **final_meta: Any) -> None:
        """Flush, merge `final_meta` (end time, loss counters...) and mark the recording complete.

        A second call does nothing.
        """
        self._check_reserved(final_meta)
        with self._lock:
            if self._closed:
                return
            self._flush_all()
            self._meta.update(final_meta)
            self._meta.setdefault("closed_unix_ms", _now_ms())
            self._meta["complete"] = True
            self._write_meta()
            self._closed = True

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        # Keep what was captured, but do not claim completeness.
        with self._lock:
            if not self._closed:
                self._flush_all()
                self._closed = True

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"recording {self.path} is closed")

    @staticmethod
    def _check_reserved(kv: Mapping[str, Any]) -> None:
        reserved = _RESERVED_META & set(kv)
        if reserved:
            raise ValueError(f"meta keys {sorted(reserved)} are set by the writer")

    def _make_root(self) -> None:
        p = self.path
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                raise UsageError(f"{p} exists and is not a directory: choose another output directory")
            if (p / META_FILE).exists():
                raise UsageError(
                    f"{p} already holds a recording: choose another output directory (or delete that one)"
                )
            if any(p.iterdir()):
                raise UsageError(f"{p} is not empty: choose a new or empty output directory")
            self._secure_dir(p)
            return
        # Create missing parents too; every directory we create gets our mode and owner.
        missing: list[Path] = []
        q = p
        while not q.exists():
            missing.append(q)
            q = q.parent
        for d in reversed(missing):
            try:
                d.mkdir(mode=DIR_MODE)
            except FileExistsError:
                if d == p:
                    raise UsageError(
                        f"{p} appeared while creating it: choose another output directory"
                    ) from None
                continue
            except OSError as e:
                raise UsageError(f"cannot create {d}: {e.strerror}: choose another output directory") from e
            self._secure_dir(d)

    def _secure_dir(self, d: Path) -> None:
        os.chmod(d, DIR_MODE)
        if self.owner is not None:
            os.chown(d, *self.owner)

    def _write_atomic(self, final: Path, write: Callable[[BinaryIO], object]) -> None:
        """Write a file via a hidden temp name in the same directory, then rename it into place."""
        tmp = final.with_name(f".{final.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # os.open's mode is filtered by the umask
            if self.owner is not None:
                os.fchown(fd, *self.owner)
            with os.fdopen(fd, "wb", closefd=False) as f:
                write(f)
                f.flush()
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise

    def _write_meta(self) -> None:
        self._meta["tables"] = {
            t: {"rows": self._rows[t], "segments": self._segments[t]} for t in schema.TABLES
        }
        data = (json.dumps(self._meta, indent=2, sort_keys=True, default=str) + "\n").encode()
        self._write_atomic(self.path / META_FILE, lambda f: f.write(data))

    def _flush_all(self) -> None:
        wrote = False
        for table in schema.TABLES:
            wrote |= self._flush_table(table, full_only=False)
        if wrote:
            self._write_meta()

    def _flush_table(self, table: str, *, full_only: bool) -> bool:
        """Write buffered rows as segments of at most `segment_rows` rows. With `full_only`, a
        remainder smaller than a segment stays buffered. Returns whether anything was written."""
        if self._buffered[table] == 0:
            return False
        df = pl.concat(self._buffers[table], how="vertical", rechunk=False)
        self._buffers[table], self._buffered[table] = [], 0
        offset, wrote = 0, False
        while offset < df.height:
            n = min(self.segment_rows, df.height - offset)
            if full_only and n < self.segment_rows:
                break
            self._write_segment(table, df.slice(offset, n))
            offset += n
            wrote = True
        if offset < df.height:
            rest = df.slice(offset)
            self._buffers[table], self._buffered[table] = [rest], rest.height
        if wrote and full_only:
            self._write_meta()
        return wrote

    def _write_segment(self, table: str, df: pl.DataFrame) -> None:
        d = self.path / table
        if not d.is_dir():
            d.mkdir(mode=DIR_MODE, exist_ok=True)
            self._secure_dir(d)
        final = d / segment_name(self._segments[table])
        self._write_atomic(final, lambda f: df.write_parquet(f, compression=self._compression))
        self._segments[table] += 1
        self._rows[table] += df.height


class Recording:
    """A recording opened for reading (see `open`). Tables are read on first use and cached."""

    def __init__(self, path: Path, meta: dict[str, Any], *, skip_damaged: bool = False) -> None:
        self.path = path
        self.meta = meta
        self.skip_damaged = skip_damaged
        #: With skip_damaged, what was skipped (one message per damaged or missing segment).
        self.damaged: list[str] = []
        self._cache: dict[str, pl.DataFrame] = {}

    def _damage(self, message: str) -> None:
        if not self.skip_damaged:
            raise CorruptRecording(message + _SKIP_HINT)
        if message not in self.damaged:
            self.damaged.append(message)

    def __repr__(self) -> str:
        state = "complete" if self.complete else "incomplete"
        return f"<Recording {str(self.path)!r} ({state})>"

    @property
    def complete(self) -> bool:
        """False when the profiler never closed the recording (crash, kill, still running)."""
        return self.meta.get("complete") is True

    @property
    def redacted(self) -> bool:
        return self.meta.get("redacted") is True

    def tokens(self) -> pl.DataFrame:
        """One row per sampled token (schema.TOKENS), in end-of-step time order."""
        return self.table("tokens")

    def steps(self) -> pl.DataFrame:
        """One row per micro-batch (schema.STEPS), by step id."""
        return self.table("steps")

    def routes(self) -> pl.DataFrame:
        """One row per (micro-batch row, FFN layer) computed (schema.ROUTES), by step, row, layer."""
        return self.table("routes")

    def masks(self) -> pl.DataFrame:
        """Bit-packed activation masks (schema.MASKS); empty unless recorded with --capture-masks."""
        return self.table("masks")

    def requests(self) -> pl.DataFrame:
        """One row per request (schema.REQUESTS): identity, slot/sequence, timing, lengths."""
        return self.table("requests")

    def kernels(self) -> pl.DataFrame:
        """GPU kernel executions joined to their steps (schema.KERNELS); empty without the GPU path."""
        return self.table("kernels")

    def segments(self, table: str) -> list[Path]:
        """The segment files of `table`, in write order."""
        self._check_table(table)
        d = self.path / table
        if not d.is_dir():
            return []
        found: dict[int, Path] = {}
        for entry in d.iterdir():
            m = _SEGMENT_RE.match(entry.name)
            if m:
                found[int(m.group(1))] = entry
        indexes = sorted(found)
        gaps = sorted(set(range(indexes[-1] + 1)) - set(indexes)) if indexes else []
        for gap in gaps:
            self._damage(
                f"{d / segment_name(gap)} is missing (segments are numbered without gaps): "
                f"rows of the {table} table were lost"
            )
        tables = self.meta.get("tables")
        expected = tables.get(table, {}).get("segments") if isinstance(tables, dict) else None
        if self.complete and isinstance(expected, int) and expected > len(indexes) + len(gaps):
            self._damage(
                f"{d} holds {len(indexes)} segments but {self.path / META_FILE} records {expected}: "
                "segments were removed after the recording was closed"
            )
        return [found[i] for i in indexes]

    def table(self, name: str) -> pl.DataFrame:
        """A whole table as one frame with exactly the schema's columns and dtypes."""
        self._check_table(name)
        if name not in self._cache:
            frames = []
            for f in self.segments(name):
                try:
                    frames.append(_read_segment(name, f))
                    continue
                except CorruptRecording as e:
                    problem = str(e)
                self._damage(problem)  # raised outside the except: no chained traceback
            df = pl.concat(frames, how="vertical") if frames else schema.empty(name)
            keys = list(_SORT_KEYS.get(name, ()))
            if keys and df.height:
                df = df.sort(keys, nulls_last=True, maintain_order=True)
            self._cache[name] = df
        return self._cache[name]

    @staticmethod
    def _check_table(name: str) -> None:
        if name not in schema.TABLES:
            raise ValueError(f"unknown table {name!r}; tables are {sorted(schema.TABLES)}")


def _read_segment(table: str, path: Path) -> pl.DataFrame:
    try:
        df = pl.read_parquet(path, glob=False)  # a "[" in the folder name is no pattern
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # polars raises its own errors, OSError, and pyo3 PanicException
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptRecording(
            f"{path} is not a readable Parquet segment: it is truncated or damaged ({reason})"
        ) from None
    diff = _schema_diff(table, df.schema)
    if diff:
        raise CorruptRecording(f"{path} does not match the {table} table schema: {diff}")
    return df


def open(path: str | os.PathLike[str], *, skip_damaged: bool = False) -> Recording:
    """Open a recording directory written by `RecordingWriter`.

    Raises UsageError when `path` is not a directory, CorruptRecording when meta.json is missing
    or invalid or the recording comes from a newer sparseety-prof. Damaged or missing segments
    raise CorruptRecording when their table is read, unless `skip_damaged`: then they are left
    out and described in `Recording.damaged`.
    """
    p = Path(path)
    if not p.is_dir():
        what = "does not exist" if not p.exists() else "is not a directory"
        raise UsageError(f"{p} {what}: give the directory a recording was written to")
    meta_path = p / META_FILE
    try:
        text = meta_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CorruptRecording(
            f"{meta_path} is missing: {p} is not a sparseety-prof recording (or its metadata was deleted)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptRecording(f"{meta_path} cannot be read: {e}") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorruptRecording(
            f"{meta_path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    if not isinstance(meta, dict):
        raise CorruptRecording(f"{meta_path} must hold a JSON object, found {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise CorruptRecording(
            f"{meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}: "
            "not a sparseety-prof recording"
        )
    version = meta.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CorruptRecording(f"{meta_path} has an invalid schema_version {version!r}")
    if version > schema.SCHEMA_VERSION:
        raise CorruptRecording(
            f"{meta_path}: recorded with schema version {version}, this sparseety-prof reads up to "
            f"{schema.SCHEMA_VERSION}: upgrade sparseety-prof to read it"
        )
    return Recording(p, meta, skip_damaged=skip_damaged)
