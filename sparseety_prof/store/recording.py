"""The on-disk recording format: a directory of Parquet segments plus a JSON metadata file.

Layout::

    <recording>/
        meta.json                  run metadata (rewritten atomically; "complete": true once closed)
        tokens/part-000000.parquet one segment per flush, schema.TOKENS columns
        tokens/part-000001.parquet
        steps/part-000000.parquet  schema.STEPS columns
        ...
        journal/                   only while recording, or once killed (store/journal.py)
        journal/log-000003.arrows  the drains' rows no segment holds yet (append-only)

Every segment is written in full under a hidden temporary name (``.part-000003.parquet.<random>.tmp``)
and then renamed, so a crash or Ctrl-C loses at most the rows not yet flushed and a reader
never sees half a file. ``polars.scan_parquet(rec / "tokens" / "*.parquet")`` reads a table of a
recording one trusts; this module reads every recording as untrusted, through
store/recording_files.py (regular files only, sizes and nesting bounded, each segment's rows and
decoded size checked against meta.json and the schema before a value is decoded).
meta.json is written first with ``"complete": false``, so a recording killed at any moment is
readable; a disk-full or I/O error stops the writes and is recorded (``write_error``).

Between flushes, after each drain, the recorder appends the rows it made to a log in
``journal/`` (one record per table: a header naming the table, the segment S and row R the rows
follow, the payload's length and CRC-32, then the rows as an uncompressed Arrow IPC stream,
store/ipc_stream.py), without fsync, so that a recorder killed outright (SIGKILL, the OOM killer)
loses only about its last drain; the log is fsynced every ``--fsync-interval`` and removed once
segments hold its rows. A record's rows follow the first R rows written to its table's segments
from segment S on, so a reader takes from it only the rows the segments on disk do not hold (the
recorder may have died between writing a segment and removing the log it covers). `Recording`
adds those rows to a recording that was not closed (store/journal_reader.py); a record it cannot
read (torn, a checksum that fails, anything else) ends the reading of its log, named in
`Recording.damaged`; a closed recording has no journal, and one found in it is ignored.

Recordings hold secrets (token text, and routing/mask traces from which prompts can be
recovered), so every file is 0600 and every directory the writer creates 0700 whatever the
umask, and when the profiler runs under sudo they are handed to the invoking user (``owner``).
Files are created through an open directory, never through a symlink (store/output_dir.py).

This module is the format and its reader; the writer is store/recording_writer.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl

from sparseety_prof.errors import CorruptRecording, UsageError
from sparseety_prof.store import redaction_levels, schema
from sparseety_prof.store.journal_reader import journal_rows
from sparseety_prof.store.recording_files import (
    list_bounds,
    read_json,
    read_segment,
    schema_diff,
    segment_index,
    shown,
    table_dir_entries,
)

__all__ = [
    "FORMAT",
    "META_FILE",
    "Recording",
    "list_layers",
    "open",
    "schema_diff",
    "segment_name",
    "without_text",
]

FORMAT = "sparseety-prof-recording"
META_FILE = "meta.json"

_SKIP_HINT = "; open the recording with skip_damaged=True to read the rest"

# Column roles. Names come from the schema; these only say which schema column plays which role.
# (Candidates for schema.py itself, e.g. schema.TEXT_COLUMNS / schema.SORT_KEYS.)
TEXT_COLUMNS: dict[str, tuple[str, ...]] = {"tokens": ("token_text",)}


def without_text(table: str, df: pl.DataFrame) -> pl.DataFrame:
    """`df` (rows of `table`) with its text columns stored as nulls (--redact-text)."""
    return df.with_columns(
        pl.lit(None, dtype=schema.TABLES[table][c]).alias(c) for c in TEXT_COLUMNS.get(table, ())
    )


def list_layers(meta: Mapping[str, Any]) -> dict[str, list[int]]:
    """meta.json "layers": which model layer each element of the tokens table's per-layer lists
    is, by kind (moe, ffn, attn); {} when the recording has none."""
    layers = meta.get("layers")
    return {k: v for k, v in layers.items() if isinstance(v, list)} if isinstance(layers, dict) else {}


_SORT_KEYS: dict[str, tuple[str, ...]] = {
    "tokens": ("t_end_ns", "seq_id"),
    "steps": ("step_id",),
    "routes": ("step_id", "row", "layer"),
    "masks": ("step_id", "row", "layer"),
    "layer_times": ("step_id", "thread", "layer"),
    "requests": ("t_started_ns", "seq_id"),
    "kernels": ("launch_ns", "correlation_id"),
    "aggregates": ("bucket_unix_ms", "metric", "layer", "bin"),
    "thread_waits": ("step_id", "tid"),
    "cpu_stacks": ("t_first_ns", "tid"),
}
for _table, _cols in (*TEXT_COLUMNS.items(), *_SORT_KEYS.items()):
    _missing = [c for c in _cols if c not in schema.TABLES[_table]]
    if _missing:  # pragma: no cover - guards against a schema rename
        raise ImportError(f"recording: columns {_missing} are not in schema.TABLES[{_table!r}]")


def segment_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


class Recording:
    """A recording opened for reading (see `open`). Tables are read on first use and cached."""

    def __init__(
        self,
        path: Path,
        meta: dict[str, Any],
        *,
        skip_damaged: bool = False,
        meta_bytes: bytes | None = None,
    ) -> None:
        self.path = path
        self.meta = meta
        #: meta.json exactly as it was read and parsed (None for a Recording built from a dict)
        self.meta_bytes = meta_bytes
        self.skip_damaged = skip_damaged
        #: the longest list each list column may hold per row (meta.json "layers", the schema)
        self.list_bounds = list_bounds(meta)
        #: What was skipped (one message per damaged or missing segment): with skip_damaged, any
        #: such segment; without, only the unreadable last segment of an interrupted recording.
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

    @property
    def redaction_levels(self) -> list[str]:
        """The redaction levels the recording was written with ([] for none, or an older recording)."""
        levels = section(self, "redaction").get("levels")
        if levels is None:
            return []
        if not isinstance(levels, list) or not all(isinstance(x, str) for x in levels):
            raise CorruptRecording(
                f"{shown(self.path / META_FILE)}: redaction.levels must be a list of names"
            )
        return redaction_levels.ordered(levels)

    @property
    def redaction_layers(self) -> list[int] | None:
        """The layers the per-layer redaction levels were limited to (None: every layer)."""
        layers = section(self, "redaction").get("layers")
        if layers is not None and not (isinstance(layers, list) and all(type(x) is int for x in layers)):
            raise CorruptRecording(
                f"{shown(self.path / META_FILE)}: redaction.layers must be a list of layers"
            )
        return layers

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

    def aggregates(self) -> pl.DataFrame:
        """Always-on counts per wall-clock bucket (schema.AGGREGATES): expert load, sparsity,
        log-prob and step-latency histograms, kept whatever the policy dropped of the rows."""
        return self.table("aggregates")

    def cpu_stacks(self) -> pl.DataFrame:
        """The CPU sampler's folded stacks per step and thread (schema.CPU_STACKS); empty when
        recorded with --cpu-sample-hz 0."""
        return self.table("cpu_stacks")

    def anomalies(self) -> pl.DataFrame:
        """What the anomaly detectors (store/anomalies/) find in the tokens and steps, as
        schema.ANOMALIES rows; computed on each call, never stored."""
        from sparseety_prof.store.anomalies import detect

        return detect(
            self.tokens(), self.steps(), self.meta, self.table("thread_waits"), self.table("layer_times")
        )

    def segments(self, table: str) -> list[Path]:
        """The segment files of `table`, in write order."""
        self._check_table(table)
        d = self.path / table
        found: dict[int, Path] = {}
        for name in table_dir_entries(d):  # [] when missing; a symlink or a file refused
            index = segment_index(name)
            if index is not None:
                found[index] = d / name
        # segments before the table's first were removed by --max-disk (one may remain when the
        # recorder was killed between recording that and removing it)
        first = _first_segment(self.meta, table)
        indexes = sorted(i for i in found if i >= first)
        gaps = sorted(set(range(first, indexes[-1] + 1)) - set(indexes)) if indexes else []
        for gap in gaps:
            self._damage(
                f"{shown(d / segment_name(gap))} is missing (segments are numbered without gaps): "
                f"rows of the {table} table were lost"
            )
        tables = self.meta.get("tables")
        expected = tables.get(table, {}).get("segments") if isinstance(tables, dict) else None
        if self.complete and isinstance(expected, int) and expected > len(indexes) + len(gaps):
            self._damage(
                f"{shown(d)} holds {len(indexes)} segments but {shown(self.path / META_FILE)} records "
                f"{expected}: segments were removed after the recording was closed"
            )
        return [found[i] for i in indexes]

    def table(self, name: str) -> pl.DataFrame:
        """A whole table as one frame with exactly the schema's columns and dtypes."""
        self._check_table(name)
        if name not in self._cache:
            frames, held = self._segment_frames(name, exact_schema=True)
            if not self.complete:  # the rows only the journal holds (store/journal_reader.py)
                first = _first_segment(self.meta, name)
                frames += journal_rows(self.path, name, held, first, self.meta, self.damaged.append)
            df = pl.concat(frames, how="vertical") if frames else schema.empty(name)
            keys = list(_SORT_KEYS.get(name, ()))
            if keys and df.height:
                df = df.sort(keys, nulls_last=True, maintain_order=True)
            self._cache[name] = df
        return self._cache[name]

    def segment_frames(self, name: str, *, exact_schema: bool = True) -> list[pl.DataFrame]:
        """The segments of table `name` as frames in write order, each read and checked through
        store/recording_files.py, damaged ones raised or left out as for `table` (the journal not
        read). `exact_schema=False` accepts segments that lack columns (an older recording's, for
        `collect` to fill with nulls)."""
        self._check_table(name)
        return self._segment_frames(name, exact_schema=exact_schema)[0]

    def _segment_frames(self, name: str, *, exact_schema: bool) -> tuple[list[pl.DataFrame], dict[str, int]]:
        frames: list[pl.DataFrame] = []
        files = self.segments(name)
        # the rows meta.json accounts for bound what the segments it knows may hold, checked
        # from each footer before a value is decoded (a segment of rows meta.json does not
        # account for is a lie, or a decompression bomb); an interrupted recording may hold
        # segments written after its last meta.json, which only their own bounds limit
        accounted, known = _accounted(self.meta, name)
        if self.complete:  # a closed recording's meta.json counts every segment: none may add rows
            known = len(files)
        read = 0
        held: dict[str, int] = {}  # rows of each segment read, for the journal
        for i, f in enumerate(files):
            max_rows = max(accounted - read, 0) if accounted is not None and i < known else None
            try:
                frames.append(
                    read_segment(
                        f, name, max_rows=max_rows, bounds=self.list_bounds, exact_schema=exact_schema
                    )
                )
                read += frames[-1].height
                held[f.name] = frames[-1].height
                continue
            except CorruptRecording as e:
                problem = str(e)
            if not self.complete and i == len(files) - 1:
                # where an interrupted recording ends: left out, as the rows never flushed are
                self.damaged.append(f"{problem} (the recording was interrupted; left out)")
                continue
            self._damage(problem)  # raised outside the except: no chained traceback
        if self.complete and accounted is not None and read < accounted and len(frames) == len(files):
            self._damage(
                f"{shown(self.path / name)} holds {read} rows but {shown(self.path / META_FILE)} "
                f"records {accounted}: rows of the {name} table were lost"
            )
        return frames, held

    @staticmethod
    def _check_table(name: str) -> None:
        if name not in schema.TABLES:
            raise ValueError(f"unknown table {name!r}; tables are {sorted(schema.TABLES)}")


def _first_segment(meta: Mapping[str, Any], table: str) -> int:
    """The index of a table's oldest segment kept (0 unless segments were rotated out)."""
    tables = meta.get("tables")
    entry = tables.get(table) if isinstance(tables, dict) else None
    first = entry.get("first_segment", 0) if isinstance(entry, dict) else 0
    return first if isinstance(first, int) and not isinstance(first, bool) and first >= 0 else 0


def _accounted(meta: Mapping[str, Any], table: str) -> tuple[int | None, int]:
    """(rows, segments) meta.json records for `table`'s segments on disk: the rows the first
    `segments` segments hold (None where meta.json does not say: an older recording)."""
    tables = meta.get("tables")
    entry = tables.get(table) if isinstance(tables, dict) else None
    if not isinstance(entry, dict):
        return None, 0
    rows, segments = entry.get("rows"), entry.get("segments")
    if not isinstance(rows, int) or isinstance(rows, bool):
        return None, 0
    known = segments if isinstance(segments, int) and not isinstance(segments, bool) else 1 << 62
    return max(rows, 0), max(known, 0)


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
        raise UsageError(f"{shown(p)} {what}: give the directory a recording was written to")
    meta_path = p / META_FILE
    try:
        meta, meta_bytes = read_json(meta_path)  # regular file, size and nesting bounded
    except FileNotFoundError:
        raise CorruptRecording(
            f"{shown(meta_path)} is missing: {shown(p)} is not a sparseety-prof recording (or its "
            "metadata was deleted)"
        ) from None
    shown_meta = shown(meta_path)
    if not isinstance(meta, dict):
        raise CorruptRecording(f"{shown_meta} must hold a JSON object, found {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise CorruptRecording(
            shown(
                f"{meta_path} has format {_short(meta.get('format'))}, expected {FORMAT!r}: "
                "not a sparseety-prof recording"
            )
        )
    version = meta.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CorruptRecording(shown(f"{meta_path} has an invalid schema_version {_short(version)}"))
    if version > schema.SCHEMA_VERSION:
        raise CorruptRecording(
            f"{shown_meta}: recorded with schema version {version}, this sparseety-prof reads up to "
            f"{schema.SCHEMA_VERSION}: upgrade sparseety-prof to read it"
        )
    _check_meta_types(meta, meta_path)
    return Recording(p, meta, skip_damaged=skip_damaged, meta_bytes=meta_bytes)


def _short(value: object, most: int = 80) -> str:
    """repr of a value from meta.json, cut to `most` characters (a message stays one short line)."""
    r = repr(value)
    return r if len(r) <= most else r[: most - 1] + "…"


#: The types of meta.json's entries that this module writes and reads itself (the rest is the
#: caller's: views take it through `section`). An entry may be absent or null; present with another
#: type, the recording is damaged (CorruptRecording), so no reader guards against "tables": [].
_META_TYPES: dict[str, type] = {"tables": dict, "complete": bool, "redacted": bool, "redaction": dict}


def _check_meta_types(meta: Mapping[str, Any], meta_path: Path) -> None:
    for key, want in _META_TYPES.items():
        v = meta.get(key)
        if v is not None and not isinstance(v, want):
            raise CorruptRecording(
                f"{shown(meta_path)}: {key!r} is {type(v).__name__}, expected {_type_names(want)}"
            )
    for name, entry in (meta.get("tables") or {}).items():
        if not isinstance(entry, dict):
            raise CorruptRecording(
                shown(f"{meta_path}: tables.{_short(name)} is {type(entry).__name__}, expected object")
            )


def section(rec: Recording, key: str) -> dict[str, Any]:
    """meta.json's object `key` ({} when absent or null); CorruptRecording when it is something
    else: a view reads a damaged recording as damaged (exit 7), never as a traceback."""
    v = rec.meta.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise CorruptRecording(
            f"{shown(rec.path / META_FILE)}: {key!r} is {type(v).__name__}, expected object"
        )
    return v


def _type_names(want: type) -> str:
    return {dict: "object", bool: "true or false"}.get(want, want.__name__)
